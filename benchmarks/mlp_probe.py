"""The SwiGLU inside the MLP's GEMMs (`aner.kernels.mlp`) against its GEMMs alone, at
Llama-3.2-1B's MLP as QLoRA's rows call it (8 x 1024 tokens; forward: x' (2048 + 48 joined
columns) @ [W_gate; W_up]^T, 8192 wide each; backward: dh = g' @ [W_down; A's parts], 2096
reduced, 8192 wide).

The kernels as built, an earlier tree's (OLD, a folder holding its `src/`), and, for timing only,
copies of this tree's backward with one part of its epilogue's work left out:

    no gate/up loads   the epilogue reads dh where it would read gate and up (no TMA of them)
    no stores          dgate and dup computed, their stores predicated off
    neither            both of the above

Each backward's outputs are checked against the separate path's (cuBLAS's dh, then the SwiGLU
kernel's backward: the same bits at this shape), the forward's against the earlier tree's where
one is given (else against cuBLAS's products and the SwiGLU kernel: within rounding); GPU time of
back-to-back calls under CUDA graphs (`joint_gemms.timed`), with cuBLAS's GEMMs alone.

    python benchmarks/mlp_probe.py OUT.json [OLD]
"""
import importlib.util
import json
import pathlib
import sys
import tempfile

import torch
import triton

from joint_gemms import timed
from aner.kernels import mlp
from aner.kernels.layer import swiglu, swiglu_grad

NO_LOADS = [("        _gate_up(gate_desc, up_desc, e_bufs, e_ready, gl.program_id(0), tiles, M, F, BMc, BNc, GROUP)",
             "        pass"),
            ("mbarrier.wait(e_ready.index(0), j & 1)", "pass"),
            ("a = e_bufs.index(0).slice", "a = s_bufs.index(0).slice"),
            ("b = e_bufs.index(1).slice", "b = s_bufs.index(0).slice"),
            ("_gate_up(gate_desc, up_desc, e_bufs, e_ready, tile + gl.num_programs(0), tiles, M, F, BMc, BNc, GROUP)",
             "pass")]
NO_STORES = [("mask = ((c * C + rows) < M)[:, None] & (cols < F)[None, :]\n",       # d_rows = 2F: no row stored
              "mask = ((c * C + rows) < M - 8 * d_rows)[:, None] & (cols < F)[None, :]\n")]
PATCHES = {"no gate/up loads": NO_LOADS, "no stores": NO_STORES, "neither": NO_LOADS + NO_STORES}


def patched(source: pathlib.Path, edits, folder):
    """A copy of the module at `source` with `edits` made, imported as its own module."""
    text = source.read_text().replace("from .nf4", "from aner.kernels.nf4")
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = pathlib.Path(folder) / f"mlp_{len(list(pathlib.Path(folder).iterdir()))}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(path, old=None):
    torch.manual_seed(0)
    M, D, F, j = 8192, 2048, 8192, 48
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(M, D + j, device=dev, dtype=bf)
    w = torch.randn(2 * F, D + j, device=dev, dtype=bf) * 0.02
    g = torch.randn(M, D + j, device=dev, dtype=bf) * 0.01
    wd = torch.randn(D + j, F, device=dev, dtype=bf) * 0.02
    gate, up = torch.randn(M, 2 * F, device=dev, dtype=bf).split(F, 1)
    want = swiglu_grad(gate, up, g @ wd)
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "shapes": dict(M=M, K=D + j, F=F), "old": old, "checks": {}}
    runs = {"forward: cublas gate and up alone": lambda: x @ w.t(), "backward: cublas dh alone": lambda: g @ wd}
    with tempfile.TemporaryDirectory() as folder:
        kernels = {"this tree": mlp}
        if old:
            kernels["old tree"] = patched(pathlib.Path(old) / "src/aner/kernels/mlp.py", [], folder)
        y = x @ w.t()
        reference = kernels.get("old tree", mlp).gated_forward(x, w[:F], w[F:])
        for name, module in kernels.items():
            call = runs[f"forward: {name}"] = lambda module=module: module.gated_forward(x, w[:F], w[F:])
            got = call()
            close = (got[0] - y[:, :F]).abs().max() <= 2 ** -7 * y.abs().max() and torch.equal(got[2], swiglu(*got[:2]))
            out["checks"][f"forward: {name}"] = bool(close) and all(torch.equal(a, b) for a, b in zip(got, reference))
        for name, module in kernels.items():
            call = runs[f"backward: {name}"] = lambda module=module: module.gated_backward(g, wd, gate, up)
            out["checks"][f"backward: {name}"] = all(torch.equal(a, b) for a, b in zip(call(), want))
        for name, edits in PATCHES.items():
            module = patched(pathlib.Path(mlp.__file__), edits, folder)
            runs[f"backward: {name}"] = lambda module=module: module.gated_backward(g, wd, gate, up)
        print(json.dumps(out["checks"], indent=1), flush=True)
        out["us"] = timed(runs)
    print(json.dumps(out["us"], indent=1), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])

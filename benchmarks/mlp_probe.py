"""The SwiGLU inside the MLP's GEMMs (`aner.kernels.mlp`) against its GEMMs alone, at
Llama-3.2-1B's MLP as QLoRA's rows call it (8 x 1024 tokens; forward: x' (2048 + 48 joined
columns) @ [W_gate; W_up]^T, 8192 wide each; backward: dh = g' @ [W_down; A's parts], 2096
reduced, 8192 wide).

The kernels as built, an earlier tree's (OLD, a folder holding its `src/`), the backward with a
deeper ring of operand tiles, and, for timing only, copies of this tree's with one part of the
backward's epilogue changed:

    evict first   gate's and up's loads marked as read once (L2's evict-first policy)
    no stores     dgate and dup computed, their stores predicated off

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

EVICT_FIRST = [("a = gl.load(_rows(gate, rows, g_rows, cols), mask=mask)",
                "a = gl.load(_rows(gate, rows, g_rows, cols), mask=mask, eviction_policy='evict_first')"),
               ("b = gl.load(_rows(up, rows, u_rows, cols), mask=mask)",
                "b = gl.load(_rows(up, rows, u_rows, cols), mask=mask, eviction_policy='evict_first')"),
               ("a_next = gl.load(_rows(gate, r + C, g_rows, cols), mask=later)",
                "a_next = gl.load(_rows(gate, r + C, g_rows, cols), mask=later, eviction_policy='evict_first')"),
               ("b_next = gl.load(_rows(up, r + C, u_rows, cols), mask=later)",
                "b_next = gl.load(_rows(up, r + C, u_rows, cols), mask=later, eviction_policy='evict_first')")]
NO_STORES = [("                sg = _sigmoid(a)\n",
              "                sg = _sigmoid(a)\n                mask = mask & (M < 0)\n")]
PATCHES = {"evict first": EVICT_FIRST, "no stores": NO_STORES}
RINGS = [(64, 5), (64, 6), (128, 3)]      # (reduced elements a step, ring depth); the default mlp.BACKWARD


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
        calls = {name: (lambda module=module: module.gated_backward(g, wd, gate, up))
                 for name, module in kernels.items()}
        calls |= {f"ring {tiles}": (lambda tiles=tiles: mlp.gated_backward(g, wd, gate, up, tiles=tiles))
                  for tiles in RINGS}
        for name, call in calls.items():
            out["checks"][f"backward: {name}"] = all(torch.equal(a, b) for a, b in zip(call(), want))
            runs[f"backward: {name}"] = call
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

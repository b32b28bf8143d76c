"""Where the gated backward's time above its GEMM goes (`aner.kernels.mlp.gated_backward` at
Llama-3.2-1B's MLP: 8 x 1024 tokens, dh = g' @ [W_down; A's parts] (2048 + 48 reduced, 8192 wide)).

The kernel as built, its staging of dh in two slots (the MMAs up to two tiles ahead of the
epilogue), and, for timing only, copies of it with one part of the epilogue's work left out:

    no gate/up loads   the epilogue reads dh where it would read gate and up (no TMA of them)
    no stores          dgate and dup computed, their stores predicated off
    neither            both of the above
    streamed stores    (not for timing only) dgate's and dup's stores marked as read once (`.cs`)

Each real variant is checked against the kernel as built (the same bits); GPU time of back-to-back
calls under CUDA graphs (`joint_gemms.timed`), with cuBLAS's dh alone for reference.

    python benchmarks/mlp_backward_probe.py OUT.json
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

NO_LOADS = [("        _gate_up(gate_desc, up_desc, e_bufs, e_ready, gl.program_id(0), tiles, M, F, BMc, BNc, GROUP)",
             "        pass"),
            ("            mbarrier.wait(e_ready.index(0), j & 1)", "            pass"),
            ("a = e_bufs.index(0).slice", "a = s_bufs.index(k).slice"),
            ("b = e_bufs.index(1).slice", "b = s_bufs.index(k).slice"),
            ("_gate_up(gate_desc, up_desc, e_bufs, e_ready, tile + gl.num_programs(0), tiles, M, F, BMc, BNc, GROUP)",
             "pass")]
NO_STORES = [("mask = ((c * C + rows) < M)[:, None]",         # d_rows = 2F: no row stored
              "mask = ((c * C + rows) < M - 8 * d_rows)[:, None]")]
STREAMED = [(f"{t}.dtype.element_ty), mask=mask)", f"{t}.dtype.element_ty), mask=mask, cache_modifier='.cs')")
            for t in ("dgate", "dup")]
PATCHES = {"streamed stores": STREAMED, "no gate/up loads": NO_LOADS, "no stores": NO_STORES,
           "neither": NO_LOADS + NO_STORES}


def patched(edits, folder):
    """A copy of `aner.kernels.mlp` with `edits` made, imported as its own module."""
    text = pathlib.Path(mlp.__file__).read_text().replace("from .nf4", "from aner.kernels.nf4")
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    path = pathlib.Path(folder) / f"mlp_{len(list(pathlib.Path(folder).iterdir()))}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(path):
    torch.manual_seed(0)
    M, D, F, j = 8192, 2048, 8192, 48
    dev, bf = "cuda", torch.bfloat16
    g = torch.randn(M, D + j, device=dev, dtype=bf) * 0.01
    wd = torch.randn(D + j, F, device=dev, dtype=bf) * 0.02
    gate, up = torch.randn(M, 2 * F, device=dev, dtype=bf).split(F, 1)
    want = mlp.gated_backward(g, wd, gate, up)
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "shapes": dict(M=M, K=D + j, F=F), "checks": {}}
    runs = {"cublas dh alone": lambda: g @ wd}
    for tiles in [(64, 4, 1), (64, 3, 2), (32, 6, 2), (64, 3, 1)]:
        name = "tiles {}x{} slots {}".format(*tiles)
        out["checks"][name] = all(torch.equal(a, b) for a, b in zip(mlp.gated_backward(g, wd, gate, up, tiles=tiles),
                                                                    want))
        runs[name] = lambda tiles=tiles: mlp.gated_backward(g, wd, gate, up, tiles=tiles)
    with tempfile.TemporaryDirectory() as folder:
        for name, edits in PATCHES.items():
            module = patched(edits, folder)
            if name == "streamed stores":
                out["checks"][name] = all(torch.equal(a, b) for a, b in zip(module.gated_backward(g, wd, gate, up),
                                                                            want))
            for tiles in [(64, 4, 1), (64, 3, 2)]:
                runs["{}, slots {}".format(name, tiles[2])] = \
                    lambda module=module, tiles=tiles: module.gated_backward(g, wd, gate, up, tiles=tiles)
        print(json.dumps(out["checks"]), flush=True)
        out["us"] = timed(runs)
    print(json.dumps(out["us"], indent=1), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

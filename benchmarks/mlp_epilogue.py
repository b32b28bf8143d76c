"""SwiGLU inside the MLP's GEMMs (`aner.kernels.mlp`) against the projections and the SwiGLU made
apart, as QLoRA's MLP makes them (decoded weights kept, rank-16 deltas joined along K), at
Llama-3.2-1B's shapes (8 x 1024 tokens, hidden 2048, intermediate 8192) or Llama-3.1-8B's (4096,
14336):

    forward   apart: gate = x' @ [B_gate's parts | W_gate]^T, up = x' @ [W_up | B_up's parts]^T
                     (two cuBLAS GEMMs over x' = [u_gate's parts | x | u_up's parts]), then the
                     SwiGLU kernel; gated: one kernel over x' and the paired weights (`lora._paired`)
    backward  apart: dh = g' @ [W_down; A's parts] (cuBLAS), then the SwiGLU kernel's backward;
                     gated: one kernel
    gate's and up's input gradient: [dgate | dup] @ the pair's weights (one GEMM) against
                     dgate @ W_gate + dup @ W_up (a chain of two)

Each gated output is compared with the apart path's (the largest difference; 0: the same bits).
GPU time of back-to-back calls under CUDA graphs, the variants in turn (`joint_gemms.timed`).

    python benchmarks/mlp_epilogue.py OUT.json [llama-3.2-1b | llama-3.1-8b | smoke]
                                              (smoke: small shapes, the checks alone)
"""
import json
import sys

import torch
import triton

from joint_gemms import timed
from aner.kernels import mlp
from aner.kernels.layer import _swiglu_launch, swiglu_grad

SHAPES = {"llama-3.2-1b": (8192, 2048, 8192, 16), "llama-3.1-8b": (8192, 4096, 14336, 16),
          "smoke": (1024, 512, 1024, 16)}         # (tokens, hidden, intermediate, rank)
FORWARD = [(32, 6), (64, 3)]                      # (reduced elements a step, ring depth)
BACKWARD = [(64, 4), (32, 8)]


def main(path, shape="llama-3.2-1b"):
    torch.manual_seed(0)
    M, D, F, r = SHAPES[shape]
    j = 3 * r                                     # an adapter's joined columns
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(M, j + D + j, device=dev, dtype=bf)
    w = torch.randn(2 * F, j + D + j, device=dev, dtype=bf) * 0.02     # the paired weights
    w[:F, j + D:] = 0
    w[F:, :j] = 0
    g = torch.randn(M, D + j, device=dev, dtype=bf) * 0.01
    wd = torch.randn(D + j, F, device=dev, dtype=bf) * 0.02
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "model": shape, "shapes": dict(M=M, D=D, F=F, rank=r)}

    def apart_forward():
        gate, up = torch.mm(x[:, :j + D], w[:F, :j + D].t()), torch.mm(x[:, j:], w[F:, j:].t())
        h = torch.empty(M, F, device=dev, dtype=bf)
        _swiglu_launch(gate, up, h, h, h, backward=False)
        return gate, up, h

    gate_a, up_a, h_a = apart_forward()
    d_a = swiglu_grad(gate_a, up_a, g @ wd)
    dd = torch.cat(d_a, 1)
    wm = w[:, j:j + D]                            # the pair's weights, as the input gradient reads them
    dx = torch.empty(M, D, device=dev, dtype=bf)

    def differs(a, b):
        return (a.float() - b.float()).abs().max().item()

    runs, checks = {"apart forward": apart_forward,
                    "apart backward": lambda: swiglu_grad(gate_a, up_a, g @ wd),
                    "input gradient, one GEMM": lambda: torch.mm(dd, wm, out=dx),
                    "input gradient, chain of two": lambda: torch.mm(d_a[0], wm[:F], out=dx).addmm_(d_a[1], wm[F:])}, {}
    for tiles, skip, group in [(t, True, 8) for t in FORWARD] + [(FORWARD[0], False, 8), (FORWARD[0], True, 16)]:
        name = f"gated forward {tiles[0]}x{tiles[1]} group {group}" + ("" if skip else ", zeros multiplied")
        cols = dict(gate_cols=j + D, up_first=j) if skip else {}
        gate, up, h = mlp.gated_forward(x, w[:F], w[F:], tiles=tiles, group=group, **cols)
        checks[name] = dict(gate=differs(gate, gate_a), up=differs(up, up_a), h=differs(h, h_a))
        runs[name] = lambda tiles=tiles, cols=cols, group=group: mlp.gated_forward(x, w[:F], w[F:], tiles=tiles,
                                                                                   group=group, **cols)
    for tiles in BACKWARD:
        for group in (8, 16):
            name = f"gated backward {tiles[0]}x{tiles[1]} group {group}"
            d = mlp.gated_backward(g, wd, gate_a, up_a, tiles=tiles, group=group)
            checks[name] = dict(dgate=differs(d[0], d_a[0]), dup=differs(d[1], d_a[1]))
            runs[name] = lambda tiles=tiles, group=group: mlp.gated_backward(g, wd, gate_a, up_a, tiles=tiles,
                                                                             group=group)
    out["checks"] = checks
    print(json.dumps(checks, indent=1), flush=True)
    if shape == "smoke":
        return
    out["us"] = timed(runs)
    print(json.dumps(out["us"], indent=1), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""The adapters' products over an (M, N) BF16 operand against the bandwidth: ours (project: p @ B
written as BF16 parts, sum_splits included; reduce_tokens: p^T @ u) against cuBLAS on the same BF16
parts with an FP32 output (torch.mm's out_dtype: the three parts' products still to be summed) or a
BF16 one, and torch's sum of p (one read). At 8192 tokens and widths 8192, 14336, 2048
and 4096, rank 16; GPU time of back-to-back calls under a CUDA graph (`joint_gemms.timed`), each
also as TB/s of p's bytes (at 2048 wide p is 33.5 MB, which the 50 MB L2 may partly hold between
calls); each product's largest error against float64 relative to |p| |B|.

    python benchmarks/adapter_bandwidth.py OUT.json
"""
import json
import sys

import torch

from joint_gemms import timed
from aner.kernels import lora as L

SHAPES = ((8192, 8192), (8192, 14336), (8192, 2048), (8192, 4096))


def case(M, N, r=16):
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(N, r, device="cuda", generator=g) * 0.01
    u = L.to_parts(torch.randn(M, r, device="cuda", generator=g))
    planes = torch.empty(3, M, r, device="cuda", dtype=torch.bfloat16)
    bp = L.to_parts(b).permute(1, 0, 2).reshape(N, 3 * r).contiguous()       # [hi | mid | lo] (N, 3r)
    up = u.permute(1, 0, 2).reshape(M, 3 * r).contiguous()
    out = timed({
        "project_us": lambda: L.project(p, b.t(), parts=planes),
        "mm_project_us": lambda: torch.mm(p, bp, out_dtype=torch.float32),
        "mm_project_bf16_us": lambda: torch.mm(p, bp),
        "reduce_us": lambda: L.reduce_tokens(p, u),
        "mm_reduce_us": lambda: torch.mm(p.t(), up, out_dtype=torch.float32),
        "read_us": lambda: p.sum(dtype=torch.float32),
    })
    for k in list(out):
        out[k.replace("_us", "_tbs")] = M * N * 2 / 1e6 / out[k]
    ref = p.double() @ b.double()
    scale = p.double().abs() @ b.double().abs()
    mm = torch.mm(p, bp, out_dtype=torch.float32).view(M, 3, r).sum(1)
    out["err_mm_project"] = ((mm.double() - ref).abs() / scale).max().item()
    out["err_project"] = ((L.project(p, b.t()).double() - ref).abs() / scale).max().item()
    return out


def main(path):
    result = {}
    for M, N in SHAPES:
        r = result[f"{M}x{N}"] = case(M, N)
        print(M, N, " ".join(f"{k}={v:.3g}" for k, v in r.items()), flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

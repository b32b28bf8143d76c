"""The adapters' products over an (M, N) BF16 operand against the bandwidth: ours (project: p @ B
written as BF16 parts, sum_splits included; reduce_tokens: p^T @ u) against cuBLAS on the same BF16
parts with an FP32 output (torch.mm's out_dtype: the three parts' products still to be summed) or a
BF16 one, and torch's sum of p (one read). At 8192 tokens and widths 8192, 14336, 2048
and 4096, rank 16; GPU time of back-to-back calls under a CUDA graph (`joint_gemms.timed`), each
also as TB/s of p's bytes; each product's largest error against float64 relative to |p| |B|.

    python benchmarks/adapter_bandwidth.py OUT.json
"""
import json
import sys

import torch

from joint_gemms import timed
from aner.kernels import lora as L

out = {}
for M, N in ((8192, 8192), (8192, 14336), (8192, 2048), (8192, 4096)):
    g = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=g)
    b = torch.randn(N, 16, device="cuda", generator=g) * 0.01
    u = L.to_parts(torch.randn(M, 16, device="cuda", generator=g))
    planes = torch.empty(3, M, 16, device="cuda", dtype=torch.bfloat16)
    bp = L.to_parts(b).permute(1, 0, 2).reshape(N, 48).contiguous()          # [hi | mid | lo] (N, 48)
    up = u.permute(1, 0, 2).reshape(M, 48).contiguous()
    r = timed({
        "project_us": lambda: L.project(p, b.t(), parts=planes),
        "mm_project_us": lambda: torch.mm(p, bp, out_dtype=torch.float32),
        "mm_project_bf16_us": lambda: torch.mm(p, bp),
        "reduce_us": lambda: L.reduce_tokens(p, u),
        "mm_reduce_us": lambda: torch.mm(p.t(), up, out_dtype=torch.float32),
        "read_us": lambda: p.sum(dtype=torch.float32),
    })
    for k in list(r):
        r[k.replace("_us", "_tbs")] = M * N * 2 / 1e6 / r[k]
    ref = p.double() @ b.double()
    mm = torch.mm(p, bp, out_dtype=torch.float32).view(M, 3, 16).sum(1)
    ours = L.project(p, b.t())
    scale = p.double().abs() @ b.double().abs()
    r["err_mm_project"] = ((mm.double() - ref).abs() / scale).max().item()
    r["err_project"] = ((ours.double() - ref).abs() / scale).max().item()
    out[f"{M}x{N}"] = r
    print(M, N, " ".join(f"{k}={v:.3g}" for k, v in r.items()), flush=True)
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=1)

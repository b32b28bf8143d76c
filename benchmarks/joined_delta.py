"""An adapter's forward delta joined to its base's GEMM along K (`kernels.lora._joined`) against
the delta written by expand and added by the GEMM (beta = 1), for decoded NF4 bases at the shapes
of a batch of 8 x 1024 tokens, rank 16, SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B: the groups of
one or two projections that read one input (o; gate, up; down; q, k, v is three, which the joined
layout does not take). Each variant is a group's whole forward: project, each base's decode and
product. GPU time of back-to-back calls under a CUDA graph, medians of repeats in which the
variants take turns (`joint_gemms.timed`):

    delta_us     project, then for each base: decode, expand's delta, the GEMM onto it
    joined_us    project writing x' too, then for each base: decode with spare columns, B's parts
                 written there, one GEMM over K + 3 r
    decode_us    the decodes alone (in both)
    gemm_us      the GEMMs over K alone, writing their output (no delta: the floor of both)

and each output's largest error against float64, both paths (one rounding joined, two added).
Then the input gradient of one base (o; down), du @ A joined to its GEMM (`kernels.lora._joined_grad`)
against expand's du @ A added by the GEMM: project's du = g @ B, the decode and the product(s),
`grad_delta_us` and `grad_joined_us` (and their errors, `grad_err_*`).

    python benchmarks/joined_delta.py OUT.json
"""
import json
import sys

import torch

from joint_gemms import timed
from aner.kernels import lora as L
from aner.kernels.nf4 import DevicePacked
from aner.quant.module import NF4Module
from aner.quant.nf4 import NF4Weight

MODELS = {"smollm2-135m": (576, 1536), "llama-3.2-1b": (2048, 8192), "llama-3.1-8b": (4096, 14336)}   # D, F


def group(M, K, rows, r=16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
    weights = [NF4Weight.quantize(torch.randn(n, K) * 0.02) for n in rows]
    bases = [NF4Module(w, device_copy=DevicePacked.from_weight(w, "cuda"), decoded=True) for w in weights]
    a = torch.randn(r * len(rows), K, device="cuda", generator=g) / K ** 0.5
    bs = [torch.randn(n, r, device="cuda", generator=g) * 0.01 for n in rows]
    planes = torch.empty(3, M, a.shape[0], device="cuda", dtype=torch.bfloat16)

    def delta():
        u = L.project(x, a, parts=planes)
        outs = []
        for i, (base, b) in enumerate(zip(bases, bs)):
            out = L.expand(u[:, :, i * r:(i + 1) * r], b, None, torch.bfloat16)
            outs.append(out.addmm_(x, base.operand(torch.bfloat16).t()))
        return outs

    def joined():
        wide = torch.empty(M, 3 * a.shape[0] + K, device="cuda", dtype=torch.bfloat16)
        L.project(x, a, parts=planes, joined=(wide, r))
        return [L._joined_product(base, i, wide, r, b, 1.0, torch.bfloat16)[0]
                for i, (base, b) in enumerate(zip(bases, bs))]

    decoded = [base.operand(torch.bfloat16) for base in bases]
    out = timed({
        "delta_us": delta,
        "joined_us": joined,
        "decode_us": lambda: [base.operand(torch.bfloat16) for base in bases],
        "gemm_us": lambda: [torch.mm(x, w.t()) for w in decoded],
    })
    out["saved_us"] = out["delta_us"] - out["joined_us"]
    u = L.project(x, a).double()
    out["err_delta"] = out["err_joined"] = 0.0
    for i, (w, b, now, new) in enumerate(zip(decoded, bs, delta(), joined())):
        exact = x.double() @ w.double().t() + u[:, i * r:(i + 1) * r] @ b.double().t()
        out["err_delta"] = max(out["err_delta"], (now.double() - exact).abs().max().item())
        out["err_joined"] = max(out["err_joined"], (new.double() - exact).abs().max().item())
    return out


def input_grad(M, K, N, r=16):
    """One base's input gradient dx = g @ W + du @ A, du = g @ B, both ways."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, generator=gen)
    w8 = NF4Weight.quantize(torch.randn(N, K) * 0.02)
    base = NF4Module(w8, device_copy=DevicePacked.from_weight(w8, "cuda"), decoded=True)
    a = torch.randn(r, K, device="cuda", generator=gen) / K ** 0.5
    b = torch.randn(N, r, device="cuda", generator=gen) * 0.01
    planes = torch.empty(3, M, r, device="cuda", dtype=torch.bfloat16)

    def added():
        du = L.project(g, b.t(), parts=planes)
        return L.expand(du, a.t(), None, torch.bfloat16).addmm_(g, base.operand(torch.bfloat16))

    def joined():
        wide = torch.empty(M, N + 3 * r, device="cuda", dtype=torch.bfloat16)
        L.project(g, b.t(), parts=planes, joined=(wide, 0))
        return L._joined_input_grad(base, None, wide, a, torch.bfloat16, 3 * r)

    out = {f"grad_{k}": v for k, v in timed({"delta_us": added, "joined_us": joined}).items()}
    out["grad_saved_us"] = out["grad_delta_us"] - out["grad_joined_us"]
    exact = g.double() @ base.operand(torch.bfloat16).double() + (g.double() @ b.double()) @ a.double()
    out["grad_err_delta"] = (added().double() - exact).abs().max().item()
    out["grad_err_joined"] = (joined().double() - exact).abs().max().item()
    return out


def main(path):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.use_deterministic_algorithms(True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for model, (D, F) in MODELS.items():
        for name, K, rows in (("o", D, [D]), ("gate_up", D, [F, F]), ("down", F, [D])):
            r = result[f"{model}:{name}"] = group(8192, K, rows)
            if len(rows) == 1:
                r.update(input_grad(8192, K, rows[0]))
            print(model, name, " ".join(f"{k}={v:.1f}" if k.endswith("us") else f"{k}={v:.3g}" for k, v in r.items()),
                  flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""How much of a small adapter delta survives into a BF16 output, at Llama-3.2-1B's gate and up
(8192 tokens, in 2048, out 8192, rank 16, scale 2): a delta far below the output's rounding step,
as every delta is after the first updates (B starts at zero and moves by about the learning rate
an update), is added by rounding once or is lost to a second rounding.

    cublas      cuBLAS's BF16 GEMM onto a BF16 C (addmm, beta = 1), as the adapters' GEMMs add
                expand's delta, against float64
    cublas_fp32 the same GEMM writing FP32 (onto C in FP32), then rounded to BF16: one rounding for a
                GEMM whose delta is not joined, at twice the output's bytes and a pass more
    plain       the fused adapter path over casts without room: expand's delta, the GEMM onto it
    joined      the delta joined to the GEMM along K (`kernels.lora._joined`), one rounding

Each row: the slope of (out - x W^T) on the exact delta (1: the delta kept on average; a second
rounding keeps only what crosses a rounding step), the share of outputs equal to the exact sum
rounded once (to FP32, then BF16), and the error's rms, at |B| = 0.1 and 1e-4 (signs at random).

    python benchmarks/delta_rounding.py OUT.json
"""
import json
import sys

import torch

from aner.kernels import lora as L
from aner.model.llama import Dense
from aner.train.loop import lay_out

M, K, N, R, SCALE = 8192, 2048, 8192, 16, 2.0


def measured(out, base, delta):
    """slope of (out - base) on delta, share equal to (base + delta) rounded once, rms error."""
    e = out.double() - base
    once = (base + delta).float().bfloat16()
    return {"slope": float((e * delta).sum() / (delta * delta).sum()),
            "equal_to_one_rounding": float((out == once).double().mean()),
            "rms_error": float((e - delta).pow(2).mean().sqrt())}


def main(out_path):
    rows = []
    for size in (0.1, 1e-4):
        g = torch.Generator(device="cuda").manual_seed(0)
        ws = [(torch.randn(N, K, device="cuda", generator=g) * 0.02).bfloat16().float() for _ in range(2)]
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        a_s = [(torch.rand(R, K, device="cuda", generator=g) * 2 - 1) / K ** 0.5 for _ in range(2)]
        b_s = [torch.sign(torch.randn(N, R, device="cuda", generator=g)) * size for _ in range(2)]
        bases = [x.double() @ w.double().t() for w in ws]
        deltas = [SCALE * (x.double() @ a.double().t()) @ b.double().t() for a, b in zip(a_s, b_s)]
        c = deltas[0].bfloat16()
        rows.append({"b": size, "path": "cublas", "projection": "gate",
                     **measured(torch.addmm(c, x, ws[0].bfloat16().t()), bases[0], c.double())})
        wide = torch.addmm(c.float(), x, ws[0].bfloat16().t(), out_dtype=torch.float32)   # FP32 out, then rounded
        rows.append({"b": size, "path": "cublas_fp32", "projection": "gate",
                     **measured(wide.bfloat16(), bases[0], c.double())})
        for kind, spare in (("plain", {}), ("joined", {0: (3 * R, 0, 0), 1: (0, 3 * R, 0)})):
            dense = [Dense(w) for w in ws]
            lay_out(dense, {id(dense[i]): room for i, room in spare.items()}, torch.bfloat16)
            assert (L._joined(dense, x, torch.bfloat16, [R, R]) is not None) == bool(spare)
            with torch.no_grad():
                outs = L.adapted_projections(dense, x, a_s, b_s, (SCALE, SCALE))
            for name, out, base, delta in zip(("gate", "up"), outs, bases, deltas):
                rows.append({"b": size, "path": kind, "projection": name, **measured(out, base, delta)})
        for row in rows[-6:]:
            print(f"|B| {row['b']:<7g} {row['path']:<7} {row['projection']:<5} slope {row['slope']:.4f}  "
                  f"equal to one rounding {row['equal_to_one_rounding']:.4f}  rms {row['rms_error']:.3g}")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [M, K, N, R],
              "scale": SCALE, "rows": rows}
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

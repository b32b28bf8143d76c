"""Fused low-rank adapter kernels against the same FP32 products written with torch ops, on a GPU.

    PYTHONPATH=src python3 benchmarks/lora_kernels.py OUT.json

One adapter's forward and backward at the training shapes (8192 tokens, rank 16, BF16
activations; Llama-3.2-1B's 2048 and 8192 widths): each op and tile variant is first checked on
fresh data against a float64 reference (FP32 accuracy: 2e-5 of the summed magnitudes), then timed with triton.testing.do_bench (median ms).
The baseline is the unfused path of `aner.adapters` (`x.float() @ A^T`, `@ B^T`, a cast and an
add; autograd's FP32 GEMMs in backward). `floor_ms` is the op's bytes at 4.8 TB/s.
"""
import datetime
import json
import sys

import torch
import triton.testing

from aner.kernels import lora as L

M, R = 8192, 16
BANDWIDTH = 4.8e12
T = L.Tiles
VARIANTS = {
    "project": [T(64, 64), T(128, 64), T(128, 128, warps=8), T(256, 64, warps=8), T(64, 128),
                T(256, 32, warps=8, split=8, tc=False)],
    "expand": [T(64, 128), T(128, 128, warps=8), T(64, 64), T(128, 64), T(32, 128, tc=False)],
    "reduce_tokens": [T(64, 64), T(128, 64), T(64, 128, warps=8), T(128, 128, warps=8),
                      T(64, 128, warps=8, tc=False)],
}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def check(got, ref, scale):
    return ((got.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()


def main():
    out = sys.argv[1]
    dev = "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = []
    # BF16 activations (attention output, SwiGLU product, output gradients) at both widths; FP32 at
    # the model width (the normed inputs of q, k, v, gate and up).
    for n, pdtype in ((2048, torch.bfloat16), (8192, torch.bfloat16), (2048, torch.float32)):
        p = torch.randn(M, n, device=dev).to(pdtype)
        w = torch.randn(R, n, device=dev) / n ** 0.5
        q = torch.randn(M, R, device=dev)
        pd, wd, qd = p.double(), w.double(), q.double()
        problems = {
            "project": (lambda t: L.project(p, w, t), pd @ wd.t(), pd.abs() @ wd.abs().t(),
                        lambda: p.float() @ w.t(), p.numel() * p.element_size()),
            "expand": (lambda t: L.expand(q, w.t(), p, p.dtype, t), pd + qd @ wd, pd.abs() + qd.abs() @ wd.abs(),
                       lambda: p + (q @ w).to(p.dtype), 2 * p.numel() * p.element_size()),
            "reduce_tokens": (lambda t: L.reduce_tokens(p, q, t), pd.t() @ qd, pd.abs().t() @ qd.abs(),
                              lambda: p.float().t() @ q, p.numel() * p.element_size()),
        }
        for op, (fn, ref, scale, torch_fn, nbytes) in problems.items():
            base = {"op": op, "M": M, "N": n, "R": R, "dtype": str(pdtype).split(".")[-1],
                    "floor_ms": nbytes / BANDWIDTH * 1e3}
            torch_ms = bench(torch_fn)
            rows.append({**base, "variant": "torch ops", "ms": torch_ms})
            default = L.default_tiles(op, R)
            # FP32 accuracy; expand's output is then rounded once to the activations' dtype
            tol = 2e-5 + (2 ** -8 if op == "expand" and pdtype != torch.float32 else 0.0)
            for t in dict.fromkeys([default, *VARIANTS[op]]):
                try:
                    err = check(fn(t), ref, scale)
                    ms = bench(lambda: fn(t))
                    rows.append({**base, "variant": str(t), "default": t == default, "ms": ms,
                                 "vs_torch": ms / torch_ms, "rel_err": err, "ok": err <= tol})
                except Exception as e:  # recorded, not hidden
                    rows.append({**base, "variant": str(t), "error": f"{type(e).__name__}: {e}"[:300]})
                r = rows[-1]
                print(f"{op:14} N={n:<5} {base['dtype']:9} {r['variant']:58} "
                      + (f"{r['ms'] * 1e3:8.1f} us x{r['vs_torch']:.2f} of torch (floor {base['floor_ms'] * 1e3:.0f} us)"
                         f" err={r['rel_err']:.1e}{'' if r['ok'] else ' WRONG'}" if "ms" in r else r["error"][:120]),
                      flush=True)
            print(f"{op:14} N={n:<5} {base['dtype']:9} torch ops {torch_ms * 1e3:8.1f} us", flush=True)
    record = {"schema": "aner.lora_kernels/1", "date": datetime.date.today().isoformat(),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

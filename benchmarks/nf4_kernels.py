"""NF4 products against dense cuBLAS (and bitsandbytes, when importable), on a GPU: the fused
Triton kernels, and the decoded ones (the whole weight decoded by `nf4_decode`, then cuBLAS).

    PYTHONPATH=src python3 benchmarks/nf4_kernels.py OUT.json [--quick | --problems N,K,M ...] [--defaults]

For each problem it first checks every variant on fresh random data against an FP32 reference
(x @ W^T with W decoded densely, TF32 off), then times it with triton.testing.do_bench (median
ms; do_bench flushes L2 before each call, and the calls rotate over ROTATE input/weight sets).
Ratios are to the dense BF16 product of the same shape: `x @ w.t()` forward, `g @ w` input
gradient. Several tile configurations run in the same call so the best can be picked later; the
row marked `default` is what default_config() chooses; `decoded` is nf4_kernel="decoded" (the
decode and the product), and the `decode` row the decode alone, with its bytes moved per second
(packed bytes read, decoded bytes written). --quick: the N=K=4096 points only;
--problems: these (N, K, M) only, every variant; --defaults: only the default rows (to compare
two versions of the kernels in one session).
"""
import dataclasses
import datetime
import itertools
import json
import sys

import torch
import triton
import triton.testing

from aner.kernels import nf4 as K
from aner.quant.nf4 import NF4Weight

ROTATE = 3
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}
C = K.TileConfig


def label(c: K.TileConfig) -> str:
    """A variant's name, e.g. 256x128x64w8s3-split2-prmt-swap (lut 3, the product table, and
    FP32 products on the tensor cores unnamed; -fma: FP32 multiply-adds)."""
    return (f"{c.bm}x{c.bn}x{c.bk}w{c.num_warps}s{c.num_stages}" + (f"-split{c.split}" if c.split > 1 else "")
            + {0: "-gather", 1: "-select", 2: "-prmt", 3: ""}[c.lut] + ("-swap" if c.swap else "")
            + ("" if c.tc else "-fma"))


# Tile variants per (op, regime); "default" is added from default_config().
VARIANTS = {
    # Earlier sweeps (select tree, byte permutes, operand B at 128 and 256 tokens, 128 x 256 tiles)
    # are in results/2026-12-01-h200-nf4-kernels-table.json; these are the contenders now.
    ("matmul", "big"): [
        C(256, 128, 64, num_warps=8, num_stages=3, swap=True),
        C(256, 128, 64, num_warps=8, num_stages=4, swap=True),
        C(256, 128, 64, num_warps=8, num_stages=2, swap=True),
        C(256, 64, 64, num_warps=4, num_stages=3, swap=True),      # one warpgroup: two programs a multiprocessor
        C(256, 64, 64, num_warps=4, num_stages=4, swap=True),
        C(128, 64, 64, num_warps=4, num_stages=4, swap=True),      # three
        C(128, 128, 64, num_warps=4, num_stages=4, swap=True),
    ],
    ("matmul_t", "big"): [
        C(256, 64, 128, num_warps=8, num_stages=3, swap=True),
        C(256, 64, 128, num_warps=8, num_stages=4, swap=True),
        C(256, 128, 64, num_warps=8, num_stages=3, swap=True),
        C(256, 64, 64, num_warps=4, num_stages=3, swap=True),      # one warpgroup: two programs a multiprocessor
        C(128, 64, 64, num_warps=4, num_stages=4, swap=True),
        C(128, 64, 128, num_warps=4, num_stages=4, swap=True),
    ],
    ("matmul", "small"): [
        C(128, 128, 64, split=4, num_warps=8, num_stages=3, lut=2),
        C(128, 128, 64, split=4, num_warps=8, num_stages=3),
        C(128, 128, 64, split=4, num_warps=8, num_stages=3, swap=True),
        C(128, 64, 64, split=2, num_warps=4, num_stages=4),
        C(128, 64, 64, split=4, num_warps=4, num_stages=4, swap=True),
        C(128, 32, 128, split=4, num_warps=4, num_stages=4),
    ],
    ("matmul_t", "small"): [
        C(128, 64, 128, split=4, num_warps=8, num_stages=3, lut=2, swap=True),
        C(128, 64, 128, split=4, num_warps=8, num_stages=3),
        C(128, 64, 128, split=4, num_warps=8, num_stages=3, swap=True),
        C(128, 64, 64, split=2, num_warps=4, num_stages=4),
        C(128, 64, 64, split=4, num_warps=4, num_stages=4, swap=True),
        C(128, 32, 128, split=4, num_warps=4, num_stages=4),
    ],
}
# (N, K, M, full variant sweep)
PROBLEMS = [(4096, 4096, 128, True), (4096, 4096, 2048, True),
            (2048, 2048, 8192, False), (8192, 2048, 8192, False), (2048, 8192, 8192, False),
            (576, 1536, 8192, False), (1536, 576, 8192, False)]
# Variants also timed on the non-sweep shapes (besides the default).
SHORTLIST = ("256x128x64w8s4-swap", "256x64x64w4s3-swap", "256x64x64w4s4-swap", "128x64x64w4s4-swap",
             "256x64x128w8s4-swap", "256x128x64w8s3-swap")


def bench(fn_of_set, sets):
    """Median ms of fn_of_set(s), s cycling over the input sets."""
    cyc = itertools.cycle(sets)
    return triton.testing.do_bench(lambda: fn_of_set(next(cyc)), warmup=10, rep=60, return_mode="median")


def rel_err(got, ref, scale):
    return ((got.float() - ref).abs() / scale.clamp_min(1e-30)).max().item()


def make_sets(N, Kin, M, dtype, dev):
    sets = []
    for _ in range(ROTATE):
        w = NF4Weight.quantize(torch.randn(N, Kin) * 0.02, double_quant=True)
        w32 = w.dequantize().to(dev)                                    # (N, K) dense FP32, for reference
        sets.append(dict(packed=K.DevicePacked.from_weight(w, dev), w32=w32, w=w32.to(dtype),
                         x=torch.randn(M, Kin, device=dev).to(dtype), g=torch.randn(M, N, device=dev).to(dtype)))
    return sets


def bnb_forward(sets):
    """bitsandbytes matmul_4bit (nf4, compress_statistics=True) with a bf16 x, or None."""
    try:
        import bitsandbytes as bnb
    except Exception:       # not installed, or no CUDA build: the column stays empty
        return None
    for s in sets:
        p = bnb.nn.Params4bit(s["w"].to(torch.bfloat16).contiguous(), requires_grad=False,
                              quant_type="nf4", compress_statistics=True).to(s["w"].device)
        s["bnb"] = p
    return lambda s: bnb.matmul_4bit(s["x"], s["bnb"].t(), quant_state=s["bnb"].quant_state)


def run_problem(N, Kin, M, sweep, dtype, rows, dev, defaults_only=False):
    sets = make_sets(N, Kin, M, dtype, dev)
    s0 = sets[0]
    ref_y = s0["x"].float() @ s0["w32"].t()
    scale_y = s0["x"].float().abs() @ s0["w32"].abs().t()
    ref_dx = s0["g"].float() @ s0["w32"]
    scale_dx = s0["g"].float().abs() @ s0["w32"].abs()
    flops = 2.0 * M * N * Kin
    dense = {"matmul": bench(lambda s: s["x"] @ s["w"].t(), sets),
             "matmul_t": bench(lambda s: s["g"] @ s["w"], sets)}
    base = dict(N=N, K=Kin, M=M, dtype=str(dtype).replace("torch.", ""))
    for op in ("matmul", "matmul_t"):
        rows.append(dict(base, op=op, impl="dense", variant="cublas", ms=dense[op], ratio=1.0,
                         tflops=flops / dense[op] / 1e9))
        regime = "big" if M >= 1024 else "small"
        default = K.default_config(op, M, N, Kin, dtype)
        if dtype != torch.float32:
            others = [c for c in VARIANTS[(op, regime)] if sweep or label(c) in SHORTLIST]
        else:
            others = [dataclasses.replace(default, tc=False)]           # FP32 multiply-adds
        variants = {"default": default, **({} if defaults_only else {label(c): c for c in others})}
        launch = K.nf4_matmul if op == "matmul" else K.nf4_matmul_t
        arg = "x" if op == "matmul" else "g"
        ref, scale = (ref_y, scale_y) if op == "matmul" else (ref_dx, scale_dx)
        for name, cfg in variants.items():
            row = dict(base, op=op, impl="aner-nf4", variant=name, config=cfg.__dict__,
                       is_default=cfg == default)
            try:
                err = rel_err(launch(s0[arg], s0["packed"], config=cfg), ref, scale)
                row["rel_err"] = err
                row["ok"] = err <= TOL[dtype]
                ms = bench(lambda s: launch(s[arg], s["packed"], config=cfg), sets)
                row.update(ms=ms, ratio=ms / dense[op], tflops=flops / ms / 1e9)
            except Exception as e:          # a variant that fails to compile is reported, not fatal
                row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
            rows.append(row)
            print(fmt(row), flush=True)
        decoded = (lambda s: torch.nn.functional.linear(s["x"], K.nf4_decode(s["packed"], dtype))) if op == "matmul" \
            else (lambda s: s["g"] @ K.nf4_decode(s["packed"], dtype))
        err = rel_err(decoded(s0), ref, scale)
        ms = bench(decoded, sets)
        rows.append(dict(base, op=op, impl="aner-nf4", variant="decoded", ms=ms, ratio=ms / dense[op],
                         tflops=flops / ms / 1e9, rel_err=err, ok=err <= TOL[dtype], is_default=False))
        print(fmt(rows[-1]), flush=True)
    ms = bench(lambda s: K.nf4_decode(s["packed"], dtype), sets)
    moved = s0["packed"].nbytes() + N * Kin * dtype.itemsize
    rows.append(dict(base, op="decode", impl="aner-decode", variant="nf4_decode", ms=ms, ratio=ms / dense["matmul"],
                     gb_per_s=moved / ms / 1e6))
    print(fmt(rows[-1]), flush=True)
    if dtype == torch.bfloat16:
        fn = bnb_forward(sets)
        if fn is not None:
            err = rel_err(fn(s0), ref_y, scale_y)
            ms = bench(fn, sets)
            rows.append(dict(base, op="matmul", impl="bitsandbytes", variant="matmul_4bit", ms=ms,
                             ratio=ms / dense["matmul"], tflops=flops / ms / 1e9, rel_err=err))
            print(fmt(rows[-1]), flush=True)
    del sets
    torch.cuda.empty_cache()


def fmt(r):
    head = f"{r['N']:>5}x{r['K']:<5} M={r['M']:<5} {r['dtype']:<8} {r['op']:<8} {r['impl']:<12} {r['variant']:<26}"
    if "ms" not in r:
        return head + f" FAILED {r.get('error', '')[:120]}"
    flag = "*" if r.get("is_default") else " "
    extra = f" err={r['rel_err']:.1e}{'' if r.get('ok', True) else ' WRONG'}" if "rel_err" in r else ""
    rate = f"{r['gb_per_s']:6.0f} GB/s" if "gb_per_s" in r else f"{r['tflops']:6.0f} TF/s"
    return head + f" {r['ms'] * 1e3:9.1f} us  x{r['ratio']:.2f} {rate}{flag}{extra}"


def main():
    if len(sys.argv) < 2:
        sys.exit("usage: nf4_kernels.py OUT.json [--quick | --problems N,K,M ...] [--defaults]")
    quick = "--quick" in sys.argv[2:]
    defaults_only = "--defaults" in sys.argv[2:]
    chosen = [tuple(map(int, a.split(","))) for a in sys.argv[2:] if a[0].isdigit()]
    problems = [(*p, True) for p in chosen] if chosen else PROBLEMS
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    rows = []
    started = datetime.datetime.now(datetime.timezone.utc).isoformat()
    for N, Kin, M, sweep in problems:
        if quick and (N, Kin) != (4096, 4096):
            continue
        run_problem(N, Kin, M, sweep, torch.bfloat16, rows, dev, defaults_only)
    run_problem(4096, 4096, 2048, False, torch.float32, rows, dev, defaults_only)       # FP32: tensor cores and FMAs
    print("\nbest per problem (ratio to dense; * = default):")
    keyf = lambda r: (r["N"], r["K"], r["M"], r["dtype"], r["op"])      # noqa: E731
    ours = [r for r in rows if r["impl"] == "aner-nf4" and r.get("ok")]
    for key, grp in itertools.groupby(sorted(ours, key=keyf), key=keyf):
        grp = list(grp)
        best = min(grp, key=lambda r: r["ms"])
        dflt = next(r for r in grp if r["variant"] == "default")
        print(f"  {key}: best {best['variant']} x{best['ratio']:.2f}; default x{dflt['ratio']:.2f}")
    out = dict(started=started, finished=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               rotate=ROTATE, rows=rows)
    with open(sys.argv[1], "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

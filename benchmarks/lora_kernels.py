"""Fused low-rank adapter kernels against the same FP32 products written with torch ops, on a GPU.

    PYTHONPATH=src python3 benchmarks/lora_kernels.py OUT.json [--sweep [OP ...]]

One adapter's forward and backward at the training shapes (8192 tokens, rank 16, BF16
activations; Llama-3.2-1B's 2048 and 8192 widths): each op and tile variant is first checked on
fresh data against a float64 reference (FP32 accuracy: 2e-5 of the summed magnitudes), then timed with triton.testing.do_bench (median ms).
The baseline is the unfused path of `aner.adapters` (`x.float() @ A^T`, `@ B^T`, a cast and an
add; autograd's FP32 GEMMs in backward). `floor_ms` is the op's bytes at 4.8 TB/s.

--sweep: every op at every shape one update of Llama-3.2-1B or Llama-3.1-8B LoRA on all seven
projections gives it (q, k, v and gate, up together), over a grid of tiles, warps, pipeline
stages and, for project and reduce_tokens, the number of parts of the reduced dimension
(OP ...: only those ops); compiled first in parallel processes, then checked and timed
one at a time, each as a replayed CUDA graph over operand copies that do not fit in L2. Each is
timed as training runs it: project writing its output as BF16 parts and reduce_tokens its output
times the adapter's scale (in one part by themselves, in more by the ordered sum of the parts),
expand around a GEMM base, writing the delta alone, which the base's GEMM then adds its product
to. Prints, per model and op, the per-update time of the default tiles, of the best single variant
and of the best per shape.
"""
import datetime
import itertools
import json
import sys
from concurrent.futures import ProcessPoolExecutor

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


def bench(fn, rep=50):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def check(got, ref, scale):
    return ((got.double() - ref).abs() / scale.clamp_min(1e-30)).max().item()


WIDTHS = {"llama-3.2-1b": (2048, 512, 8192), "llama-3.1-8b": (4096, 1024, 14336)}   # D, K * E, F


def update_calls(D, KV, F):
    """{(op, N, R): calls per layer} of one update's adapter kernels (rank 16; u of q, k, v is
    (M, 48), of gate, up (M, 32))."""
    ins = [(D, 48), (D, 16), (D, 32), (F, 16)]                   # q,k,v | o | gate,up | down
    outs = [(D, 16)] * 3 + [(KV, 16)] * 2 + [(F, 16)] * 2        # q, o, down | k, v | gate, up
    calls = {}
    for key in ([("project", *c) for c in ins + outs] + [("reduce_tokens", *c) for c in ins + outs]
                + [("expand", *c) for c in outs + ins]):
        calls[key] = calls.get(key, 0) + 1
    return calls


def grid(op):
    if op == "expand":
        return ([T(bm, bn, warps=w, stages=st) for bm, bn, w, st in
                 itertools.product((32, 64, 128), (64, 128, 256), (4, 8), (1, 2))]
                + [T(64, 128, split=s) for s in (4, 8, 16, 64, 128)])
    tiles = [T(bm, bn, warps=w, stages=st) for bm, bn, w, st in
             itertools.product((64, 128, 256), (32, 64, 128), (4, 8), (2, 3, 4)) if bm * bn * st <= 65536]
    # The reduced dimension in a given number of parts, not as many as TARGET_PROGRAMS programs
    # ask for: fewer parts are fewer partial sums to write and add, fewer programs a launch (at
    # 1, project's 32-row tiles are 256 programs at 8192 tokens).
    parts = [T(bm, bn, warps=w, stages=3, split=s) for (bm, bn, w), s in
             itertools.product(((32, 128, 4), (64, 128, 4), (64, 128, 8), (128, 64, 8)), (1, 2, 4, 8, 16, 32))]
    return tiles + parts


def operands(op, N, R):
    """(run(tiles, i) on operand copy i, the float64 reference of copy 0 and its summed
    magnitudes, bytes moved): enough
    copies of the (M, N) operand to hold ~128 MiB, so that a timed run reads it from memory as a
    training step does, not from L2."""
    g = torch.Generator(device="cuda").manual_seed(N * 1000 + R)
    copies = -(-2 ** 27 // (M * N * 2))
    ps = [torch.randn(M, N, device="cuda", generator=g).bfloat16() for _ in range(copies)]
    w = torch.randn(R, N, device="cuda", generator=g) / N ** 0.5
    q = torch.randn(M, R, device="cuda", generator=g)
    p = ps[0]
    if op == "project":                             # u or du, written as training writes it: its BF16 parts
        planes = torch.empty(3, M, R, device="cuda", dtype=torch.bfloat16)
        return ((lambda t, i=0: L.project(ps[i], w, t, parts=planes)),
                lambda: (p.double() @ w.double().t(), p.double().abs() @ w.double().abs().t()), p.numel() * 2)
    qp = L.to_parts(q)                              # u or du: the BF16 parts project writes
    if op == "expand":                              # the delta alone, written in BF16
        return ((lambda t, i=0: L.expand(qp, w.t(), None, torch.bfloat16, t)),
                lambda: (q.double() @ w.double(), q.double().abs() @ w.double().abs()), p.numel() * 2)
    # dB: times the adapter's scale (alpha 32 / rank 16)
    return ((lambda t, i=0: L.reduce_tokens(ps[i], qp, t, scale=2.0)),
            lambda: (2 * p.double().t() @ q.double(), 2 * p.double().abs().t() @ q.double().abs()), p.numel() * 2)


def bench_graphed(fn, copies):
    """Median ms of fn(i) for i cycling over the copies, replayed as one CUDA graph (no launch
    overhead, as in training under cuda_graphs)."""
    turn = itertools.cycle(range(copies))
    return triton.testing.do_bench_cudagraph(lambda: fn(next(turn)), rep=20, return_mode="median")


def _compile(job):
    op, N, R, variants = job
    fn, _, _ = operands(op, N, R)
    for t in variants:
        try:
            fn(t)
        except Exception:   # the timing pass records it
            pass
    torch.cuda.synchronize()
    return job[:3]


def sweep(out, ops):
    # Llama-3.2-1B's shapes first, and the rows written after each shape: a call cut short keeps them
    shapes = list(dict.fromkeys(k for widths in WIDTHS.values() for k in sorted(update_calls(*widths)) if k[0] in ops))
    rows = []

    def save():
        with open(out, "w") as f:
            json.dump({"schema": "aner.lora_tiles/1", "date": datetime.date.today().isoformat(),
                       "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)

    jobs = [(op, N, R, grid(op)[i::3]) for op, N, R in shapes for i in range(3)]
    with ProcessPoolExecutor(15, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile, jobs))
    for op, N, R in shapes:
        fn, ref, nbytes = operands(op, N, R)
        ref, scale = ref()
        copies = -(-2 ** 27 // (M * N * 2))
        # FP32 sums (and expand's rounding to BF16)
        tol = (2e-5 * scale + (2 ** -8 * ref.abs() if op == "expand" else 0)).double()
        default = L.default_tiles(op, R)
        for t in dict.fromkeys([default, *grid(op)]):
            row = {"op": op, "N": N, "R": R, "variant": str(t), "default": t == default,
                   "floor_ms": nbytes / BANDWIDTH * 1e3}
            try:
                got = fn(t).double()
                err = ((got.sum(0) if op == "project" else got) - ref).abs()      # project's parts: exact sum
                row.update(ms=bench_graphed(lambda i: fn(t, i), copies), abs_err=err.max().item(),
                           ok=bool((err <= tol).all()))
            except Exception as e:  # recorded, not hidden
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            rows.append(row)
        mine = [r for r in rows if (r["op"], r["N"], r["R"]) == (op, N, R)]
        none = {"ms": float("nan"), "variant": "none", "floor_ms": float("nan")}
        best = min((r for r in mine if r.get("ok")), key=lambda r: r["ms"], default=none)
        dflt = next(r for r in mine if r["default"])
        print(f"{op:14} N={N:<6} R={R:<3} default {dflt.get('ms', float('nan')) * 1e3:7.1f} us  "
              f"best {best['ms'] * 1e3:7.1f} us {best['variant']}  (floor {best['floor_ms'] * 1e3:.0f})", flush=True)
        save()
    for model, widths in WIDTHS.items():
        calls = update_calls(*widths)
        layers = {"llama-3.2-1b": 16, "llama-3.1-8b": 32}[model]
        for op in ops:
            mine = {k: n * layers for k, n in calls.items() if k[0] == op}
            ok = [r for r in rows if (r["op"], r["N"], r["R"]) in mine and r.get("ok")]
            total = lambda rs: sum(r["ms"] * mine[r["op"], r["N"], r["R"]] for r in rs)  # noqa: E731
            per_variant = {}
            for r in ok:
                per_variant.setdefault(r["variant"], []).append(r)
            whole = {v: total(rs) for v, rs in per_variant.items() if len(rs) == len(mine)}
            v_best = min(whole, key=whole.get)
            shape_best = total(min((r for r in ok if (r["N"], r["R"]) == k[1:]), key=lambda r: r["ms"]) for k in mine)
            print(f"{model:13} {op:14} per update: default {total(r for r in ok if r['default']):6.2f} ms, "
                  f"best one {whole[v_best]:6.2f} ms ({v_best}), best per shape {shape_best:6.2f} ms", flush=True)


def main():
    if "--sweep" in sys.argv:
        return sweep(sys.argv[1], sys.argv[sys.argv.index("--sweep") + 1:] or ["project", "expand", "reduce_tokens"])
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
        qp = L.to_parts(q)
        pd, wd, qd = p.double(), w.double(), q.double()
        problems = {
            "project": (lambda t: L.project(p, w, t), pd @ wd.t(), pd.abs() @ wd.abs().t(),
                        lambda: p.float() @ w.t(), p.numel() * p.element_size()),
            "expand": (lambda t: L.expand(qp, w.t(), p, p.dtype, t), pd + qd @ wd, pd.abs() + qd.abs() @ wd.abs(),
                       lambda: p + (q @ w).to(p.dtype), 2 * p.numel() * p.element_size()),
            "reduce_tokens": (lambda t: L.reduce_tokens(p, qp, t), pd.t() @ qd, pd.abs().t() @ qd.abs(),
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

"""Probe: the attention forward with its operands loaded through tensor descriptors (TMA on Hopper),
with and without the compiler's warp specialization of the key loop, against ours
(`kernels/attention.py`), at the Llama-3.2-1B and Llama-3.1-8B heads, 8 x 1024 positions, BF16.

    python benchmarks/attention_tma.py OUT.json

Each variant's output and log-sum-exp against ours (max abs difference; 0 is the same bits), and
its time per call inside a replayed CUDA graph (`triton.testing.do_bench_cudagraph`).
"""
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "src")]
from aner.kernels import attention as ours  # noqa: E402

SHAPES = {"llama-3.2-1b": (8, 32, 8, 1024, 64), "llama-3.1-8b": (8, 32, 8, 1024, 128)}


@triton.jit
def _step(qt, kd, vd, b, kvc, start, rows, cols, m, s_sum, acc, scale2, BN: tl.constexpr, E: tl.constexpr,
          MASK: tl.constexpr):
    kt = kd.load([b, start, kvc]).reshape(BN, E)
    s = tl.dot(qt, tl.trans(kt)) * scale2
    if MASK:
        s = tl.where(rows[:, None] >= (start + cols)[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    vt = vd.load([b, start, kvc]).reshape(BN, E)
    return m_new, s_sum * alpha + tl.sum(p, 1), tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])


@triton.jit
def _fwd_tma(q, k, v, o, lse, sq_b, sq_t, sk_b, sk_t, sv_b, sv_t, so_b, so_t, B, H, GROUP, T, scale2,
             BM: tl.constexpr, BN: tl.constexpr, E: tl.constexpr, WS: tl.constexpr):
    """ours' forward, q, k, v and o through descriptors over (B, T, heads x E) memory."""
    bh = tl.program_id(0)
    first = (tl.num_programs(1) - 1 - tl.program_id(1)) * BM
    b, h = bh // H, bh % H
    KV = H // GROUP
    kvc = (h // GROUP) * E
    qd = tl.make_tensor_descriptor(q, shape=[B, T, H * E], strides=[sq_b, sq_t, 1], block_shape=[1, BM, E])
    kd = tl.make_tensor_descriptor(k, shape=[B, T, KV * E], strides=[sk_b, sk_t, 1], block_shape=[1, BN, E])
    vd = tl.make_tensor_descriptor(v, shape=[B, T, KV * E], strides=[sv_b, sv_t, 1], block_shape=[1, BN, E])
    od = tl.make_tensor_descriptor(o, shape=[B, T, H * E], strides=[so_b, so_t, 1], block_shape=[1, BM, E])
    rows = first + tl.arange(0, BM)
    cols = tl.arange(0, BN)
    qt = qd.load([b, first, h * E]).reshape(BM, E)
    m = tl.full((BM,), float("-inf"), tl.float32)
    s_sum = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, E), tl.float32)
    for start in tl.range(0, first, BN, warp_specialize=WS):
        m, s_sum, acc = _step(qt, kd, vd, b, kvc, start, rows, cols, m, s_sum, acc, scale2, BN, E, False)
    for start in range(first, first + BM, BN):
        m, s_sum, acc = _step(qt, kd, vd, b, kvc, start, rows, cols, m, s_sum, acc, scale2, BN, E, True)
    od.store([b, first, h * E], (acc / s_sum[:, None]).to(o.dtype.element_ty).reshape(1, BM, E))
    tl.store(lse + bh.to(tl.int64) * T + rows, m + tl.log2(s_sum), mask=rows < T)


def tma_forward(q, k, v, bm, bn, warps, stages, ws):
    B, H, T, E = q.shape
    o = torch.empty(B, T, H, E, device=q.device, dtype=q.dtype).transpose(1, 2)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    _fwd_tma[(B * H, triton.cdiv(T, bm))](q, k, v, o, lse, q.stride(0), q.stride(2), k.stride(0), k.stride(2),
                                          v.stride(0), v.stride(2), o.stride(0), o.stride(2), B, H,
                                          H // k.shape[1], T, 1.0 / math.sqrt(E) * ours.LOG2E, BM=bm, BN=bn, E=E, WS=ws,
                                          num_warps=warps, num_stages=stages)
    return o, lse


def ours_forward(q, k, v):
    return ours.forward(q, k, v, ours.TILES[64 if q.shape[-1] <= 64 else 128])


def main(out: str):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    dev, rows = "cuda", []
    for model, (B, H, K, T, E) in SHAPES.items():
        g = torch.Generator(device=dev).manual_seed(0)
        # the model's layout: (B, T, heads, E) memory seen as (B, heads, T, E)
        q, k, v = (torch.randn(B, T, n, E, device=dev, generator=g, dtype=torch.bfloat16).transpose(1, 2)
                   for n in (H, K, K))
        ref = ours_forward(q, k, v)
        flops = 4 * B * H * T * T * E / 2
        variants = [("ours", lambda: ours_forward(q, k, v))] + [
            (f"tma ({bm}, {bn}, {w}, {s}){' ws' if ws else ''}",
             (lambda bm=bm, bn=bn, w=w, s=s, ws=ws: tma_forward(q, k, v, bm, bn, w, s, ws)))
            for bm, bn, w, s, ws in [(64, 64, 4, 3, False), (128, 64, 8, 3, False), (128, 128, 8, 2, False),
                                     (64, 64, 4, 2, False), (64, 64, 4, 3, True), (128, 64, 8, 3, True),
                                     (128, 128, 8, 2, True)]]
        for name, fn in variants:
            row = {"model": model, "shape": [B, H, K, T, E], "variant": name}
            try:
                o, lse = fn()
                row["diff_out"] = (o.float() - ref[0].float()).abs().max().item()
                row["diff_lse"] = (lse - ref[1]).abs().max().item()
                ms = triton.testing.do_bench_cudagraph(fn, rep=200)
                row.update(us=ms * 1e3, tflops=flops / ms / 1e9)
            except Exception as e:  # recorded: a variant the compiler refuses is an answer too
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(out).write_text(json.dumps({"schema": "aner.attention_tma/1", "date": time.strftime("%Y-%m-%d"),
                                             "device": torch.cuda.get_device_name(0), "triton": triton.__version__,
                                             "rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])

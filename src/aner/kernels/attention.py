"""Causal attention (Triton) for training under FP16/BF16: softmax(q k^T / sqrt(E)) v with grouped
key/value heads, forward and backward, deterministic.

    attention  q (B, H, T, E), k, v (B, K, T, E) -> (B, H, T, E)   query head h reads key/value
               head h // (H / K), as llama.cpp and `enable_gqa` do; position i sees keys 0..i

The forward is the online softmax over key blocks (the flash-attention scheme): a program holds a
block of query rows, their running maximum and sum, and an FP32 accumulator, and saves each row's
log-sum-exp (base 2) for backward; no (T, T) matrix is ever written. The backward recomputes the
probabilities from it in two kernels that each own what they write: one program per block of keys
of one key/value head sums dK and dV over every query row that sees them (all H / K query heads of
the group, in a fixed order), one program per block of queries sums its dQ over the keys it sees.
No atomics, no autotuning: the same inputs give the same bits on every run. Under the library's
deterministic policy PyTorch refuses its cuDNN attention and runs its flash attention's
deterministic mode; at 8 x 1024 positions on the H200 this takes 0.77x-0.89x of that one's time on
the Llama-3.2-1B and Llama-3.1-8B heads, forward and backward (`benchmarks/attention.py`).

Numerics: scores and sums in FP32 (exp2 of scores scaled by log2(e) / sqrt(E)); the probabilities
and dS are rounded to the operands' dtype for their products, as flash attention rounds them;
every product accumulates in FP32 and each output is rounded once. The reference is
`torch.nn.functional.scaled_dot_product_attention` (tests compare both against float64).
"""
import math

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from ..model import llama
from .launch import after_prior, launch_options

LOG2E = 1.4426950408889634


@triton.jit
def _row_block(H, BM: tl.constexpr):
    """(bh, b, h, first, rows) of a program over a block of query rows: grid (B * H, row blocks),
    the last row blocks (the most keys) first."""
    bh = tl.program_id(0)
    first = (tl.num_programs(1) - 1 - tl.program_id(1)) * BM
    return bh, bh // H, bh % H, first, first + tl.arange(0, BM)


@triton.jit
def _fwd_step(qt, kp, vp, sk_t, sv_t, start, rows, cols, e, m, s_sum, acc, scale2, T, MASK: tl.constexpr):
    """One key block of the online softmax; MASK: the causal mask (the diagonal blocks)."""
    keys = start + cols
    kt = tl.load(kp + keys[None, :] * sk_t + e[:, None], mask=(keys < T)[None, :], other=0.0)      # (E, BN)
    s = tl.dot(qt, kt) * scale2
    if MASK:
        s = tl.where(rows[:, None] >= keys[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    vt = tl.load(vp + keys[:, None] * sv_t + e[None, :], mask=(keys < T)[:, None], other=0.0)       # (BN, E)
    return m_new, s_sum * alpha + tl.sum(p, 1), tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])


@triton.jit
def _fwd_kernel(q, k, v, o, lse, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
                H, GROUP, T, scale2, BM: tl.constexpr, BN: tl.constexpr, E: tl.constexpr):
    """Rows [pid * BM, +BM) of head (b, h): o = softmax(q k^T) v, lse = log2 of each row's sum of
    exp2 (scores in log2 units). BM is a multiple of BN."""
    after_prior()
    bh, b, h, first, rows = _row_block(H, BM)
    cols = tl.arange(0, BN)
    e = tl.arange(0, E)
    live = rows < T
    qt = tl.load(q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + rows[:, None] * sq_t + e[None, :],
                 mask=live[:, None], other=0.0)
    kp = k + b.to(tl.int64) * sk_b + (h // GROUP).to(tl.int64) * sk_h
    vp = v + b.to(tl.int64) * sv_b + (h // GROUP).to(tl.int64) * sv_h
    m = tl.full((BM,), float("-inf"), tl.float32)
    s_sum = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, E), tl.float32)
    for start in range(0, first, BN):                   # keys before the block's first row
        m, s_sum, acc = _fwd_step(qt, kp, vp, sk_t, sv_t, start, rows, cols, e, m, s_sum, acc, scale2, T, False)
    for start in range(first, first + BM, BN):          # the diagonal
        m, s_sum, acc = _fwd_step(qt, kp, vp, sk_t, sv_t, start, rows, cols, e, m, s_sum, acc, scale2, T, True)
    tl.store(o + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h + rows[:, None] * so_t + e[None, :],
             (acc / s_sum[:, None]).to(o.dtype.element_ty), mask=live[:, None])
    tl.store(lse + bh.to(tl.int64) * T + rows, m + tl.log2(s_sum), mask=live)


@triton.jit
def _delta_kernel(o, do, delta, so_b, so_h, so_t, sd_b, sd_h, sd_t, H, T, BM: tl.constexpr, E: tl.constexpr):
    """delta = rowsum(dO * O) in FP32 for rows [pid * BM, +BM) of head (b, h)."""
    after_prior()
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows = pid * BM + tl.arange(0, BM)
    e = tl.arange(0, E)
    live = (rows < T)[:, None]
    ot = tl.load(o + b.to(tl.int64) * so_b + h.to(tl.int64) * so_h + rows[:, None] * so_t + e[None, :], mask=live,
                 other=0.0)
    dot_ = tl.load(do + b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h + rows[:, None] * sd_t + e[None, :], mask=live,
                   other=0.0)
    tl.store(delta + bh.to(tl.int64) * T + rows, tl.sum(ot.to(tl.float32) * dot_.to(tl.float32), 1), mask=rows < T)


@triton.jit
def _dkdv_step(kt, vt, qp, dop, lse, delta, sq_t, sd_t, start, rows0, keys, e, dk_acc, dv_acc, scale2, T,
               MASK: tl.constexpr):
    """One query block's share of dK and dV. Rows past T load as zeros and add nothing."""
    rows = start + rows0
    live = rows < T
    qt = tl.load(qp + rows[:, None] * sq_t + e[None, :], mask=live[:, None], other=0.0)         # (BM, E)
    dot_ = tl.load(dop + rows[:, None] * sd_t + e[None, :], mask=live[:, None], other=0.0)
    l_ = tl.load(lse + rows, mask=live, other=0.0)
    d_ = tl.load(delta + rows, mask=live, other=0.0)
    pt = tl.exp2(tl.dot(kt, tl.trans(qt)) * scale2 - l_[None, :])                        # (BN, BM)
    if MASK:
        pt = tl.where(rows[None, :] >= keys[:, None], pt, 0.0)
    dv_acc = tl.dot(pt.to(dot_.dtype), dot_, dv_acc)
    dst = pt * (tl.dot(vt, tl.trans(dot_)) - d_[None, :])
    return tl.dot(dst.to(qt.dtype), qt, dk_acc), dv_acc


@triton.jit
def _dkdv_kernel(q, k, v, do, lse, delta, dk, dv, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                 sd_b, sd_h, sd_t, H, GROUP, T, scale, scale2, BM: tl.constexpr, BN: tl.constexpr, E: tl.constexpr):
    """Keys [pid * BN, +BN) of key/value head (b, kv): dK and dV summed over the group's query
    heads in order, each over its query blocks in order. dK, dV have k's and v's strides; BN is a
    multiple of BM. The first key blocks (the most queries) run first."""
    after_prior()
    bk, pid = tl.program_id(0), tl.program_id(1)
    KV = H // GROUP
    b, kv = bk // KV, bk % KV
    keys = pid * BN + tl.arange(0, BN)
    rows0 = tl.arange(0, BM)
    e = tl.arange(0, E)
    kmask = (keys < T)[:, None]
    koff = b.to(tl.int64) * sk_b + kv.to(tl.int64) * sk_h + keys[:, None] * sk_t + e[None, :]
    voff = b.to(tl.int64) * sv_b + kv.to(tl.int64) * sv_h + keys[:, None] * sv_t + e[None, :]
    kt = tl.load(k + koff, mask=kmask, other=0.0)                                     # (BN, E)
    vt = tl.load(v + voff, mask=kmask, other=0.0)
    dk_acc = tl.zeros((BN, E), tl.float32)
    dv_acc = tl.zeros((BN, E), tl.float32)
    first = pid * BN
    for g in range(0, GROUP):
        h = kv * GROUP + g
        qp = q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h
        dop = do + b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h
        lp = lse + (b * H + h).to(tl.int64) * T
        dp = delta + (b * H + h).to(tl.int64) * T
        for start in range(first, first + BN, BM):      # the diagonal
            dk_acc, dv_acc = _dkdv_step(kt, vt, qp, dop, lp, dp, sq_t, sd_t, start, rows0, keys, e, dk_acc,
                                        dv_acc, scale2, T, True)
        for start in range(first + BN, T, BM):          # rows after the block's last key
            dk_acc, dv_acc = _dkdv_step(kt, vt, qp, dop, lp, dp, sq_t, sd_t, start, rows0, keys, e, dk_acc,
                                        dv_acc, scale2, T, False)
    tl.store(dk + koff, (dk_acc * scale).to(dk.dtype.element_ty), mask=kmask)
    tl.store(dv + voff, dv_acc.to(dv.dtype.element_ty), mask=kmask)


@triton.jit
def _dq_step(qt, dot_, l_, d_, kp, vp, sk_t, sv_t, start, rows, cols, e, acc, scale2, T, MASK: tl.constexpr):
    """One key block's share of dQ."""
    keys = start + cols
    kt = tl.load(kp + keys[:, None] * sk_t + e[None, :], mask=(keys < T)[:, None], other=0.0)      # (BN, E)
    vt = tl.load(vp + keys[:, None] * sv_t + e[None, :], mask=(keys < T)[:, None], other=0.0)
    p = tl.exp2(tl.dot(qt, tl.trans(kt)) * scale2 - l_[:, None])                          # (BM, BN)
    if MASK:
        p = tl.where(rows[:, None] >= keys[None, :], p, 0.0)
    ds = p * (tl.dot(dot_, tl.trans(vt)) - d_[:, None])
    return tl.dot(ds.to(kt.dtype), kt, acc)


@triton.jit
def _dq_kernel(q, k, v, do, lse, delta, dq, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
               sd_b, sd_h, sd_t, H, GROUP, T, scale, scale2, BM: tl.constexpr, BN: tl.constexpr, E: tl.constexpr):
    """Rows [pid * BM, +BM) of head (b, h): dQ summed over the keys they see, in order. dQ has q's
    strides; BM is a multiple of BN."""
    after_prior()
    bh, b, h, first, rows = _row_block(H, BM)
    cols = tl.arange(0, BN)
    e = tl.arange(0, E)
    live = rows < T
    qoff = b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + rows[:, None] * sq_t + e[None, :]
    qt = tl.load(q + qoff, mask=live[:, None], other=0.0)
    dot_ = tl.load(do + b.to(tl.int64) * sd_b + h.to(tl.int64) * sd_h + rows[:, None] * sd_t + e[None, :],
                   mask=live[:, None], other=0.0)
    l_ = tl.load(lse + bh.to(tl.int64) * T + rows, mask=live, other=0.0)
    d_ = tl.load(delta + bh.to(tl.int64) * T + rows, mask=live, other=0.0)
    kp = k + b.to(tl.int64) * sk_b + (h // GROUP).to(tl.int64) * sk_h
    vp = v + b.to(tl.int64) * sv_b + (h // GROUP).to(tl.int64) * sv_h
    acc = tl.zeros((BM, E), tl.float32)
    for start in range(0, first, BN):
        acc = _dq_step(qt, dot_, l_, d_, kp, vp, sk_t, sv_t, start, rows, cols, e, acc, scale2, T, False)
    for start in range(first, first + BM, BN):
        acc = _dq_step(qt, dot_, l_, d_, kp, vp, sk_t, sv_t, start, rows, cols, e, acc, scale2, T, True)
    tl.store(dq + qoff, (acc * scale).to(dq.dtype.element_ty), mask=live[:, None])


def _strides(t):
    return t.stride(0), t.stride(1), t.stride(2)


WIDTHS = (16, 32, 64, 128)    # the head widths E taken: powers of two the tiles' products cover
# (BM, BN, warps, stages) of each kernel for E up to 64 and for 128, measured on the H200 (`benchmarks/attention.py`)
TILES = {64: {"fwd": (64, 64, 4, 3), "dkdv": (64, 128, 8, 2), "dq": (128, 32, 4, 3)},
         128: {"fwd": (64, 64, 4, 3), "dkdv": (32, 64, 4, 2), "dq": (128, 64, 8, 2)}}


def _launch(kernel, grid, args, tiles):
    bm, bn, warps, stages = tiles
    kernel[grid](*args, BM=bm, BN=bn, E=args[0].shape[-1], num_warps=warps, num_stages=stages,
                 **launch_options(args[0].device))


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles):
        B, H, T, E = q.shape
        ctx.tiles, ctx.scale = tiles, 1.0 / math.sqrt(E)
        # o in (B, T, H, E) memory: the model's reshape of it to (B, T, H * E) is a view; lse: each
        # row's log-sum-exp (base 2)
        o = torch.empty(B, T, H, E, device=q.device, dtype=q.dtype).transpose(1, 2)
        lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
        if q.numel():
            _launch(_fwd_kernel, (B * H, triton.cdiv(T, tiles["fwd"][0])),
                    (q, k, v, o, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(o), H, H // k.shape[1], T,
                     ctx.scale * LOG2E), tiles["fwd"])
        ctx.save_for_backward(q, k, v, o, lse)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        B, H, T, E = q.shape
        group = H // k.shape[1]
        if do.stride(-1) != 1:
            do = do.contiguous()
        dq, dk, dv = grads_like(q, k, v)
        if not q.numel():
            return dq, dk, dv, None
        delta = torch.empty_like(lse)
        _delta_kernel[(triton.cdiv(T, 64), B * H)](o, do, delta, *_strides(o), *_strides(do), H, T, BM=64, E=E,
                                                   **launch_options(o.device))
        s = ctx.scale
        common = (q, k, v, do, lse, delta)
        strides = (*_strides(q), *_strides(k), *_strides(v), *_strides(do), H, group, T, s, s * LOG2E)
        bn = ctx.tiles["dkdv"][1]
        _launch(_dkdv_kernel, (B * k.shape[1], triton.cdiv(T, bn)), (*common, dk, dv, *strides), ctx.tiles["dkdv"])
        bm = ctx.tiles["dq"][0]
        _launch(_dq_kernel, (B * H, triton.cdiv(T, bm)), (*common, dq, *strides), ctx.tiles["dq"])
        return dq, dk, dv, None


def heads_of_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The (B, T, H + 2 K, E) tensor whose heads (B, n, T, E) q, k and v are, in order, as a view;
    else None."""
    return llama.side_by_side([x.transpose(1, 2) for x in (q, k, v)], 2)


def heads(whole: torch.Tensor, H: int, K: int) -> tuple[torch.Tensor, ...]:
    """q's, k's and v's heads (B, n, T, E) of a (B, T, H + 2 K, E) tensor."""
    return tuple(x.transpose(1, 2) for x in whole.split([H, K, K], dim=2))


def grads_like(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Empty gradients for q, k and v with their strides: the heads of one tensor where q, k and v
    are the heads of one contiguous (B, T, H + 2 K, E) tensor (as `layer.rope` hands them over,
    whose backward then rotates them in place), each like its own tensor otherwise."""
    whole = heads_of_one(q, k, v)
    if whole is None or not whole.is_contiguous():
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    return heads(torch.empty_like(whole), q.shape[1], k.shape[1])


def supported(q: torch.Tensor) -> bool:
    """Whether `attention` takes q (and its k, v): FP16/BF16 with a head width in WIDTHS."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in WIDTHS


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The model's attention through `attention` where it applies, else the model's own (the FP32
    policy's operands, other head widths)."""
    return attention(q, k, v) if supported(q) else llama.attend(q, k, v)


def check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, taken: bool, accepted: str) -> None:
    """Refuse operands an attention cannot take: the shapes and strides every one needs, and
    `taken` (its own dtype, width and device rule, described by `accepted`)."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ConfigError(f"attention q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; accepted: "
                          "q (B, H, T, E) and k, v (B, K, T, E)")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ConfigError(f"attention has {q.shape[1]} query heads and {k.shape[1]} key/value heads; accepted: "
                          "a number of key/value heads dividing the query heads")
    if not (taken and k.dtype == q.dtype == v.dtype and k.device == q.device == v.device):
        raise ConfigError(f"attention q {q.dtype} on {q.device}, k {k.dtype}, v {v.dtype}, head width "
                          f"{q.shape[-1]}; accepted: {accepted}")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ConfigError(f"attention strides q {q.stride()}, k {k.stride()}, v {v.stride()}; accepted: "
                          "any with the last dimension's stride 1")


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles: dict | None = None) -> torch.Tensor:
    """Causal grouped-query attention, softmax scale 1 / sqrt(E), with gradients for q, k and v.

    q (B, H, T, E), k and v (B, K, T, E) with K dividing H, one FP16/BF16 dtype, E in `WIDTHS`,
    any strides whose last is 1 (the model's transposed views of its projections). The output is
    (B, H, T, E) over (B, T, H, E) memory."""
    check(q, k, v, supported(q), f"one of float16, bfloat16 on one device, a head width in {WIDTHS}")
    return _Attention.apply(q, k, v, tiles or TILES[64 if q.shape[-1] <= 64 else 128])

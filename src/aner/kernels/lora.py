"""Fused low-rank adapter kernels (Triton): y = base(x) + (x @ A^T) @ B^T in FP32, without the
full-size FP32 intermediates.

An adapter adds delta = u @ B^T with u = x @ A^T, where A is (r, in), B is (out, r) (for LoRA
its factor times the adapter's scale, which the kernels apply as they read it) and r is small.
Written with torch ops under a FP16/BF16 policy this converts x to FP32, writes delta as a
(tokens, out) FP32 matrix, converts it and adds it, and backward does the same in reverse: about
16 bytes of traffic per output element each way, for 2 * r multiply-adds of work. Here three
kernels cover forward and backward:

    project        (M, N) @ W^T -> (M, r)       u = x @ A^T;  du = g @ B  (u, du as BF16 parts)
    expand         (base +) (M, r) @ W^T -> (M, N)  delta = u @ B^T;  du @ A (each + a base's own, or not)
    reduce_tokens  (M, N)^T @ (M, r) -> (N, r)  dB = g^T @ u;  dA^T = x^T @ du

The frozen base projection runs inside (`adapted_projection`). When it is a GEMM (a dense or
decoded weight), expand writes the delta rounded to x's dtype and the base's GEMM adds its own
product to it (beta = 1: the GEMM reads it in its epilogue); in backward expand writes du @ A and
the bases' input-gradient GEMMs add onto it. No pass reads a base's output again. cuBLAS's BF16
epilogue does not round the sum once: at an update's shapes it keeps about 30% of a delta below
half the output's step, as if it rounded its product before adding (`benchmarks/delta_rounding.py`;
the torch ops round twice too). Where the outputs are at least 4x as wide as x (gate and up) and
the bases' weights are decoded for each product or kept as casts with room
(`train.loop.kept_casts`), the delta joins the GEMM instead (`_joined`): project writes x and u's
BF16 parts side by side, the decode or cast has columns beside it for B's, and one GEMM makes the
sum, rounded once (a small delta kept whole): no delta is written or read. In reverse, where x
is at least twice as wide as the output (down), du @ A joins the input gradient's GEMM
(`_joined_grad`): g and du's parts side by side, A's under the weight. Any other base's output
is read by expand, which adds the delta to it in FP32 and rounds once. Projections
that read one input (q, k, v; gate, up) go together (`adapted_projections`): their A's stacked,
x is read once by project and once by reduce_tokens, and one expand writes du @ A for the input
gradient; where their bases' weights lie one under another (`_stacked`: decodes kept for
backward, dense casts), one GEMM makes all their outputs, side by side, and one their input
gradient. Where a layer's gate, up and down are all adapted over weights kept for backward with
that room, on a Hopper GPU, the SwiGLU between them runs inside those GEMMs (`gated_mlp`,
`mlp.py`).

Each reads its (M, N) operand once in its own dtype (FP32, FP16 or BF16) and computes its
products to FP32 accuracy, as the adapter policy requires: on the tensor cores through exact BF16
parts of the FP32 values, summed in FP32 (`fp32.fp32_dot`; measured on the H200 at several times
the FP32 multiply-add rate), or with FP32 multiply-adds (`Tiles(tc=False)`). No TF32. u and du
are carried as their exact BF16 parts (hi, mid, lo: three (M, r) planes), which project writes;
expand and reduce_tokens load them where they would otherwise split the same (M, r) tile again in
every one of their programs (the same bits). `expand` rounds its output once. Reductions over a
long dimension are split into a fixed number of parts that a second launch sums in order
(`splits.sum_splits`). Tiles and splits are fixed functions of the shapes: the same inputs give
the same bits on every run. The pure-torch reference is the unfused path in `aner.adapters`.
"""
import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..model.llama import Dense, one_under_another, side_by_side
from . import TARGET_PROGRAMS, joined_columns, joined_rows
from .fp32 import bf16_parts, fp32_dot, parts_dot, scaled, six_dot
from .launch import after_prior, launch_options
from .layer import swiglu_grad
from .splits import joined_args, store_parts, sum_splits


@dataclass(frozen=True)
class Tiles:
    """One launch's tiles: bm rows (tokens) x bn columns; split: parts of the dimension a
    program loops over (the reduced one of project and reduce_tokens, expand's rows; 0: enough
    parts for about `programs` programs); tc: products on the tensor cores through BF16 parts
    (`fp32.fp32_dot`), else FP32 FMAs; stages: the software pipeline's depth of those loops."""
    bm: int
    bn: int
    warps: int = 4
    split: int = 0
    tc: bool = True
    stages: int = 2
    programs: int = TARGET_PROGRAMS


@triton.jit
def _project_kernel(p, w, out, copy, copy_rows, M, N, R, p_rows, stride_wr, stride_wn, scale, out_plane, out_rows,
                    joined, joined_rows, left, right, STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    RP: tl.constexpr, P_BF16: tl.constexpr, TC: tl.constexpr, COPY: tl.constexpr,
                    SCALED: tl.constexpr, PARTS: tl.constexpr, JOINED: tl.constexpr):
    """out[s] (M, R) FP32 = p (M, N) @ w^T over columns [s, s + 1) * STEPS * BN of N, for p's rows
    p_rows apart and w (R, N) given by its strides (times `scale` when SCALED: `fp32.scaled`);
    COPY: p also written to `copy`'s rows, copy_rows apart. PARTS (one part, the whole of N):
    written instead as its BF16 parts (planes out_plane apart), and into `joined` when JOINED, as
    the ordered sum of parts writes them (`splits.store_parts`)."""
    after_prior()
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    pid_s = tl.program_id(1)
    offs_r = tl.arange(0, RP)
    m_mask = offs_m < M
    p_at = p + offs_m.to(tl.int64)[:, None] * p_rows
    acc = tl.zeros((BM, RP), dtype=tl.float32)
    for i in range(0, STEPS):                       # a constexpr trip count: one compile per width
        offs_n = (pid_s * STEPS + i) * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        pt = tl.load(p_at + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        if COPY:
            tl.store(copy + offs_m.to(tl.int64)[:, None] * copy_rows + offs_n[None, :], pt,
                     mask=m_mask[:, None] & n_mask[None, :])
        wt = tl.load(w + offs_r[None, :] * stride_wr + offs_n[:, None] * stride_wn,
                     mask=n_mask[:, None] & (offs_r < R)[None, :], other=0.0)       # (BN, RP)
        if SCALED:
            wt = scaled(wt, scale)
        acc = fp32_dot(pt, wt, acc, P_BF16, TC)
    rows, cols = offs_m.to(tl.int64)[:, None], offs_r[None, :]
    mask = m_mask[:, None] & (offs_r < R)[None, :]
    if PARTS:
        store_parts(acc, rows, cols, mask, out, out_plane, out_rows, joined, joined_rows, R, left, right, JOINED)
    else:
        tl.store(out + pid_s.to(tl.int64) * M * R + rows * R + cols, acc, mask=mask)


@triton.jit
def _expand_kernel(q, w, base, out, M, N, R, q_plane, q_rows, stride_wn, stride_wr, out_rows, scale,
                   STEPS: tl.constexpr, HAS_BASE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
                   TC: tl.constexpr, SCALED: tl.constexpr):
    """out (M, N) (rows out_rows apart) = base (M, N) + q (M, R) @ w^T for q given by its three
    BF16 parts (planes q_plane apart, rows q_rows apart) and w (N, R) by its strides (times `scale`
    when SCALED: `fp32.scaled`); FP32, one rounding. Program (j, s) writes column tile j of row tiles
    [s, s + 1) * STEPS, loading its tile of w once."""
    after_prior()
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    pid_s = tl.program_id(1)
    offs_r = tl.arange(0, RP)
    n_mask = offs_n < N
    r_mask = offs_r < R
    wt = tl.load(w + offs_r[:, None] * stride_wr + offs_n[None, :] * stride_wn,
                 mask=r_mask[:, None] & n_mask[None, :], other=0.0)                # (RP, BN)
    if SCALED:
        wt = scaled(wt, scale)
    w_hi, w_mid, w_lo = bf16_parts(wt)
    for i in range(0, STEPS):
        offs_m = (pid_s * STEPS + i) * BM + tl.arange(0, BM)
        m_mask = offs_m < M
        hi, mid, lo = _load_parts(q, offs_m, offs_r, m_mask[:, None] & r_mask[None, :], q_plane, q_rows)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if TC:
            acc = six_dot(hi, mid, lo, w_hi, w_mid, w_lo, acc)
        else:
            acc = fp32_dot(_whole(hi, mid, lo), wt, acc, False, False)
        rows = offs_m.to(tl.int64)[:, None]
        mask = m_mask[:, None] & n_mask[None, :]
        if HAS_BASE:
            acc += tl.load(base + rows * N + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(out + rows * out_rows + offs_n[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _load_parts(q, offs_m, offs_r, mask, q_plane, q_rows):
    """The (BM, RP) tiles of q's three BF16 parts at rows offs_m."""
    at = q + offs_m.to(tl.int64)[:, None] * q_rows + offs_r[None, :]
    return (tl.load(at, mask=mask, other=0.0), tl.load(at + q_plane, mask=mask, other=0.0),
            tl.load(at + 2 * q_plane, mask=mask, other=0.0))


@triton.jit
def _whole(hi, mid, lo):
    """The FP32 value of three BF16 parts: their sum in this order is exact."""
    return (hi.to(tl.float32) + mid.to(tl.float32)) + lo.to(tl.float32)


@triton.jit
def _reduce_tokens_kernel(p, q, part, M, N, R, p_rows, q_plane, q_rows, out_rows, out_cols, scale,
                          STEPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
                          P_BF16: tl.constexpr, TC: tl.constexpr, WHOLE: tl.constexpr, SCALED: tl.constexpr):
    """part[s] (N, R) FP32 = p[rows of part s]^T @ q[rows of part s] for p (M, N) (rows p_rows
    apart) and q (M, R) given by its three BF16 parts (planes q_plane apart, rows q_rows apart);
    part s is rows [s, s + 1) * STEPS * BM. WHOLE (one part, all M rows): written instead as the
    result, times `scale` when SCALED (`fp32.scaled`), at rows out_rows and columns out_cols
    apart, as the ordered sum of parts writes it."""
    after_prior()
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    pid_s = tl.program_id(1)
    offs_r = tl.arange(0, RP)
    n_mask = offs_n < N
    r_mask = offs_r < R
    acc = tl.zeros((BN, RP), dtype=tl.float32)
    for i in range(0, STEPS):
        offs_m = (pid_s * STEPS + i) * BM + tl.arange(0, BM)
        m_mask = offs_m < M
        pt = tl.load(p + offs_m.to(tl.int64)[:, None] * p_rows + offs_n[None, :],
                     mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        hi, mid, lo = _load_parts(q, offs_m, offs_r, m_mask[:, None] & r_mask[None, :], q_plane, q_rows)
        if TC:
            acc = parts_dot(tl.trans(pt), hi, mid, lo, acc, P_BF16)
        else:
            acc = fp32_dot(tl.trans(pt), _whole(hi, mid, lo), acc, P_BF16, False)
    mask = n_mask[:, None] & r_mask[None, :]
    if WHOLE:
        if SCALED:
            acc = scaled(acc, scale)
        tl.store(part + offs_n[:, None] * out_rows + offs_r[None, :] * out_cols, acc, mask=mask)
    else:
        tl.store(part + pid_s.to(tl.int64) * N * R + offs_n[:, None] * R + offs_r[None, :], acc, mask=mask)


@triton.jit
def _spread_kernel(b, out, N, R, stride_bn, stride_br, out_rows, out_cols, scale, BN: tl.constexpr, RP: tl.constexpr):
    """out[n, p * R + c] (BF16, rows out_rows and columns out_cols apart) = (scale * b[n, c])'s parts
    hi, hi, mid for p = 0, 1, 2: a joined operand's columns for b (N, R) FP32, given by its strides
    (through transposed views: its rows for b's transpose)."""
    after_prior()
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_r = tl.arange(0, RP)
    mask = (offs_n < N)[:, None] & (offs_r < R)[None, :]
    bt = tl.load(b + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br, mask=mask, other=0.0)
    hi, mid, _ = bf16_parts(scaled(bt, scale))
    at = out + offs_n.to(tl.int64)[:, None] * out_rows + offs_r.to(tl.int64)[None, :] * out_cols
    tl.store(at, hi, mask=mask)
    tl.store(at + R * out_cols, hi, mask=mask)
    tl.store(at + 2 * R * out_cols, mid, mask=mask)


def _spread(b: torch.Tensor, out: torch.Tensor, scale: float = 1.0) -> None:
    """out (N, 3 R) BF16, any strides = (scale * b (N, R) FP32)'s parts hi, hi, mid, side by side."""
    N, R = b.shape
    _spread_kernel[(triton.cdiv(N, 64),)](b, out, N, R, *b.stride(), *out.stride(), scale, BN=64, RP=_rank_tile(R),
                                          num_warps=4, **launch_options(b.device))


def _rank_tile(r: int) -> int:
    return max(16, triton.next_power_of_2(r))


def default_tiles(op: str, R: int) -> Tiles:
    """The tiles used when none are given: a fixed function of the op and the rank (measured at
    8192 tokens on the H200; ranks up to 48 at every shape of a Llama-3.2-1B and Llama-3.1-8B
    update, `benchmarks/lora_kernels.py --sweep`)."""
    rank_tile = _rank_tile(R)
    if op == "project":
        return Tiles(128, 32) if rank_tile > 64 else Tiles(128, 64, warps=8, stages=4 if rank_tile == 16 else 3)
    if op == "expand":   # 64 parts of the rows: two 64-row tiles a program at 8192 tokens
        return Tiles(64, 64 if rank_tile > 64 else 128, split=64)
    if rank_tile > 64:
        return Tiles(128, 32)
    # q's, k's and v's A's together (rank 48): one program a multiprocessor, 8 parts of the
    # tokens at 2048 columns
    return Tiles(64, 128, warps=8, programs=TARGET_PROGRAMS // 2) if rank_tile == 64 else Tiles(64, 128, stages=3)


def _parts(tiles: int, steps: int, split: int, programs: int = TARGET_PROGRAMS) -> tuple[int, int]:
    """(parts, steps per part) for `split` parts of `steps` (0: enough for `programs`), none empty."""
    split = split or max(1, programs // max(1, tiles))
    per = triton.cdiv(steps, max(1, min(split, steps)))
    return (triton.cdiv(steps, per) if steps else 1), per


def project(p: torch.Tensor, w: torch.Tensor, tiles: Tiles | None = None,
            parts: torch.Tensor | None = None, joined: tuple[torch.Tensor, int] | None = None,
            scale: float = 1.0) -> torch.Tensor:
    """p (M, N) @ (scale * w)^T -> (M, R) FP32, for p's rows at any stride and w (R, N) FP32 (any
    strides; scale * w rounded as torch rounds it); with `parts` ((3, M, R) BF16, e.g. columns of
    wider planes), written there as its BF16 parts instead, the operand expand and reduce_tokens
    take. With `joined` (x', r_0) and parts: p and the parts also written into x' as `_joined` lays
    them out."""
    p = _unit_columns(p)
    M, N = p.shape
    R = w.shape[0]
    assert joined is None or parts is not None
    t = tiles or default_tiles("project", R)
    split, per = _parts(triton.cdiv(M, t.bm), triton.cdiv(N, t.bn), t.split, t.programs)
    whole = parts is not None and split == 1                   # no sum to make: the kernel writes the parts
    if whole:
        assert parts.dtype == torch.bfloat16 and parts.shape == (3, M, R) and parts.stride(2) == 1
        out = parts
    else:
        out = torch.empty(split, M, R, device=p.device, dtype=torch.float32)
    copy = p if joined is None else joined[0][:, 3 * joined[1]:3 * joined[1] + N]
    if M:
        _project_kernel[(triton.cdiv(M, t.bm), split)](
            p, w, out, copy, copy.stride(0), M, N, R, p.stride(0), w.stride(0), w.stride(1), scale, out.stride(0),
            out.stride(1), *joined_args(joined if whole else None, R, out), STEPS=per, BM=t.bm, BN=t.bn,
            RP=_rank_tile(R), P_BF16=p.dtype == torch.bfloat16, TC=t.tc, COPY=joined is not None,
            SCALED=scale != 1.0, PARTS=whole, JOINED=whole and joined is not None, num_warps=t.warps,
            num_stages=t.stages, **launch_options(p.device))
    return out if whole else sum_splits(out, parts=parts, joined=joined)


def _unit_columns(t: torch.Tensor) -> torch.Tensor:
    """t when its columns are adjacent (its rows at any stride: the kernels take that), else a copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def to_parts(q: torch.Tensor) -> torch.Tensor:
    """(M, R) FP32 (any strides) -> its exact BF16 parts (3, M, R): hi, mid, lo, the form expand
    and reduce_tokens take q in (project writes it so)."""
    return sum_splits(q.contiguous()[None], parts=torch.empty(3, *q.shape, device=q.device, dtype=torch.bfloat16))


def _check_parts(q: torch.Tensor, M: int) -> int:
    assert q.dtype == torch.bfloat16 and q.shape[:2] == (3, M) and q.stride(2) == 1
    return q.shape[2]


def expand(q: torch.Tensor, w: torch.Tensor, base: torch.Tensor | None, dtype: torch.dtype,
           tiles: Tiles | None = None, scale: float = 1.0, out: torch.Tensor | None = None) -> torch.Tensor:
    """(base +) q (M, R) @ (scale * w)^T -> (M, N) in `dtype`, for q given by its BF16 parts
    (3, M, R) (rows of any stride, e.g. columns of wider planes), w (N, R) FP32 (any strides;
    scale * w rounded as torch rounds it) and base contiguous; into `out` when given (M, N) in
    `dtype` with rows at any stride, e.g. columns of a wider matrix."""
    M = q.shape[1]
    R = _check_parts(q, M)
    N = w.shape[0]
    t = tiles or default_tiles("expand", R)
    split, per = _parts(triton.cdiv(N, t.bn), triton.cdiv(M, t.bm), t.split, t.programs)
    if out is None:
        out = torch.empty(M, N, device=q.device, dtype=dtype)
    assert out.shape == (M, N) and out.dtype == dtype and out.stride(1) == 1
    assert base is None or base.is_contiguous()
    if M:
        _expand_kernel[(triton.cdiv(N, t.bn), split)](
            q, w, q if base is None else base, out, M, N, R, q.stride(0), q.stride(1), w.stride(0), w.stride(1),
            out.stride(0), scale, STEPS=per, HAS_BASE=base is not None, BM=t.bm, BN=t.bn, RP=_rank_tile(R), TC=t.tc,
            SCALED=scale != 1.0, num_warps=t.warps, num_stages=t.stages, **launch_options(q.device))
    return out


def reduce_tokens(p: torch.Tensor, q: torch.Tensor, tiles: Tiles | None = None, scale: float = 1.0,
                  transposed: bool = False) -> torch.Tensor:
    """scale * (p (M, N)^T @ q (M, R)) -> (N, R) FP32, or its transpose (R, N) when `transposed`
    (a contiguous tensor either way), for p's rows at any stride and q given by its BF16 parts
    (3, M, R) (rows of any stride: `project` writes them, `to_parts` makes them), made once and
    loaded by every program rather than split in each. The token dimension is split in a fixed
    number of parts summed in order; the scale multiplies that sum (one more rounding: torch's
    product of the sum and the float)."""
    p = _unit_columns(p)
    M, N = p.shape
    R = _check_parts(q, M)
    t = tiles or default_tiles("reduce_tokens", R)
    split, per = _parts(triton.cdiv(N, t.bn), triton.cdiv(M, t.bm), t.split, t.programs)
    out = torch.empty((R, N) if transposed else (N, R), device=p.device, dtype=torch.float32)
    nr = out.t() if transposed else out                         # the result as (N, R), at out's strides
    if not M:
        return out.zero_()
    whole = split == 1                                          # no sum to make: the kernel writes the result
    part = out if whole else torch.empty(split, N, R, device=p.device, dtype=torch.float32)
    # every program writes its part's tile: every element is written
    _reduce_tokens_kernel[(triton.cdiv(N, t.bn), split)](
        p, q, part, M, N, R, p.stride(0), q.stride(0), q.stride(1), *nr.stride(), scale, STEPS=per, BM=t.bm, BN=t.bn,
        RP=_rank_tile(R), P_BF16=p.dtype == torch.bfloat16, TC=t.tc, WHOLE=whole, SCALED=scale != 1.0,
        num_warps=t.warps, num_stages=t.stages, **launch_options(p.device))
    if not whole:
        sum_splits(part, out=nr, scale=scale)
    return out


def _stack(ts, dim):
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim)


def _planes(M: int, R: int, device) -> torch.Tensor:
    """(3, M, R) BF16: the planes of an (M, R) matrix's parts, for project to fill."""
    return torch.empty(3, M, R, device=device, dtype=torch.bfloat16)


def _columns(ranks):
    """The column slices of the stacked ranks."""
    ends = list(itertools.accumulate(ranks))
    return [slice(e - r, e) for e, r in zip(ends, ranks)]


def _joined(bases, x2d: torch.Tensor, dtype: torch.dtype, ranks) -> tuple[torch.Tensor, int] | None:
    """`_joins`' operand x' and r_0 where the deltas join, else None."""
    if not _joins(bases, x2d, dtype, ranks):
        return None
    M, K = x2d.shape
    return torch.empty(M, 3 * sum(ranks) + K, device=x2d.device, dtype=dtype), ranks[0]


def _joins(bases, x2d: torch.Tensor, dtype: torch.dtype, ranks) -> bool:
    """Whether the bases' deltas join their GEMMs along K.

    x' (M, 3 r_0 + K + 3 r_1) BF16 = [u_0's parts hi, mid, hi | x | u_1's parts hi, mid, hi],
    written by project as it reads x. Base 0 multiplies x''s first 3 r_0 + K columns by
    [B_0's parts hi, hi, mid | W_0], base 1 its last K + 3 r_1 by [W_1 | B_1's parts]: one GEMM
    each makes x @ W_i^T + u_i @ B_i^T, u's products u_hi B_hi + u_mid B_hi + u_hi B_mid (exact in
    FP32; what is left out is below 2^-16 of the leading one), the sum rounded once. No expand
    writes a delta and no GEMM reads one back. Where: BF16, one or two bases whose operand has
    columns to spare (`spare_room`: a decode, made for each product, or a cast kept with room),
    ranks that keep every column 16-byte aligned, and outputs at least 4x as wide as x (gate and
    up): there the delta's write and read outweigh x's copy and the 3 r more columns of each
    product; at q, k, v, o and down they do not (`benchmarks/joined_delta.py`)."""
    return x2d.dtype == dtype and all(getattr(base, "spare_room", False) for base in bases) \
        and joined_columns([base.weight.shape[0] for base in bases], x2d.shape[1], dtype, ranks) is not None


def _joined_product(base, i: int, wide: torch.Tensor, r0: int, b: torch.Tensor, scale: float, dtype: torch.dtype):
    """Base i's output through the joined operand x' (`_joined`), for the adapter's scale * b, and
    its weight in `dtype`."""
    N, R = b.shape
    left, right = (3 * R, 0) if i == 0 else (0, 3 * R)
    w = base.operand(dtype, left, right)                 # (N, left + K + right), the spare columns unwritten
    K = w.shape[1] - 3 * R
    _spread(b, w[:, :left] if left else w[:, K:], scale)
    x = wide[:, :left + K] if left else wide[:, 3 * r0:]
    with torch.autocast(wide.device.type, enabled=False):
        return torch.mm(x, w.t()), w[:, left:left + K]


def _paired(bases, wide: torch.Tensor, b_s, scales, dtype: torch.dtype) -> torch.Tensor:
    """Two bases' joined weights (`_joined`) as one matrix over every column of x' (M, 3 r_0 + K +
    3 r_1): base 0's rows [B_0's parts | W_0 | 0], base 1's [0 | W_1 | B_1's parts], so that one
    GEMM makes both outputs (`gated_mlp`). Each row's sum is its joined product's: the zeros add
    nothing. Casts kept with that room (`train.loop.kept_casts`) are that matrix as they lie."""
    (n0, r0), (n1, r1) = b_s[0].shape, b_s[1].shape
    K = wide.shape[1] - 3 * (r0 + r1)
    w = side_by_side([base.operand(dtype, 3 * r0, 3 * r1) for base in bases], 0) \
        if all(getattr(base, "room", None) for base in bases) else None
    if w is None:
        w = torch.empty(n0 + n1, wide.shape[1], device=wide.device, dtype=dtype)
        for base, part in zip(bases, w.split([n0, n1])):
            base.operand(dtype, 3 * r0, 3 * r1, out=part)
    w0, w1 = w.split([n0, n1])
    _spread(b_s[0], w0[:, :3 * r0], scales[0])
    _spread(b_s[1], w1[:, 3 * r0 + K:], scales[1])
    w0[:, 3 * r0 + K:].zero_()
    w1[:, :3 * r0].zero_()
    return w


def _joined_grad(bases, x2d: torch.Tensor, dtype: torch.dtype, ranks) -> int:
    """The rows to spare under the base's weight (3 r) when its input gradient joins du @ A
    to its GEMM along K, else 0: `_joined` in reverse.

    g' (M, N + 3 r) BF16 = [g | du's parts hi, mid, hi], written by project as it reads g, times
    [W; A's parts hi; hi; mid] (the spare rows) makes g @ W + du @ A in one GEMM, du's products
    as `_joined` makes u's, the sum rounded once: no expand writes du @ A and no GEMM reads it
    back. Where: one base whose operand has rows to spare (`spare_room`), BF16, ranks
    that keep every column 16-byte aligned, and an input at least twice as wide as the output
    (down): there that write and read (4 M K bytes) outweigh g's copy (2 M N) at least fourfold."""
    if x2d.dtype != dtype or not all(getattr(base, "spare_room", False) for base in bases):
        return 0
    return joined_rows([base.weight.shape[0] for base in bases], x2d.shape[1], dtype, ranks)


def _joined_input_grad(base, w: torch.Tensor | None, wide: torch.Tensor, a: torch.Tensor, dtype: torch.dtype,
                       below: int, gated=()):
    """dx = g' @ [W; A's parts] (`_joined_grad`), through the base's kept decode w (with `below`
    rows under W) or, for None, one made again. With `gated` (gate, up), the SwiGLU's that made x
    (`gated_mlp`): (dgate, dup), its backward inside the GEMM where the kernel takes it."""
    if w is None:
        w = base.operand(dtype, below=below)
    _spread(a.t(), w[w.shape[0] - below:].t())          # A (r, K)'s parts, rows hi, hi, mid under W
    if gated:
        from . import mlp       # Gluon: imported where it may run
        if mlp.supported(wide, w, *gated):
            return mlp.gated_backward(wide, w, *gated)
    with torch.autocast(wide.device.type, enabled=False):
        dx = torch.mm(wide, w)
    return swiglu_grad(*gated, dx) if gated else dx


def _stacked(bases, x2d: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Several bases' weights of one width in `dtype` laid one under another in one matrix, when
    each is a GEMM's operand: NF4 decodes kept for backward (`decoded_kept`), decoded here into
    one buffer, or dense casts, those `train.loop.kept_casts` laid out so taken as they lie (else
    made and concatenated: the same bits). Their products are then one GEMM, its outputs side by
    side, and backward's input gradient one GEMM over all the rows, as
    `model.llama._TrainedProjections` makes a trained group's: the fused RoPE and SwiGLU hand the
    outputs' gradients back side by side when the outputs were. None otherwise: a decode made again
    in backward (one decoded matrix at a time), a dense weight multiplied as it is (FP32), one base."""
    if len(bases) < 2 or len({base.weight.shape[1] for base in bases}) != 1:
        return None
    if all(type(base) is Dense and base.weight.dtype != dtype for base in bases):
        ws = [base.operand(dtype) for base in bases]              # casts: kept for the run, or made here
        if any(w is None for w in ws):
            return None
        return one_under_another(ws)
    if all(getattr(base, "spare_room", False) and base.keeps_operand for base in bases):
        rows = [base.weight.shape[0] for base in bases]
        w = torch.empty(sum(rows), bases[0].weight.shape[1], device=x2d.device, dtype=dtype)
        for base, part in zip(bases, w.split(rows)):
            base.operand(dtype, out=part)
        return w
    return None


def _operand_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a frozen base multiplies x in: the autocast policy's, else x's own."""
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class _AdaptedProjections(torch.autograd.Function):
    """y_i = base_i(x) + (x @ A_i^T) @ (s_i B_i)^T for frozen bases that read one x; gradients for x
    and every A_i and B_i. Each kernel that reads B_i multiplies it by the adapter's scale s_i as it
    loads it, and the one that sums dB_i's parts multiplies the sum: the bits of s_i * B_i made by
    torch and its product's backward, without a launch for either.

    A base whose product is a plain matrix product hands over its weight in the operand dtype
    (`operand(dtype)`: a dense weight's cast, or a whole decoded NF4 weight); its output is
    delta + x @ W^T, one cuBLAS GEMM onto expand's delta or with the delta joined to it along K
    (`_joined`), or for weights laid one under another (`_stacked`) one GEMM onto the deltas side
    by side; in backward the bases' input gradients are one chain of products into one buffer
    (dx = du @ A, then dx += g_i @ W_i inside each GEMM; with x in another dtype or another kind of
    base, du @ A is added last), so no pass adds them, one GEMM over the stacked weights' rows
    when the gradients come back side by side, or one GEMM with du @ A joined to it along K
    (`_joined_grad`: the operand then has rows to spare, and the forward's product reads the rows
    above them). A weight is kept for backward when the base says so (`keeps_operand`: a cast, as
    autograd would keep it; a decode under nf4_kernel="decoded_kept", a joined one as its weight's
    columns, one with rows to spare whole, stacked ones as their one matrix), else made again
    there (a decode: one decoded matrix exists at a time). Any other base runs on a detached x, its
    autograd graph recorded when x needs a gradient, and its input gradient is added to the
    chain's; the graph's root keeps no data (a projection's backward reads its inputs only).

    The A_i are stacked: one project reads x once for all of them, one reduce over the tokens
    makes all their gradients from one read of x, and one expand makes the stacked du @ A.

    `swiglu` (`gated_mlp`): "gate" for gate and up with joined deltas, their weights `_paired`:
    one GEMM makes both and h = silu(gate) * up (a third output, not differentiable), their input
    gradient one GEMM over the pair's rows; "down" for down reading that h, with gate and up the
    first tensors: their gradients, not h's, the SwiGLU's backward inside the joined input
    gradient's GEMM or after the chain's."""

    @staticmethod
    def forward(ctx, x2d, bases, track, scales, swiglu, *tensors):
        ctx.gated = tensors[:2] if swiglu == "down" else ()
        factors = tensors[len(ctx.gated):]
        a_s, b_s = factors[:len(bases)], factors[len(bases):]
        dtype = _operand_dtype(x2d)
        xo = x2d.to(dtype)
        a = _stack(a_s, 0)                                        # (sum r_i, in)
        ctx.ranks = [t.shape[0] for t in a_s]
        joined = _joined(bases, x2d, dtype, ctx.ranks)
        ctx.below = _joined_grad(bases, x2d, dtype, ctx.ranks) if track else 0
        stacked = None if joined is not None or ctx.below else _stacked(bases, x2d, dtype)
        # (M, sum r_i) as its BF16 parts
        u = project(x2d, a, parts=_planes(x2d.shape[0], a.shape[0], x2d.device), joined=joined)
        outs, kept, ctx.graphs = [], [], []
        if swiglu == "gate":                                      # gate, up and h: one kernel
            from . import mlp       # Gluon: imported where it may run
            w = _paired(bases, joined[0], b_s, scales, dtype)
            left, K = 3 * ctx.ranks[0], x2d.shape[1]
            outs = list(mlp.gated_forward(joined[0], *w.split([b.shape[0] for b in b_s]), gate_cols=left + K,
                                          up_first=left))
            ctx.mark_non_differentiable(outs[2])
            ctx.set_materialize_grads(False)
            kept, ctx.graphs = [w[:, left:left + K] if track else None], [None] * len(bases)
            stacked = w
        elif stacked is not None:                                 # one GEMM onto the deltas side by side
            out = torch.empty(x2d.shape[0], stacked.shape[0], device=x2d.device, dtype=dtype)
            outs = list(out.split([b.shape[0] for b in b_s], 1))
            for o, cols, b, s in zip(outs, _columns(ctx.ranks), b_s, scales):
                expand(u[:, :, cols], b, None, dtype, scale=s, out=o)
            with torch.autocast(x2d.device.type, enabled=False):
                out.addmm_(xo, stacked.t())
            kept, ctx.graphs = [stacked if track else None], [None] * len(bases)
        else:
            for i, (base, cols, b, s) in enumerate(zip(bases, _columns(ctx.ranks), b_s, scales)):
                u_i = u[:, :, cols]
                if joined is not None:
                    out, w = _joined_product(base, i, *joined, b, s, dtype)
                else:
                    w = base.operand(dtype, below=ctx.below) if ctx.below else base.operand(dtype)
                    if w is not None:
                        out = expand(u_i, b, None, dtype, scale=s)    # the delta; the GEMM adds x @ W^T
                        with torch.autocast(x2d.device.type, enabled=False):
                            out.addmm_(xo, w[:b.shape[0]].t())
                if w is not None:
                    outs.append(out)
                    kept.append(w if track and base.keeps_operand else None)
                    ctx.graphs.append(None)
                else:
                    with torch.enable_grad():
                        xb = x2d.detach().requires_grad_(track)
                        y = base(xb)                                  # (M, out_i), a fresh tensor
                    outs.append(expand(u_i, b, y.detach(), y.dtype, scale=s))
                    kept.append(None)
                    ctx.graphs.append((xb, y))
                    if track:
                        y.untyped_storage().resize_(0)
                del w                                                 # before the next decode
        ctx.save_for_backward(x2d, a, u, *b_s, *ctx.gated, *(w for w in kept if w is not None))
        ctx.kept = [w is not None for w in kept]
        ctx.stacked = stacked is not None
        ctx.bases, ctx.dtype, ctx.scales = bases, dtype, scales
        if not track:
            ctx.graphs = [None] * len(bases)
        return tuple(outs)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *gs):
        gs = gs[:len(ctx.ranks)]                                  # not h's ("gate")
        n, g2, needs = len(gs), len(ctx.gated), ctx.needs_input_grad
        x2d, a, u, *rest = ctx.saved_tensors
        b_s, gated, kept = rest[:n], rest[n:n + g2], iter(rest[n + g2:])
        factor_needs = needs[5 + g2:]
        want_dx = needs[0] or any(needs[5:5 + g2])                # "down": gate's and up's gradients
        du = _planes(x2d.shape[0], a.shape[0], x2d.device)       # (M, sum r_i): g_i @ s_i B_i, as BF16 parts
        # the input gradient joined (`_joined_grad`): project also writes g' = [g | du's parts]
        wide = None if not (ctx.below and want_dx) else \
            torch.empty(x2d.shape[0], gs[0].shape[1] + ctx.below, device=x2d.device, dtype=ctx.dtype)
        for g, b, cols, s in zip(gs, b_s, _columns(ctx.ranks), ctx.scales):
            project(g, b.t(), parts=du[:, :, cols], scale=s, joined=None if wide is None else (wide, 0))
        dx = None
        if wide is not None:
            dx = _joined_input_grad(ctx.bases[0], next(kept) if ctx.kept[0] else None, wide, a, ctx.dtype, ctx.below,
                                    gated)
        elif want_dx:
            # du @ A first when every base is a GEMM in x's dtype: each GEMM of the chain adds onto it
            first = x2d.dtype == ctx.dtype and all(graph is None for graph in ctx.graphs)
            if first:
                dx = expand(du, a.t(), None, x2d.dtype)
            if ctx.stacked:                               # one GEMM over all the rows when the gs are side by side
                w, g_all = next(kept), side_by_side(gs, 1)
                for g, w_i in [(g_all, w)] if g_all is not None else zip(gs, w.split([g.shape[1] for g in gs])):
                    dx = g @ w_i if dx is None else dx.addmm_(g, w_i)
            else:
                for base, g, has_w, graph in zip(ctx.bases, gs, ctx.kept, ctx.graphs):
                    if graph is not None:
                        (d,) = torch.autograd.grad(graph[1], graph[0], g)
                        dx = d if dx is None else dx.add_(d)
                        continue
                    w = next(kept) if has_w else base.operand(ctx.dtype)
                    dx = g @ w if dx is None else dx.addmm_(g, w)
                    del w
            if not first:
                dx = expand(du, a.t(), dx, x2d.dtype)
            if gated:
                dx = swiglu_grad(*gated, dx)
        ctx.graphs = None
        da = [None] * n
        if any(factor_needs[:n]):                                 # (r_i, in) = du_i^T x, rows of one tensor
            da = [d if need else None
                  for d, need in zip(reduce_tokens(x2d, du, transposed=True).split(ctx.ranks), factor_needs[:n])]
        db = [reduce_tokens(g, u[:, :, cols], scale=s) if need else None      # (out_i, r_i) = s_i g_i^T u_i
              for g, cols, s, need in zip(gs, _columns(ctx.ranks), ctx.scales, factor_needs[n:])]
        if gated:                                                 # for gate and up, none for h
            return None, None, None, None, None, *(dx or (None, None)), *da, *db
        return dx, None, None, None, None, *da, *db


def adapted_projections(bases, x: torch.Tensor, a_s, b_s, scales=None) -> tuple[torch.Tensor, ...]:
    """base_i(x) + (x @ a_i^T) @ (s_i b_i)^T for each i, each in its base output's dtype: x (..., in)
    of any float dtype, `bases` frozen projection modules (outputs (..., out_i), 2-D in and out
    along the last dimension), a_i (r_i, in) and b_i (out_i, r_i) FP32, s_i the floats `scales`
    (the adapters' scales; default all 1)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    scales = tuple(float(s) for s in scales) if scales is not None else (1.0,) * len(bases)
    outs = _AdaptedProjections.apply(x2d, tuple(bases), torch.is_grad_enabled() and x.requires_grad, scales, None,
                                     *a_s, *b_s)
    return tuple(out.reshape(*lead, out.shape[-1]) for out in outs)


def adapted_projection(base, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """adapted_projections for one base."""
    return adapted_projections((base,), x, (a,), (b,), (scale,))[0]


def gated_mlp(x: torch.Tensor, gate, up, down) -> torch.Tensor | None:
    """down(silu(gate(x)) * up(x)) for adapted projections (`base`, `lora_a`, `lora_b`, `scale`),
    with the SwiGLU inside the GEMMs (`mlp`): gate's and up's products (their deltas joined, their
    weights `_paired`) make h in the same kernel, and down's input gradient (joined, where its
    input is twice its output's width) gives gate's and up's; no pass writes gate and up for the
    SwiGLU to read, nor dh. Where: gate's and up's deltas join (`_joins`), every base's operand is
    kept for backward (a decode under decoded_kept, or a cast), gate and up are as wide (a
    multiple of 8: up's output 16-byte aligned beside gate's) and the kernel takes x (a Hopper
    GPU); None elsewhere, for the caller to make the projections and the SwiGLU apart. The SwiGLU
    is the fused kernel's (`layer.swiglu`)."""
    lead = x.shape[:-1]
    x2d = x.reshape(-1, x.shape[-1]).contiguous()
    dtype = _operand_dtype(x2d)
    bases, ranks = (gate.base, up.base), [gate.lora_a.shape[0], up.lora_a.shape[0]]
    F = gate.base.weight.shape[0]
    if not _joins(bases, x2d, dtype, ranks) or not all(b.keeps_operand for b in (*bases, down.base)) \
            or up.base.weight.shape[0] != F or F % 8:
        return None
    from . import mlp       # Gluon: imported where it may run
    if not mlp.supported(x2d):
        return None
    track = torch.is_grad_enabled() and x.requires_grad
    g, u, h = _AdaptedProjections.apply(x2d, bases, track, (float(gate.scale), float(up.scale)), "gate",
                                        gate.lora_a, up.lora_a, gate.lora_b, up.lora_b)
    (out,) = _AdaptedProjections.apply(h, (down.base,), track, (float(down.scale),), "down", g, u, down.lora_a,
                                       down.lora_b)
    return out.reshape(*lead, out.shape[-1])

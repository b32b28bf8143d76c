"""Warp-specialized fused NF4 products for Hopper (Gluon): the decode beside the matrix units.

The Triton kernels of `nf4.py` decode a weight tile and multiply it in the same warps, so the
decode's instructions and the tensor cores take turns. Here a persistent program (one a
multiprocessor, or one a tile) walks output tiles of 256 tokens x 128 features with three
partitions side by side, handing tiles over through rings of shared memory guarded by mbarriers:

    MMA       8 warps  a TMA ring of the activation tiles; two warpgroups of MMAs (FP32
                       accumulation) over the reduced steps; the output tile
    decode x2 4 warps  a TMA ring of the packed code words, the absmax (loaded a step ahead),
                       the weight tile in BF16/FP16 stored for the MMA; the two partitions
                       take the even and the odd steps

    forward      y (M, N) = x (M, K) @ W^T   weight tile (128 rows, 64 columns) a step, operand B^T
    input grad  dx (M, K) = g (M, N) @ W     weight tile (64 rows, 128 columns) a step, operand B

The decode is `nf4._TABLE_*` (the per-block table of the 16 rounded products): the operand bits
are `NF4Weight.dequantize()` rounded to the operand dtype, as in the Triton kernels; each output
is summed by one program in ascending steps, no atomics, so the same inputs give the same bits on
every run. No decoded weight exists outside a program's shared memory. `supported()` says where
it applies (sm_90, FP16/BF16, K % 64 == 0, N % 8 == 0 backward, a wave of tiles); elsewhere the
Triton kernels run. `skip` (benchmarks only) replaces the decode by a conversion of the code
words (wrong values, the same copies and handoffs): the time of everything but the decode.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .nf4 import _TABLE_BF16, _TABLE_F16, _TABLE_IO, MULTIPROCESSORS, hopper

BO = 128            # output features a tile
STEP = 64           # reduced elements a step: one NF4 block of a row forward, 64 rows backward
GROUP_M = 8


@gluon.jit
def _tile(t, M, O, BMc: gl.constexpr, BOc: gl.constexpr, GROUP: gl.constexpr):
    """Tile t -> (first token, first output), GROUP token tiles walking the same weight tiles."""
    m_tiles = gl.cdiv(M, BMc)
    per_group = GROUP * gl.cdiv(O, BOc)
    first_m = (t // per_group) * GROUP
    size_m = gl.minimum(m_tiles - first_m, GROUP)
    return (first_m + (t % per_group) % size_m) * BMc, ((t % per_group) // size_m) * BOc


@gluon.jit
def _at(h, steps, M, O, BMc: gl.constexpr, BOc: gl.constexpr, GROUP: gl.constexpr):
    """The program's global step h -> (step of its tile, tile, first token, first output)."""
    t = gl.program_id(0) + (h // steps) * gl.num_programs(0)
    off_m, off_o = _tile(t, M, O, BMc, BOc, GROUP)
    return h % steps, t, off_m, off_o


@gluon.jit
def _advance(i, t, off_m, off_o, by, steps, M, O, BMc: gl.constexpr, BOc: gl.constexpr, GROUP: gl.constexpr):
    """`_at` of `by` steps later, without a division unless the tile changes."""
    i += by
    while i >= steps:
        i -= steps
        t += gl.num_programs(0)
        off_m, off_o = _tile(t, M, O, BMc, BOc, GROUP)
    return i, t, off_m, off_o


@gluon.jit
def _load_a(a_desc, a_bufs, a_ready, h, i, off_m, pred):
    """TMA of the activation tile of global step h (step i of a tile at token off_m) into its slot."""
    s = h % a_bufs.type.shape[0]
    mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, i * a_desc.block_type.shape[1]], a_ready.index(s),
                                    a_bufs.index(s), pred=pred)


@gluon.jit
def _load_codes(c_desc, c_bufs, c_ready, h, i, off_o, pred, TRANS: gl.constexpr):
    """TMA of the code words of global step h's weight tile (step i, outputs from off_o) into its slot."""
    R: gl.constexpr = c_desc.block_type.shape[0]
    G: gl.constexpr = c_desc.block_type.shape[1]
    s = h % c_bufs.type.shape[0]
    mbarrier.expect(c_ready.index(s), c_desc.block_type.nbytes, pred=pred)
    if TRANS:
        coord = [i * R, off_o // 64, 0]
    else:
        coord = [off_o, i * G, 0]
    tma.async_copy_global_to_shared(c_desc, coord, c_ready.index(s), c_bufs.index(s), pred=pred)


@gluon.jit
def _absmax(blk, mask, absmax, acodes, ascales, aoffset, dyncb, DQ: gl.constexpr):
    if DQ:
        code = gl.load(acodes + blk, mask=mask, other=0).to(gl.int32)
        scale = gl.load(ascales + (blk >> 8), mask=mask, other=0.0)
        return gl.load(dyncb + code) * scale + gl.load(aoffset)       # two roundings (no FMA)
    else:
        return gl.load(absmax + blk, mask=mask, other=0.0)


@gluon.jit
def _step_absmax(i, off_o, pred, r, g, N, KB, absmax, acodes, ascales, aoffset, dyncb, TRANS: gl.constexpr,
                 DQ: gl.constexpr):
    """(R, G, 1) absmax of the blocks of step i's weight tile (outputs from off_o); 0 where not pred."""
    R: gl.constexpr = r.shape[0]
    G: gl.constexpr = g.shape[0]
    if TRANS:
        rows = i * R + r
        grps = off_o // 64 + g
    else:
        rows = off_o + r
        grps = i * G + g
    mask = (rows < N)[:, None] & (grps < KB)[None, :] & pred
    blk = rows.to(gl.int64)[:, None] * KB + grps[None, :]
    return _absmax(blk, mask, absmax, acodes, ascales, aoffset, dyncb, DQ)[:, :, None]


@gluon.jit
def _decode(c_desc, c_bufs, w_bufs, c_ready, w_ready, w_empty, absmax, acodes, ascales, aoffset, dyncb,
            M, N, K, O, steps, total, BMc: gl.constexpr, BOc: gl.constexpr, GROUP: gl.constexpr,
            TRANS: gl.constexpr, DQ: gl.constexpr, SKIP: gl.constexpr, PHASE: gl.constexpr):
    """A decode partition: the program's global steps PHASE, PHASE + 2, ... (two partitions take turns):
    code words (TMA, the ring slots of its steps) + absmax (loaded a step ahead) -> weight tiles."""
    CS: gl.constexpr = c_bufs.type.shape[0]
    WS: gl.constexpr = w_bufs.type.shape[0]
    R: gl.constexpr = c_bufs.type.shape[1]          # weight rows a step
    G: gl.constexpr = c_bufs.type.shape[2]          # NF4 blocks of a row a step (64 columns each)
    NW: gl.constexpr = gl.num_warps()
    S: gl.constexpr = NW * 32 // (R * G)            # threads a block: each takes 8 / S of its words
    gl.static_assert(CS % 2 == 0 and WS % 2 == 0)
    words_layout: gl.constexpr = gl.BlockedLayout([1, 1, 8 // S], [32 // (G * S), G, S], [NW, 1, 1], [2, 1, 0])
    blocks_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
    KB = K // 64
    r = gl.arange(0, R, layout=gl.SliceLayout(1, blocks_layout))
    g = gl.arange(0, G, layout=gl.SliceLayout(0, blocks_layout))
    for s in gl.static_range(PHASE, CS, 2):
        ci, ct, c_m, c_o = _at(s, steps, M, O, BMc, BOc, GROUP)
        _load_codes(c_desc, c_bufs, c_ready, s, ci, c_o, s < total, TRANS)
    ci, ct, c_m, c_o = _at(PHASE + CS, steps, M, O, BMc, BOc, GROUP)     # the code stream: step h - 2 + CS
    ai, at, a_m, a_o = _at(PHASE, steps, M, O, BMc, BOc, GROUP)          # the absmax stream: step h + 2
    am_next = _step_absmax(ai, a_o, PHASE < total, r, g, N, KB, absmax, acodes, ascales, aoffset, dyncb, TRANS, DQ)
    ai, at, a_m, a_o = _advance(ai, at, a_m, a_o, 2, steps, M, O, BMc, BOc, GROUP)
    for h in range(PHASE, total, 2):
        if h > PHASE:
            # every thread read the previous step's code slot before the barrier of its w_ready arrive
            _load_codes(c_desc, c_bufs, c_ready, h - 2 + CS, ci, c_o, h - 2 + CS < total, TRANS)
            ci, ct, c_m, c_o = _advance(ci, ct, c_m, c_o, 2, steps, M, O, BMc, BOc, GROUP)
        am = am_next
        am_next = _step_absmax(ai, a_o, h + 2 < total, r, g, N, KB, absmax, acodes, ascales, aoffset, dyncb,
                               TRANS, DQ)
        ai, at, a_m, a_o = _advance(ai, at, a_m, a_o, 2, steps, M, O, BMc, BOc, GROUP)
        mbarrier.wait(c_ready.index(h % CS), (h // CS) & 1)
        words = c_bufs.index(h % CS).load(words_layout)                    # (R, G, 8 // S) int32
        if SKIP:
            q = words.to(w_bufs.dtype)
            v = (q, q, q, q, q, q, q, q)
        elif w_bufs.dtype == gl.bfloat16:
            v = gl.inline_asm_elementwise(_TABLE_BF16, _TABLE_IO, [words, am], dtype=(gl.bfloat16,) * 8,
                                          is_pure=True, pack=1)
        else:
            v = gl.inline_asm_elementwise(_TABLE_F16, _TABLE_IO, [words, am], dtype=(gl.float16,) * 8,
                                          is_pure=True, pack=1)
        # (R, G, 8 // S, a, b, c) holds element 4a + 2b + c of each word (as nf4._decode_k64)
        e = gl.join(gl.join(gl.join(v[0], v[4]), gl.join(v[2], v[6])),
                    gl.join(gl.join(v[1], v[5]), gl.join(v[3], v[7])))
        w = gl.reshape(e, [R, G * 64])
        mbarrier.wait(w_empty.index(h % WS), ((h // WS) & 1) ^ 1)
        w_bufs.index(h % WS).store(w)
        fence_async_shared()
        mbarrier.arrive(w_ready.index(h % WS))


@gluon.jit
def _multiply(a_desc, a_bufs, w_bufs, a_ready, w_ready, w_empty, out, M, O, steps, total, BOc: gl.constexpr,
              GROUP: gl.constexpr, TRANS: gl.constexpr, num_warps: gl.constexpr):
    """The MMA partition: its own TMA ring of activation tiles, the decoded weight tiles, the outputs."""
    BMc: gl.constexpr = a_bufs.type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BOc, 16])
    AS: gl.constexpr = a_bufs.type.shape[0]
    WS: gl.constexpr = w_bufs.type.shape[0]
    for s in gl.static_range(AS):
        li, lt, l_m, l_o = _at(s, steps, M, O, BMc, BOc, GROUP)
        _load_a(a_desc, a_bufs, a_ready, s, li, l_m, s < total)
    li, lt, l_m, l_o = _at(AS, steps, M, O, BMc, BOc, GROUP)            # the activation stream: step h - 1 + AS
    h = 0
    for t in range(gl.program_id(0), gl.cdiv(M, BMc) * gl.cdiv(O, BOc), gl.num_programs(0)):
        acc = gl.zeros((BMc, BOc), dtype=gl.float32, layout=layout)
        for i in range(steps):
            mbarrier.wait(a_ready.index(h % AS), (h // AS) & 1)
            mbarrier.wait(w_ready.index(h % WS), (h // WS) & 1)
            if TRANS:
                b = w_bufs.index(h % WS)
            else:
                b = w_bufs.index(h % WS).permute((1, 0))
            acc = warpgroup_mma(a_bufs.index(h % AS), b, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            # the MMA of step h - 1 is done: its activation slot takes step h - 1 + AS, its weight slot is free
            if i > 0:
                _load_a(a_desc, a_bufs, a_ready, h - 1 + AS, li, l_m, h - 1 + AS < total)
                li, lt, l_m, l_o = _advance(li, lt, l_m, l_o, 1, steps, M, O, BMc, BOc, GROUP)
                mbarrier.arrive(w_empty.index((h - 1) % WS))
            h += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        _load_a(a_desc, a_bufs, a_ready, h - 1 + AS, li, l_m, h - 1 + AS < total)
        li, lt, l_m, l_o = _advance(li, lt, l_m, l_o, 1, steps, M, O, BMc, BOc, GROUP)
        mbarrier.arrive(w_empty.index((h - 1) % WS))
        off_m, off_o = _tile(t, M, O, BMc, BOc, GROUP)
        rows = off_m + gl.arange(0, BMc, layout=gl.SliceLayout(1, layout))
        cols = off_o + gl.arange(0, BOc, layout=gl.SliceLayout(0, layout))
        mask = (rows < M)[:, None] & (cols < O)[None, :]
        gl.store(out + rows.to(gl.int64)[:, None] * O + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)


@gluon.jit
def _nf4_ws_kernel(a_desc, c_desc, out, absmax, acodes, ascales, aoffset, dyncb, M, N, K, O, steps,
                   W_LAYOUT: gl.constexpr, W_ROWS: gl.constexpr, W_COLS: gl.constexpr, TRANS: gl.constexpr,
                   DQ: gl.constexpr, GROUP: gl.constexpr, AS: gl.constexpr, WS: gl.constexpr, CS: gl.constexpr,
                   DW: gl.constexpr, DREGS: gl.constexpr, SKIP: gl.constexpr, num_warps: gl.constexpr):
    """out (M, O) = a (M, reduced) @ (W^T forward, W with TRANS); a program walks the (BM, BO)
    tiles pid, pid + programs, ...; its steps are numbered across them for the rings' slots."""
    BMc: gl.constexpr = a_desc.block_type.shape[0]
    BOc: gl.constexpr = W_COLS if TRANS else W_ROWS
    tiles = gl.cdiv(M, BMc) * gl.cdiv(O, BOc)
    total = gl.cdiv(tiles - gl.program_id(0), gl.num_programs(0)) * steps    # this program's steps

    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [AS] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(a_desc.dtype, [WS, W_ROWS, W_COLS], W_LAYOUT)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [CS] + c_desc.block_type.shape, c_desc.layout)
    a_ready = gl.allocate_shared_memory(gl.int64, [AS, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [WS, 1], mbarrier.MBarrierLayout())
    w_empty = gl.allocate_shared_memory(gl.int64, [WS, 1], mbarrier.MBarrierLayout())
    c_ready = gl.allocate_shared_memory(gl.int64, [CS, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(AS):
        mbarrier.init(a_ready.index(s), count=1)
    for s in gl.static_range(WS):
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(w_empty.index(s), count=1)
    for s in gl.static_range(CS):
        mbarrier.init(c_ready.index(s), count=1)

    gl.warp_specialize([
        (_multiply, (a_desc, a_bufs, w_bufs, a_ready, w_ready, w_empty, out, M, O, steps, total, BOc, GROUP, TRANS,
                     num_warps)),
        (_decode, (c_desc, c_bufs, w_bufs, c_ready, w_ready, w_empty, absmax, acodes, ascales, aoffset, dyncb,
                   M, N, K, O, steps, total, BMc, BOc, GROUP, TRANS, DQ, SKIP, 0)),
        (_decode, (c_desc, c_bufs, w_bufs, c_ready, w_ready, w_empty, absmax, acodes, ascales, aoffset, dyncb,
                   M, N, K, O, steps, total, BMc, BOc, GROUP, TRANS, DQ, SKIP, 1)),
    ], [DW, DW], [DREGS, DREGS])


_GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


@functools.cache
def layout(shape: tuple, dtype) -> gl.NVMMASharedLayout:
    """Triton's default shared-memory layout of a tile, made once a shape and dtype: making it
    takes a call's host ~14 us, three times the TMA descriptor that carries it."""
    return gl.NVMMASharedLayout.get_default_for(list(shape), dtype)


BM = 256            # tokens a tile: two warpgroups of the MMA partition, 128 rows each


def supported(a: torch.Tensor, packed, trans: bool) -> bool:
    """Whether the warp-specialized kernel takes a @ W^T (a @ W with `trans`): a Hopper GPU,
    FP16/BF16, whole NF4 blocks in every row, TMA-aligned rows, and at least a wave of tiles
    (it has no split of the reduced dimension; the Triton kernels do)."""
    N, K = packed.shape
    O = K if trans else N
    return (hopper(a.device) and a.dtype in _GL
            and K % 64 == 0 and (not trans or N % 8 == 0) and a.data_ptr() % 16 == 0
            and -(-a.shape[0] // BM) * -(-O // BO) >= MULTIPROCESSORS)


def specialization(a, words, trans, bm=BM, dw=4, dregs=72, stages=(4, 4, 8), skip=False):
    """The TMA descriptors of `a` and the (N, K / 64, 8) int32 code words, the kernel's
    compile-time constants (but DQ) and its launch options: bm tokens a tile (32 a warp of the MMA
    partition), two decode partitions of dw warps at dregs registers, the (activation, weight,
    code) ring depths. Host tensors give what a compile-only report needs."""
    dt = _GL[a.dtype]
    a_desc = TensorDescriptor.from_tensor(a, [bm, STEP], layout((bm, STEP), dt))
    rows, grps = (STEP, BO // 64) if trans else (BO, 1)
    c_desc = TensorDescriptor.from_tensor(words, [rows, grps, 8], layout((rows, grps, 8), gl.int32))
    const = dict(W_LAYOUT=layout((rows, grps * 64), dt), W_ROWS=rows,
                 W_COLS=grps * 64, TRANS=trans, GROUP=GROUP_M, AS=stages[0], WS=stages[1], CS=stages[2],
                 DW=dw, DREGS=dregs, SKIP=skip)
    warps = bm // 32
    options = dict(num_warps=warps, maxnreg=65536 // (32 * (warps + 2 * dw)) // 8 * 8, enable_fp_fusion=False)
    return a_desc, c_desc, const, options


def nf4_ws_matmul(a, packed, trans, programs=None, **tiles):
    """a (M, K) @ W^T, or with `trans` a (M, N) @ W, in a's dtype (`tiles`: `specialization`'s),
    with `programs` programs, each walking every programs-th tile (default: one a tile: a
    persistent grid of one a multiprocessor was 5-10% faster on two of three shapes at 8192
    tokens, 5% slower on the third, and 1.42x or 2.02x dense at 2048 in two calls; NOTES)."""
    N, Kin = packed.shape
    M = a.shape[0]
    O = Kin if trans else N
    out = torch.empty(M, O, device=a.device, dtype=a.dtype)
    words = packed.codes.view(torch.int32).view(N, Kin // 64, 8)
    a_desc, c_desc, const, options = specialization(a, words, trans, **tiles)
    steps = -(-N // STEP) if trans else Kin // STEP
    count = -(-M // a_desc.block_shape[0]) * -(-O // BO)
    _, absmax, acodes, ascales, aoffset, _, dyncb = packed._args()
    _nf4_ws_kernel[(min(count, programs or count),)](
        a_desc, c_desc, out, absmax, acodes, ascales, aoffset, dyncb, M, N, Kin, O, steps,
        DQ=packed.double_quant, **const, **options)
    return out

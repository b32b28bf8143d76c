"""The fused NF4 products for Hopper with the weight as the MMA's register operand (Gluon).

`nf4_ws` decodes a weight tile into shared memory in warps of its own and hands it to MMA warps
that wait for it. Here each warpgroup of MMA warps decodes its own rows straight into the
registers that the warpgroup MMA takes as its first operand: no decoded tile in shared memory, no
handoff, no decode warps. The first operand being the weight, a program makes tiles of y^T,
128 output features x 256 tokens, one NF4 block of every row a step:

    y^T (N, M) = W (N, K) @ x^T (K, M)        stored transposed by TMA, so y (M, N) = x @ W^T

    MMA x2    4 warps  64 rows of the tile each, steps 8 at a time: decode a step's rows into
                       operand registers while the MMA of the step before runs, issue its MMA
                       (FP32 accumulation), wait for the one before, free its ring slot
    loader    1 warp   a TMA ring, each slot a step's activation tile and the next step's code
                       words and absmax: read from shared memory a step before their decode

Both directions read their absmax, with each step's code words, from the transposed copy's FP32
absmax (`DevicePacked.absmax_t`: a row a column of W's blocks, double quantization decoded once
when the copy is made): the forward a step's 128 rows', each element multiplied by its row's. The
input gradient dx = g @ W is the same product of g and W^T, whose blocks run down its columns: it
reads the transposed codes (`DevicePacked.codes_t`) and the absmax of the step's 64 columns
(COLS), each element multiplied by its column's. That copy stores the 8 bytes a thread decodes of
a row side by side, so a thread reads 8 bytes a row and step where W's own layout has each of a
row's 4 lanes read all its 32.

An MMA's operand registers may not be written until a wait has seen it finish, and ptxas is not
bound to keep them from other values: each step's are held past that wait (`_hold`), so two
steps' operands are live at once, and a group's last MMA is waited for before the next group
decodes (one left in flight around the loop, ptxas serializes every MMA for want of registers,
and in the loop's body it puts that wait ahead of the next decode). The two warpgroups are
separate partitions. A thread of the operand layout holds, of each of its two rows and each 16
columns, columns 2t, 2t + 1, 2t + 8, 2t + 9 (t = lane % 4): byte t of each of the row's 8 code
words. A code's value comes from the lane of its number (lane l holds codebook entry
l % 16; `_shuffle_lookup_asm`), is multiplied by its block's absmax in FP32 and rounded to the operand
dtype: the operand bits are `NF4Weight.dequantize()` rounded, as in every other NF4 kernel, and
each output is summed in ascending steps by one program, so the bits equal `nf4_ws`'s and the
same inputs give the same bits on every run. `supported()` says where it applies.
"""
import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from . import nf4_ws
from .nf4 import MULTIPROCESSORS
from .nf4_ws import _GL, _at, _tile, layout

BF = nf4_ws.BO      # output features a tile (128): two warpgroups of 64 rows
BT = nf4_ws.BM      # tokens a tile (256)
STEP = gl.constexpr(64)
GROUP_M = 8


@functools.cache
def _shuffle_lookup_asm(cvt: str, columns: bool) -> str:
    """PTX for four code words of one row ($4, $6, $8, $10), the lane's byte t ($12), the block
    absmax of every element ($20 .. $27: one for the row, or with `columns` one a column: $20 + 2i + e
    for element e of word i) and the lane's codebook entry ($28: lane l holds code l % 16's value)
    -> the two values of byte t of each word: $i = (its high nibble's, its low nibble's) of word i,
    a pair of 16-bit floats as the MMA's operand registers hold them (byte k holds element 2k in its
    high nibble). With `columns` the four are one register (the same in each) that holds byte t of
    each word (byte i of it word i's: the transposed copy's layout), so each byte is at a fixed
    shift. A value is read from the lane of its code by a shuffle within each half-warp, which takes
    the low 4 bits of the index; then absmax times it in FP32, rounded by `cvt`."""
    lines = [".reg .b32 lo, hi;", ".reg .f32 vl, vh;"]
    if not columns:
        lines += [".reg .b32 sh;", "shl.b32 sh, $12, 3;"]
    for i in range(4):
        word = f"${4 + 2 * i}"
        if columns:
            low, high = f"${21 + 2 * i}", f"${20 + 2 * i}"
            lines += [f"shr.b32 lo, {word}, {8 * i};" if i else f"mov.b32 lo, {word};",
                      f"shr.b32 hi, {word}, {8 * i + 4};"]
        else:
            low = high = "$20"
            lines += [f"shr.b32 lo, {word}, sh;", "shr.b32 hi, lo, 4;"]
        lines += ["shfl.sync.idx.b32 vl, $28, lo, 0x100f, -1;", "shfl.sync.idx.b32 vh, $28, hi, 0x100f, -1;",
                  f"mul.rn.f32 vl, vl, {low};", f"mul.rn.f32 vh, vh, {high};", f"{cvt} ${i}, vl, vh;"]
    return "{\n" + "\n".join(lines) + "\n}"


_CVT = {torch.bfloat16: "cvt.rn.bf16x2.f32", torch.float16: "cvt.rn.f16x2.f32"}
_LOOKUP_IO = gl.constexpr("=r," * 4 + ",".join(["r"] * 40))     # 8 elements a call: 5 inputs of 8
# the transposed copy's absmax of a step's 64 columns through the ring as (h, i, t, e) of word 4 h + i,
# stored (word // 2, t, e, word % 2): a thread's 4 of two words side by side (`nf4.transposed_copy`)
_COLUMNS = gl.constexpr(gl.SharedLinearLayout([[0, 1, 0, 0], [0, 0, 0, 1], [0, 0, 1, 0], [0, 0, 2, 0], [0, 2, 0, 0],
                                               [1, 0, 0, 0]]))
# the forward's: a step's absmax of 64 rows as the transposed copy stores them, (row // 16, row % 8 // 2,
# row % 2, row % 16 // 8), read as rows: a thread's two, rows r and r + 8, side by side
_ROWS = gl.constexpr(gl.SharedLinearLayout([[8], [1], [2], [4], [16], [32]]))
_PLAIN = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)     # its TMA tile as stored


@gluon.jit
def _loads(x_desc, c_desc, a_desc, x_bufs, c_bufs, a_bufs, c_first, a_first, ready, empty, M, N, steps,
           GROUP: gl.constexpr, COLS: gl.constexpr):
    """The loader warp: into slot h % S of the ring, step h's activation tile and step h + 1's code
    words and absmax (its rows', with COLS its columns'), so that the MMA warps read them a step
    before they decode it; the program's first step's come with its first slot, into c_first and a_first."""
    S: gl.constexpr = x_bufs.type.shape[0]
    BTc: gl.constexpr = x_desc.block_type.shape[0]
    BFc: gl.constexpr = c_desc.block_type.shape[0]
    xbytes: gl.constexpr = x_desc.block_type.nbytes
    wbytes: gl.constexpr = c_desc.block_type.nbytes + a_desc.block_type.nbytes
    tiles = gl.cdiv(M, BTc) * gl.cdiv(N, BFc)
    h = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        off_m, off_n = _tile(tile, M, N, BTc, BFc, GROUP)
        for i in range(steps):
            s = h % S
            wi, wt, _, wn = _at(h + 1, steps, M, N, BTc, BFc, GROUP)
            ahead = wt < tiles                          # a step after this one: its words, at (wn, wi)
            first = h == 0
            mbarrier.wait(empty.index(s), ((h // S) & 1) ^ 1)
            # one of the four: the slot's bytes with or without the next step's words, and the first's
            mbarrier.expect(ready.index(s), xbytes + wbytes, pred=ahead & (not first))
            mbarrier.expect(ready.index(s), xbytes + 2 * wbytes, pred=ahead & first)
            mbarrier.expect(ready.index(s), xbytes, pred=(not ahead) & (not first))
            mbarrier.expect(ready.index(s), xbytes + wbytes, pred=(not ahead) & first)
            tma.async_copy_global_to_shared(x_desc, [off_m, i * STEP], ready.index(s), x_bufs.index(s))
            tma.async_copy_global_to_shared(c_desc, [wn, wi * 8], ready.index(s), c_bufs.index(s), pred=ahead)
            tma.async_copy_global_to_shared(c_desc, [off_n, 0], ready.index(s), c_first, pred=first)
            # the absmax of 128 outputs, two rows of a_desc: at (output // 64, step * 64) of the transposed
            # copy's, or at (step * N / 64 + output // 64, 0) of it viewed as rows of 64
            if COLS:
                tma.async_copy_global_to_shared(a_desc, [wn // 64, wi * STEP], ready.index(s), a_bufs.index(s),
                                                pred=ahead)
            else:
                tma.async_copy_global_to_shared(a_desc, [wi * (N // 64) + wn // 64, 0], ready.index(s),
                                                a_bufs.index(s), pred=ahead)
            tma.async_copy_global_to_shared(a_desc, [off_n // 64, 0], ready.index(s), a_first, pred=first)
            h += 1


@gluon.jit
def _hold(a):
    """Nothing, reading a's registers here: they hold a at least to this point (an MMA's operand
    registers may not be written until a wait has seen it finish, a rule ptxas does not enforce)."""
    gl.inline_asm_elementwise("", "=r,0", [a], dtype=a.dtype, is_pure=False, pack=2)


@gluon.jit
def _ahead(c_buf, a_rows, at, read_l: gl.constexpr, words_l: gl.constexpr, am_l: gl.constexpr, COLS: gl.constexpr,
           ROW0: gl.constexpr):
    """A step's code words of the warpgroup's rows from c_buf, as (row, h, i): word 4 h + i, or with
    COLS as (row, h, t): the register of byte t of words 4 h .. 4 h + 3; and its absmax from
    a_rows.index(at): the thread's rows' (row, 1, 1, 1, 1), or with COLS its columns' (1, h, i, t, e)."""
    R: gl.constexpr = 64
    read = c_buf.slice(ROW0, R).load(read_l)
    am = a_rows.index(at).load(am_l)
    if COLS:
        words = gl.permute(gl.reshape(read, [R, 4, 2]), (0, 2, 1))
        am = gl.expand_dims(am, 0)
    else:
        words = gl.reshape(read, [R, 2, 4])
        am = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(am, 1), 2), 3), 4)
    return gl.convert_layout(words, words_l, assert_trivial=True), am


@gluon.jit
def _issue(acc, h, wn, am, x_bufs, c_bufs, a_bufs, ready, t, e, cb, read_l: gl.constexpr, words_l: gl.constexpr,
           am_l: gl.constexpr, a_l: gl.constexpr, LOOKUP: gl.constexpr, COLS: gl.constexpr, ROW0: gl.constexpr):
    """A step, its code words wn and absmax am read a step before: its slot waited for, the next
    step's read from it, its rows decoded into operand registers, its MMA issued -> (acc, the
    operand, the slot, the next step's words and absmax)."""
    S: gl.constexpr = x_bufs.type.shape[0]
    R: gl.constexpr = 64
    s = h % S
    mbarrier.wait(ready.index(s), (h // S) & 1)
    words = gl.expand_dims(gl.expand_dims(wn, 2 if COLS else 3), 4)
    wn, amc = _ahead(c_bufs.index(s), a_bufs, s * (a_bufs.type.shape[0] // S) + ROW0 // R, read_l, words_l, am_l,
                     COLS, ROW0)
    if LOOKUP == "":                # the decode left out (timing only)
        v = gl.broadcast(words + t + e, am)[0].to(x_bufs.dtype)     # am's dimensions: the lookup's shape
    else:
        v = gl.inline_asm_elementwise(LOOKUP, _LOOKUP_IO, [words, t, am, cb, e], dtype=x_bufs.dtype, is_pure=True,
                                      pack=8)
    a = gl.convert_layout(gl.reshape(v, [R, STEP]), a_l, assert_trivial=True)
    return warpgroup_mma(a, x_bufs.index(s).permute((1, 0)), acc, is_async=True), a, s, wn, amc


@gluon.jit
def _steps(acc, h, wn, amc, x_bufs, c_bufs, a_bufs, ready, empty, t, e, cb, read_l: gl.constexpr,
           words_l: gl.constexpr, am_l: gl.constexpr, a_l: gl.constexpr, LOOKUP: gl.constexpr, COLS: gl.constexpr,
           ROW0: gl.constexpr, U: gl.constexpr):
    """U steps of a warpgroup: each decoded while the MMA of the one before runs, its MMA issued
    before that one is waited for, the last waited for at the end; every step's operand registers
    held until the wait that sees its MMA finish. Each group ends waiting for its last MMA, so the
    longer the group the rarer that drain."""
    acc, a_prev, s_prev, wn, amc = _issue(acc, h, wn, amc, x_bufs, c_bufs, a_bufs, ready, t, e, cb, read_l, words_l,
                                          am_l, a_l, LOOKUP, COLS, ROW0)
    for u in gl.static_range(1, U):
        acc, a, s, wn, amc = _issue(acc, h + u, wn, amc, x_bufs, c_bufs, a_bufs, ready, t, e, cb, read_l, words_l,
                                    am_l, a_l, LOOKUP, COLS, ROW0)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        _hold(a_prev)
        mbarrier.arrive(empty.index(s_prev))
        a_prev = a
        s_prev = s
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    _hold(a_prev)
    mbarrier.arrive(empty.index(s_prev))
    return acc, h + U, wn, amc


@gluon.jit
def _multiply(x_bufs, c_bufs, a_bufs, c_first, a_first, ready, empty, o_desc, o_buf, nf4cb, M, N, steps,
              GROUP: gl.constexpr, LOOKUP: gl.constexpr, COLS: gl.constexpr, U: gl.constexpr, ROW0: gl.constexpr):
    """A warpgroup: rows ROW0 .. ROW0 + 63 of every tile of the program, its steps U at a time."""
    BTc: gl.constexpr = x_bufs.type.shape[1]
    BFc: gl.constexpr = c_bufs.type.shape[1]
    R: gl.constexpr = 64
    gl.static_assert(gl.num_warps() == 4)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BTc, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
    # (row, h, i, t, e), column 32 h + 8 i + 2 t + e of the row's block, in word 4 h + i: the operand
    # layout's lanes and warps, its registers in another order (a conversion without moves)
    w5: gl.constexpr = gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 0, 1], [0, 0, 1, 0, 0], [0, 0, 2, 0, 0], [0, 1, 0, 0, 0], [8, 0, 0, 0, 0]],
        lane_bases=[[0, 0, 0, 1, 0], [0, 0, 0, 2, 0], [1, 0, 0, 0, 0], [2, 0, 0, 0, 0], [4, 0, 0, 0, 0]],
        warp_bases=[[16, 0, 0, 0, 0], [32, 0, 0, 0, 0]], block_bases=[], shape=[R, 2, 4, 4, 2])
    w4: gl.constexpr = gl.SliceLayout(4, w5)
    # a step's words (`_ahead`): W's rows whole in each of a row's 4 lanes, (row, 8 words) read as
    # (row, h, i); the transposed copy's 16 bytes of a thread's two rows, (row, 2 t + h) read as (row, h, t)
    if COLS:
        words_l: gl.constexpr = gl.SliceLayout(2, w4)
        read_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [8, 0]], lane_bases=[[0, 2], [0, 4], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[R, 8])
    else:
        words_l: gl.constexpr = gl.SliceLayout(3, w4)
        read_l: gl.constexpr = gl.DistributedLinearLayout(
            reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]], lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
            warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[R, 8])
    # a step's absmax: a column's (COLS), (h, i, t, e); else a row's, (row,)
    am_l: gl.constexpr = gl.SliceLayout(0, w5) if COLS else gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, w4)))
    t = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(
        0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, w4)))), 0), 1), 2), 4)   # (1, 1, 1, 4, 1)
    e = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.arange(
        0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, gl.SliceLayout(0, w5))))), 0), 0), 0), 0)
    r = gl.expand_dims(gl.expand_dims(gl.expand_dims(gl.expand_dims(ROW0 + gl.arange(
        0, R, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, w4)))), 1), 2), 3), 4)  # (R, 1, 1, 1, 1)
    # lane l = t + 4 (row % 8) holds codebook entry l % 16
    cb = gl.load(nf4cb + t + 4 * (r % 4))
    # the program's first step's words and absmax come with its first slot
    mbarrier.wait(ready.index(0), 0)
    wn, amc = _ahead(c_first, a_first, ROW0 // R, read_l, words_l, am_l, COLS, ROW0)
    h = 0
    for tile in range(gl.program_id(0), gl.cdiv(M, BTc) * gl.cdiv(N, BFc), gl.num_programs(0)):
        off_m, off_n = _tile(tile, M, N, BTc, BFc, GROUP)
        acc = gl.zeros((R, BTc), dtype=gl.float32, layout=acc_l)
        for i in range(steps % U):          # the steps short of a whole group, one at a time
            acc, h, wn, amc = _steps(acc, h, wn, amc, x_bufs, c_bufs, a_bufs, ready, empty, t, e, cb, read_l, words_l,
                                     am_l, a_l, LOOKUP, COLS, ROW0, 1)
        for i in range(steps // U):
            acc, h, wn, amc = _steps(acc, h, wn, amc, x_bufs, c_bufs, a_bufs, ready, empty, t, e, cb, read_l, words_l,
                                     am_l, a_l, LOOKUP, COLS, ROW0, U)
        # the tile transposed through shared memory, stored by TMA while the next tile runs
        tma.store_wait(0)
        o_buf.store(gl.permute(acc.to(o_buf.dtype), (1, 0)))
        fence_async_shared()
        tma.async_copy_shared_to_global(o_desc, [off_m, off_n + ROW0], o_buf)
    tma.store_wait(0)


@gluon.jit
def _nf4_rs_kernel(x_desc, c_desc, a_desc, o_desc, nf4cb, M, N, steps, GROUP: gl.constexpr, S: gl.constexpr,
                   LOOKUP: gl.constexpr, COLS: gl.constexpr, U: gl.constexpr):
    """y = x @ W^T (with COLS: W the transposed copy, its absmax a column), the absmax from a_desc; a
    program walks the tiles pid, pid + programs, ..., its steps numbered across them."""
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [S] + x_desc.block_type.shape, x_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [S] + c_desc.block_type.shape, c_desc.layout)
    c_first = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    a_first = gl.allocate_shared_memory(a_desc.dtype, a_desc.block_type.shape, a_desc.layout)
    # the MMA partitions read each warpgroup's 64 absmax (of each slot) as a row of blocks (h, i, t, e)
    # or as rows: the whole buffers reinterpreted, then indexed (Triton reinterprets no view)
    A: gl.constexpr = a_desc.block_type.shape[0]          # 64 absmax each, a warpgroup's
    if COLS:
        a_rows = a_bufs._reinterpret(gl.float32, [S * A, 2, 4, 4, 2], _COLUMNS)
        a_rows_first = a_first._reinterpret(gl.float32, [A, 2, 4, 4, 2], _COLUMNS)
    else:
        a_rows = a_bufs._reinterpret(gl.float32, [S * A, 64], _ROWS)
        a_rows_first = a_first._reinterpret(gl.float32, [A, 64], _ROWS)
    o_bufs = gl.allocate_shared_memory(o_desc.dtype, [2] + o_desc.block_type.shape, o_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)            # both warpgroups read a slot
    gl.warp_specialize([
        (_multiply, (x_bufs, c_bufs, a_rows, c_first, a_rows_first, ready, empty, o_desc, o_bufs.index(0), nf4cb, M,
                     N, steps, GROUP, LOOKUP, COLS, U, 0)),
        (_multiply, (x_bufs, c_bufs, a_rows, c_first, a_rows_first, ready, empty, o_desc, o_bufs.index(1), nf4cb, M,
                     N, steps, GROUP, LOOKUP, COLS, U, 64)),
        (_loads, (x_desc, c_desc, a_desc, x_bufs, c_bufs, a_bufs, c_first, a_first, ready, empty, M, N, steps, GROUP,
                  COLS)),
    ], [4, 1], [240, 24] if COLS else [232, 40])     # at 240: input gradient 1%-1.5% faster, forward ~0.6% slower


def supported(x: torch.Tensor, packed, trans: bool = False) -> bool:
    """Whether the kernel takes x @ W^T (x @ W with `trans`): where `nf4_ws` takes it (a Hopper GPU,
    FP16/BF16, whole NF4 blocks in every row, TMA-aligned rows of x, at least a wave of the same
    256 x 128 tiles) and the packed copy has its transposed copy (`DevicePacked.codes_t`: both
    dimensions whole blocks), whose absmax both directions read."""
    return packed.codes_t is not None and nf4_ws.supported(x, packed, trans)


def specialization(x, words, out, absmax_t, trans, stages=4, in_flight=8, skip=False):
    """TMA descriptors of x (M, K), the (N, K / 8) int32 code words, the transposed copy's (K_W / 64,
    N_W) FP32 absmax (W's shape; `trans`: the input gradient's, whose columns run along N) and y
    (M, N); the kernel's compile-time constants and its launch options: a ring `stages` deep, steps
    `in_flight` a group, and `skip` (timing only, wrong values) leaves the decode out. Host tensors
    give what a compile-only report needs."""
    dt = _GL[x.dtype]
    x_desc = TensorDescriptor.from_tensor(x, [BT, 64], layout((BT, 64), dt))
    c_desc = TensorDescriptor.from_tensor(words, [BF, 8], layout((BF, 8), gl.int32))
    o_desc = TensorDescriptor.from_tensor(out, [BT, 64], layout((BT, 64), dt))
    a_desc = TensorDescriptor.from_tensor(absmax_t if trans else absmax_t.view(-1, 64), [BF // 64, 64], _PLAIN)
    const = dict(GROUP=GROUP_M, S=stages, LOOKUP="" if skip else _shuffle_lookup_asm(_CVT[x.dtype], trans),
                 COLS=trans, U=in_flight)
    # 4 + 4 + 1 warps, the loader's padded to 4: 12 warps' registers at launch, then the kernel's split
    options = dict(num_warps=4, maxnreg=65536 // (32 * 12) // 8 * 8, enable_fp_fusion=False)
    return x_desc, c_desc, a_desc, o_desc, const, options


def nf4_rs_matmul(x, packed, trans=False, programs=MULTIPROCESSORS, **tiles):
    """x (M, K) @ W^T (x (M, N) @ W with `trans`, through the transposed copy) in x's dtype
    (`tiles`: `specialization`'s), with `programs` programs, each walking every programs-th tile
    (None: one a tile; the same bits)."""
    N, K = packed.shape
    if trans:
        N, K = K, N
    M = x.shape[0]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    words = (packed.codes_t if trans else packed.codes).view(torch.int32).view(N, K // 8)
    x_desc, c_desc, a_desc, o_desc, const, options = specialization(x, words, out, packed.absmax_t, trans, **tiles)
    count = -(-M // BT) * -(-N // BF)
    _nf4_rs_kernel[(min(count, programs or count),)](
        x_desc, c_desc, a_desc, o_desc, packed.nf4_codebook, M, N, K // STEP, **const, **options)
    return out

"""SwiGLU inside the feed-forward's GEMMs (Gluon, Hopper): no pass reads a product back.

    forward   y = [gate | up] = a @ [W_gate; W_up]^T  (M, 2F),  h = silu(gate) * up  (M, F)
    backward  dh = g @ W  (M, F), never stored;  [dgate | dup]  (M, 2F) from dh, gate and up

The separate path writes y (forward) or dh (backward) and the SwiGLU kernel reads it again (at
Llama-3.2-1B's MLP 268 MB and 134 MB a layer). Here a persistent program (one a multiprocessor)
walks tiles of 128 tokens x 128 features with four partitions:

    MMA x2    4 warps each  64 rows of the tile, one step's MMAs in flight (FP32 accumulation);
                            the products rounded to y's dtype left in shared memory
    load      1 warp        a TMA ring of the activation's and the weights' tiles
    epilogue  4 warps       a tile behind the MMAs: forward, gate and up stored by TMA, then h
                            from them; backward, dgate and dup from dh and the tile's gate and
                            up (loaded by TMA as soon as the tile before is done), stored

so the tensor cores start the next tile while the epilogue works. The SwiGLU is `layer.swiglu`'s
arithmetic (FP32, one rounding an output; its correctly rounded division as `rcp.rn`, the same
bits): h and [dgate | dup] are the SwiGLU kernel's of the GEMM's bits. Each output is summed by
one program in ascending steps, so the same inputs give the same bits on every run; at every shape
measured they were cuBLAS's (Llama-3.2-1B's and Llama-3.1-8B's MLP, `benchmarks/mlp_epilogue.py`).
`supported()` says where it applies; the reference is the GEMM followed by `layer.swiglu`.
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .nf4 import MULTIPROCESSORS, hopper
from .nf4_ws import _GL, _tile, layout

BM = 128            # tokens a tile: two warpgroups of 64 rows
BN = 128            # features a tile (gate's and up's each in the forward)
FORWARD = (32, 6)   # (reduced elements a step, ring depth): measured at Llama-3.2-1B's MLP (H100)
BACKWARD = (64, 4)
GROUP = 8           # token tiles walking the same weight tiles


@gluon.jit
def _sigmoid(a):
    """1 / (1 + exp(-a)) correctly rounded: `layer._swiglu_kernel`'s IEEE division, the same bits."""
    return gl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [1.0 + gl.exp(-a)], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _loads(a_desc, w_desc, w2_desc, a_bufs, w_bufs, ready, empty, M, F, K, FWD: gl.constexpr, GROUP: gl.constexpr):
    """The loader warp: a ring of the activation's (BM, BK) tiles and the weights' (forward: gate's
    and up's (BN, BK) tiles; backward: a (BK, BN) tile)."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BMc: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    if FWD:
        BNc: gl.constexpr = w_desc.block_type.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * w_desc.block_type.nbytes
    else:
        BNc: gl.constexpr = w_desc.block_type.shape[1]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + w_desc.block_type.nbytes
    steps = gl.cdiv(K, BK)
    h = 0
    for tile in range(gl.program_id(0), gl.cdiv(M, BMc) * gl.cdiv(F, BNc), gl.num_programs(0)):
        off_m, off_n = _tile(tile, M, F, BMc, BNc, GROUP)
        for i in range(steps):
            s = h % S
            mbarrier.wait(empty.index(s), ((h // S) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(s), a_bufs.index(s))
            if FWD:
                tma.async_copy_global_to_shared(w_desc, [off_n, i * BK], ready.index(s), w_bufs.index(2 * s))
                tma.async_copy_global_to_shared(w2_desc, [off_n, i * BK], ready.index(s), w_bufs.index(2 * s + 1))
            else:
                tma.async_copy_global_to_shared(w_desc, [i * BK, off_n], ready.index(s), w_bufs.index(s))
            h += 1


@gluon.jit
def _multiply(a_bufs, w_bufs, s_bufs, ready, empty, s_ready, s_empty, M, F, K, gate_steps, up_first,
              FWD: gl.constexpr, ROW0: gl.constexpr):
    """A warpgroup: rows ROW0 .. ROW0 + 63 of each tile, one step's MMAs left in flight; its
    products rounded into the staging buffers (forward: gate's and up's) for the epilogue. The
    forward multiplies gate's weight in steps [0, gate_steps) and up's in [up_first, steps): the
    others hold its zeros alone (`lora._paired`)."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BMc: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BNc: gl.constexpr = s_bufs.type.shape[2]
    R: gl.constexpr = 64
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BNc, 16])
    steps = gl.cdiv(K, BK)
    h = 0
    j = 0
    for tile in range(gl.program_id(0), gl.cdiv(M, BMc) * gl.cdiv(F, BNc), gl.num_programs(0)):
        acc = gl.zeros((R, BNc), dtype=gl.float32, layout=acc_l)
        acc2 = gl.zeros((R, BNc), dtype=gl.float32, layout=acc_l)
        for i in range(steps):
            s = h % S
            mbarrier.wait(ready.index(s), (h // S) & 1)
            a = a_bufs.index(s).slice(ROW0, R)
            if FWD:
                wg, wu = w_bufs.index(2 * s).permute((1, 0)), w_bufs.index(2 * s + 1).permute((1, 0))
                if i < gate_steps:
                    if i >= up_first:
                        acc = warpgroup_mma(a, wg, acc, is_async=True)
                        acc2 = warpgroup_mma(a, wu, acc2, is_async=True)
                        acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
                    else:
                        acc = warpgroup_mma(a, wg, acc, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
                else:
                    acc2 = warpgroup_mma(a, wu, acc2, is_async=True)
                    acc2 = warpgroup_mma_wait(num_outstanding=1, deps=(acc2,))
            else:
                acc = warpgroup_mma(a, w_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if i > 0:
                mbarrier.arrive(empty.index((h - 1) % S))
            h += 1
        if FWD:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((h - 1) % S))
        mbarrier.wait(s_empty.index(0), (j & 1) ^ 1)
        s_bufs.index(0).slice(ROW0, R).store(acc.to(s_bufs.dtype))
        if FWD:
            s_bufs.index(1).slice(ROW0, R).store(acc2.to(s_bufs.dtype))
        fence_async_shared()
        mbarrier.arrive(s_ready.index(0))
        j += 1


@gluon.jit
def _gate_up(gate_desc, up_desc, e_bufs, e_ready, tile, tiles, M, F, BMc: gl.constexpr, BNc: gl.constexpr,
             GROUP: gl.constexpr):
    """TMA of the tile's gate and up into e_bufs (none past the last tile)."""
    off_m, off_n = _tile(tile, M, F, BMc, BNc, GROUP)
    mbarrier.expect(e_ready.index(0), 2 * gate_desc.block_type.nbytes, pred=tile < tiles)
    tma.async_copy_global_to_shared(gate_desc, [off_m, off_n], e_ready.index(0), e_bufs.index(0), pred=tile < tiles)
    tma.async_copy_global_to_shared(up_desc, [off_m, off_n], e_ready.index(0), e_bufs.index(1), pred=tile < tiles)


@gluon.jit
def _epilogue(s_bufs, e_bufs, s_ready, s_empty, e_ready, gate_desc, up_desc, h_desc, dgate, dup, d_rows, M, F,
              FWD: gl.constexpr, GROUP: gl.constexpr):
    """The epilogue warps, a tile behind the MMAs. Forward: the staged gate and up stored, then
    h = silu(gate) * up computed into gate's buffer once its store has read it, and stored.
    Backward: dgate and dup from the staged dh and the tile's gate and up, stored from registers
    (rows d_rows apart); the next tile's gate and up loaded as soon as these are read."""
    BMc: gl.constexpr = s_bufs.type.shape[1]
    BNc: gl.constexpr = s_bufs.type.shape[2]
    W: gl.constexpr = gl.num_warps()
    C: gl.constexpr = 4 * W if FWD else 2 * W           # rows a chunk
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
    tiles = gl.cdiv(M, BMc) * gl.cdiv(F, BNc)
    if not FWD:                                         # the first tile's gate and up
        _gate_up(gate_desc, up_desc, e_bufs, e_ready, gl.program_id(0), tiles, M, F, BMc, BNc, GROUP)
    j = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        off_m, off_n = _tile(tile, M, F, BMc, BNc, GROUP)
        mbarrier.wait(s_ready.index(0), j & 1)
        if FWD:
            tma.async_copy_shared_to_global(gate_desc, [off_m, off_n], s_bufs.index(0))
            tma.async_copy_shared_to_global(up_desc, [off_m, off_n], s_bufs.index(1))
            tma.store_wait(1)                           # gate's store has read its buffer
            for c in gl.static_range(BMc // C):
                a = s_bufs.index(0).slice(c * C, C).load(blk).to(gl.float32)
                b = s_bufs.index(1).slice(c * C, C).load(blk).to(gl.float32)
                s_bufs.index(0).slice(c * C, C).store((a * _sigmoid(a) * b).to(s_bufs.dtype))
            fence_async_shared()
            tma.async_copy_shared_to_global(h_desc, [off_m, off_n], s_bufs.index(0))
            tma.store_wait(0)
            mbarrier.arrive(s_empty.index(0))
        else:
            mbarrier.wait(e_ready.index(0), j & 1)
            rows = off_m + gl.arange(0, C, layout=gl.SliceLayout(1, blk))
            cols = off_n + gl.arange(0, BNc, layout=gl.SliceLayout(0, blk))
            for c in gl.static_range(BMc // C):
                dy = s_bufs.index(0).slice(c * C, C).load(blk).to(gl.float32)
                a = e_bufs.index(0).slice(c * C, C).load(blk).to(gl.float32)
                b = e_bufs.index(1).slice(c * C, C).load(blk).to(gl.float32)
                sg = _sigmoid(a)
                at = (c * C + rows).to(gl.int64)[:, None] * d_rows + cols[None, :]
                mask = ((c * C + rows) < M)[:, None] & (cols < F)[None, :]
                gl.store(dgate + at, (dy * b * sg * (1.0 + a * (1.0 - sg))).to(dgate.dtype.element_ty), mask=mask)
                gl.store(dup + at, (dy * a * sg).to(dup.dtype.element_ty), mask=mask)
            mbarrier.arrive(s_empty.index(0))
            fence_async_shared()                        # the reads above before the next tile's TMA
            _gate_up(gate_desc, up_desc, e_bufs, e_ready, tile + gl.num_programs(0), tiles, M, F, BMc, BNc, GROUP)
        j += 1


@gluon.jit
def _kernel(a_desc, w_desc, w2_desc, gate_desc, up_desc, h_desc, dgate, dup, d_rows, M, F, K, gate_steps, up_first,
            FWD: gl.constexpr, S: gl.constexpr, GROUP: gl.constexpr):
    """Forward (FWD): gate = a @ W_gate^T, up = a @ W_up^T (w_desc, w2_desc: (F, K) each) stored, and
    h. Backward: dh = a @ W (w_desc: (K, F)) and from it, gate and up, dgate and dup. Two MMA
    warpgroups, a loader warp, four epilogue warps (13 warps)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [2 * S if FWD else S] + w_desc.block_type.shape, w_desc.layout)
    s_bufs = gl.allocate_shared_memory(gate_desc.dtype, [2 if FWD else 1] + gate_desc.block_type.shape,
                                       gate_desc.layout)
    if FWD:
        e_bufs = s_bufs                                 # not used
    else:
        e_bufs = gl.allocate_shared_memory(gate_desc.dtype, [2] + gate_desc.block_type.shape, gate_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    s_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    s_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    e_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)          # both warpgroups read a slot
    mbarrier.init(s_ready.index(0), count=2)
    mbarrier.init(s_empty.index(0), count=1)
    mbarrier.init(e_ready.index(0), count=1)
    gl.warp_specialize([
        (_multiply, (a_bufs, w_bufs, s_bufs, ready, empty, s_ready, s_empty, M, F, K, gate_steps, up_first, FWD,
                      0)),
        (_multiply, (a_bufs, w_bufs, s_bufs, ready, empty, s_ready, s_empty, M, F, K, gate_steps, up_first, FWD,
                      64)),
        (_loads, (a_desc, w_desc, w2_desc, a_bufs, w_bufs, ready, empty, M, F, K, FWD, GROUP)),
        (_epilogue, (s_bufs, e_bufs, s_ready, s_empty, e_ready, gate_desc, up_desc, h_desc, dgate, dup, d_rows, M,
                     F, FWD, GROUP)),
    ], [4, 1, 4], [192, 40, 80])


def supported(a: torch.Tensor, *ts: torch.Tensor) -> bool:
    """Whether the kernels take these operands: a Hopper GPU, FP16/BF16 throughout, every row of
    unit-stride columns at a 16-byte aligned address and stride (TMA's terms)."""
    return (hopper(a.device) and a.dtype in _GL
            and all(t.dtype == a.dtype and t.device == a.device and t.stride(-1) == 1
                    and t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 for t in (a, *ts)))


def _desc(t: torch.Tensor, block: tuple) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, list(block), layout(block, _GL[t.dtype]))


def _grid(M: int, F: int) -> tuple:
    return (min(MULTIPROCESSORS, -(-M // BM) * -(-F // BN)),)


def gated_forward(a: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, gate_cols: int | None = None,
                  up_first: int = 0, tiles=FORWARD, group=GROUP) -> tuple[torch.Tensor, ...]:
    """(gate, up, h): gate = a @ w_gate^T and up = a @ w_up^T (M, F) in a's dtype, each rounded
    once from FP32, side by side in one (M, 2F) buffer, and h = silu(gate) * up (M, F), for a (M, K)
    and the weights (F, K) (`supported`). Where w_gate's columns from gate_cols on and w_up's
    before up_first are zeros, the steps that hold them alone are left out (the same bits);
    `tiles` (reduced elements a step, ring depth) and `group` for benchmarks."""
    M, K = a.shape
    F = w_gate.shape[0]
    gate, up = torch.empty(M, 2 * F, device=a.device, dtype=a.dtype).split(F, 1)
    h = torch.empty(M, F, device=a.device, dtype=a.dtype)
    bk, stages = tiles
    gate_steps = -(-(K if gate_cols is None else gate_cols) // bk)
    assert gate_steps > up_first // bk          # every step multiplies one of them
    _kernel[_grid(M, F)](_desc(a, (BM, bk)), _desc(w_gate, (BN, bk)), _desc(w_up, (BN, bk)), _desc(gate, (BM, BN)),
                         _desc(up, (BM, BN)), _desc(h, (BM, BN)), h, h, 0, M, F, K, gate_steps, up_first // bk,
                         FWD=True, S=stages, GROUP=group, num_warps=4, maxnreg=128)
    return gate, up, h


def gated_backward(g: torch.Tensor, w: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, tiles=BACKWARD,
                   group=GROUP) -> tuple[torch.Tensor, ...]:
    """(dgate, dup): the SwiGLU's backward of dh = g @ w (g (M, K), w (K, F); dh rounded to g's dtype
    as a GEMM's output is) for gate and up (M, F), side by side in one (M, 2F) buffer (`supported`);
    `tiles` and `group` as `gated_forward`'s."""
    M, K = g.shape
    F = w.shape[1]
    dgate, dup = torch.empty(M, 2 * F, device=g.device, dtype=g.dtype).split(F, 1)
    bk, stages = tiles
    w_desc, gate_desc = _desc(w, (bk, BN)), _desc(gate, (BM, BN))
    _kernel[_grid(M, F)](_desc(g, (BM, bk)), w_desc, w_desc, gate_desc, _desc(up, (BM, BN)), gate_desc, dgate, dup,
                         dgate.stride(0), M, F, K, 0, 0, FWD=False, S=stages, GROUP=group, num_warps=4, maxnreg=128)
    return dgate, dup

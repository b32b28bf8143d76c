"""SwiGLU inside the MLP's GEMMs, at Llama-3.2-1B's shapes (8 x 1024 tokens, hidden 2048 and 48
columns of an adapter's joined BF16 parts, intermediate 8192) or Llama-3.1-8B's (4096, 14336): can
a GEMM whose epilogue applies SwiGLU beat cuBLAS's GEMM followed by the package's SwiGLU kernel?

    forward   y = [x | u] @ [W_gate; W_up]^T  (M, 2F), h = silu(gate) * up
    backward  dh = [g | du] @ [W_down | A]    (M, F), dgate, dup from dh, gate and up

The separate path writes y (forward) or dh (backward) and the SwiGLU pass reads it again: 268 MB
and 134 MB a layer at these shapes. Timed here: cuBLAS alone and with the SwiGLU kernel; Triton
GEMMs (persistent, TMA descriptors) alone; and a Gluon kernel (Hopper) of two MMA warpgroups (64
tokens of a 128-token tile each, one step's MMAs in flight), a TMA loader warp and four epilogue
warps that work a tile behind the MMAs: the MMA warps leave their products rounded to BF16 in
shared memory and start the next tile, the epilogue warps store them (forward: gate and up, then
h computed from them; backward: dh, or dgate and dup from dh and the tile's gate and up, which
they load themselves). Every product is checked against cuBLAS's (the largest difference; 0: the
same bits) and every SwiGLU against the package's kernel over the same inputs. GPU time of
back-to-back calls under CUDA graphs, the variants in turn (`joint_gemms.timed`).

    python benchmarks/mlp_epilogue.py OUT.json [llama-3.2-1b | llama-3.1-8b | smoke]
                                          (smoke: small shapes, the checks alone)
"""
import json
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from joint_gemms import timed
from aner.kernels.layer import _swiglu_launch
from aner.kernels.nf4 import MULTIPROCESSORS
from aner.kernels.nf4_ws import _tile, layout


@triton.jit
def _forward_kernel(x_desc, w_desc, y_desc, M, F, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    STAGES: tl.constexpr):
    """Persistent: for each (BM, BN) tile of gate's columns, gate's and up's products over K (two
    accumulators over one activation tile), stored rounded to BF16 at y's columns j and F + j."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(F, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=True):
        m = (tile % tiles_m) * BM
        n = (tile // tiles_m) * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES):
            a = x_desc.load([m, k])
            acc_g = tl.dot(a, w_desc.load([n, k]).T, acc_g)
            acc_u = tl.dot(a, w_desc.load([F + n, k]).T, acc_u)
        y_desc.store([m, n], acc_g.to(tl.bfloat16))
        y_desc.store([m, F + n], acc_u.to(tl.bfloat16))


@triton.jit
def _backward_kernel(g_desc, w_desc, dh_desc, M, F, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr, WS: tl.constexpr):
    """For each (BM, BN) tile of dh = g @ w (w (K, F)), stored rounded to BF16 (persistent where the
    grid is smaller than the tiles); WS: the K loop warp-specialized by Triton."""
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(F, BN)
    for tile in tl.range(tl.program_id(0), tiles_m * tiles_n, tl.num_programs(0), flatten=not WS):
        m = (tile % tiles_m) * BM
        n = (tile // tiles_m) * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in tl.range(0, K, BK, num_stages=STAGES, warp_specialize=WS):
            acc = tl.dot(g_desc.load([m, k]), w_desc.load([k, n]), acc)
        dh_desc.store([m, n], acc.to(tl.bfloat16))


@gluon.jit
def _sigmoid(a):
    """1 / (1 + exp(-a)) correctly rounded (the package's SwiGLU kernel's IEEE division of 1 by it:
    the same bits), by the reciprocal's own instruction."""
    return gl.inline_asm_elementwise("rcp.rn.f32 $0, $1;", "=f,f", [1.0 + gl.exp(-a)], dtype=gl.float32,
                                     is_pure=True, pack=1)


@gluon.jit
def _g_loads(a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, F, K, FORWARD: gl.constexpr, GROUP: gl.constexpr):
    """The loader warp: a ring of the activation's (BM, BK) tiles and the weight's (forward: gate's
    and up's (BN, BK) tiles of rows j and F + j; backward: a (BK, BN) tile of columns j)."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    if FORWARD:
        BN: gl.constexpr = b_desc.block_type.shape[0]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    else:
        BN: gl.constexpr = b_desc.block_type.shape[1]
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    steps = gl.cdiv(K, BK)
    h = 0
    for tile in range(gl.program_id(0), gl.cdiv(M, BM) * gl.cdiv(F, BN), gl.num_programs(0)):
        off_m, off_n = _tile(tile, M, F, BM, BN, GROUP)
        for i in range(steps):
            s = h % S
            mbarrier.wait(empty.index(s), ((h // S) & 1) ^ 1)
            mbarrier.expect(ready.index(s), nbytes)
            tma.async_copy_global_to_shared(a_desc, [off_m, i * BK], ready.index(s), a_bufs.index(s))
            if FORWARD:
                tma.async_copy_global_to_shared(b_desc, [off_n, i * BK], ready.index(s), b_bufs.index(2 * s))
                tma.async_copy_global_to_shared(b_desc, [F + off_n, i * BK], ready.index(s), b_bufs.index(2 * s + 1))
            else:
                tma.async_copy_global_to_shared(b_desc, [i * BK, off_n], ready.index(s), b_bufs.index(s))
            h += 1


@gluon.jit
def _g_multiply(a_bufs, b_bufs, s_bufs, ready, empty, s_ready, s_empty, M, F, K, FORWARD: gl.constexpr,
                ROW0: gl.constexpr):
    """A warpgroup: rows ROW0 .. ROW0 + 63 of each tile, one step's MMAs left in flight; its
    products rounded to BF16 into the staging buffers (forward: gate's and up's), for the epilogue
    warps, so that the next tile's MMAs start at once."""
    S: gl.constexpr = a_bufs.type.shape[0]
    BM: gl.constexpr = a_bufs.type.shape[1]
    BK: gl.constexpr = a_bufs.type.shape[2]
    BN: gl.constexpr = s_bufs.type.shape[2]
    R: gl.constexpr = 64
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    steps = gl.cdiv(K, BK)
    h = 0
    j = 0
    for tile in range(gl.program_id(0), gl.cdiv(M, BM) * gl.cdiv(F, BN), gl.num_programs(0)):
        acc = gl.zeros((R, BN), dtype=gl.float32, layout=acc_l)
        acc2 = gl.zeros((R, BN), dtype=gl.float32, layout=acc_l)
        for i in range(steps):
            s = h % S
            mbarrier.wait(ready.index(s), (h // S) & 1)
            a = a_bufs.index(s).slice(ROW0, R)
            if FORWARD:
                acc = warpgroup_mma(a, b_bufs.index(2 * s).permute((1, 0)), acc, is_async=True)
                acc2 = warpgroup_mma(a, b_bufs.index(2 * s + 1).permute((1, 0)), acc2, is_async=True)
                acc, acc2 = warpgroup_mma_wait(num_outstanding=2, deps=(acc, acc2))
            else:
                acc = warpgroup_mma(a, b_bufs.index(s), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
            if i > 0:
                mbarrier.arrive(empty.index((h - 1) % S))
            h += 1
        if FORWARD:
            acc, acc2 = warpgroup_mma_wait(num_outstanding=0, deps=(acc, acc2))
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index((h - 1) % S))
        mbarrier.wait(s_empty.index(0), (j & 1) ^ 1)
        s_bufs.index(0).slice(ROW0, R).store(acc.to(gl.bfloat16))
        if FORWARD:
            s_bufs.index(1).slice(ROW0, R).store(acc2.to(gl.bfloat16))
        fence_async_shared()
        mbarrier.arrive(s_ready.index(0))
        j += 1


@gluon.jit
def _g_gate_up(y_desc, e_bufs, e_ready, tile, tiles, M, F, BM: gl.constexpr, BN: gl.constexpr, GROUP: gl.constexpr):
    """TMA of tile's gate and up tiles into e_bufs (none past the last tile)."""
    off_m, off_n = _tile(tile, M, F, BM, BN, GROUP)
    mbarrier.expect(e_ready.index(0), 2 * y_desc.block_type.nbytes, pred=tile < tiles)
    tma.async_copy_global_to_shared(y_desc, [off_m, off_n], e_ready.index(0), e_bufs.index(0), pred=tile < tiles)
    tma.async_copy_global_to_shared(y_desc, [off_m, F + off_n], e_ready.index(0), e_bufs.index(1), pred=tile < tiles)


@gluon.jit
def _g_epilogue(s_bufs, e_bufs, s_ready, s_empty, e_ready, y_desc, o_desc, out, out_rows, M, F,
                FORWARD: gl.constexpr, SWIGLU: gl.constexpr, GROUP: gl.constexpr):
    """The epilogue warps, a tile behind the MMAs. Forward: the staged gate and up stored at columns
    j and F + j of y, and with SWIGLU h = silu(gate) * up computed into gate's buffer once its store
    has read it, stored into o. Backward: SWIGLU 0 stores dh into o; 1 and 3 make dgate and dup
    from it and the tile's gate and up (loaded here, the next tile's as soon as these are free) and
    write them at o's columns j and F + j: 1 over gate's and up's buffers, stored by TMA, 3 from
    registers (out, rows out_rows apart; whole tiles only, as the probe's shapes are); 2 (timing
    only) stores gate and up back unchanged."""
    BM: gl.constexpr = s_bufs.type.shape[1]
    BN: gl.constexpr = s_bufs.type.shape[2]
    W: gl.constexpr = gl.num_warps()
    C: gl.constexpr = 4 * W if FORWARD else 2 * W       # rows a chunk
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
    tiles = gl.cdiv(M, BM) * gl.cdiv(F, BN)
    if SWIGLU and not FORWARD:                          # the first tile's gate and up
        _g_gate_up(y_desc, e_bufs, e_ready, gl.program_id(0), tiles, M, F, BM, BN, GROUP)
    j = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        off_m, off_n = _tile(tile, M, F, BM, BN, GROUP)
        mbarrier.wait(s_ready.index(0), j & 1)
        if FORWARD:
            tma.async_copy_shared_to_global(y_desc, [off_m, off_n], s_bufs.index(0))
            tma.async_copy_shared_to_global(y_desc, [off_m, F + off_n], s_bufs.index(1))
            if SWIGLU:
                tma.store_wait(1)                       # gate's store has read its buffer
                for c in gl.static_range(BM // C):
                    ga = s_bufs.index(0).slice(c * C, C).load(blk).to(gl.float32)
                    ub = s_bufs.index(1).slice(c * C, C).load(blk).to(gl.float32)
                    s_bufs.index(0).slice(c * C, C).store((ga * _sigmoid(ga) * ub).to(gl.bfloat16))
                fence_async_shared()
                tma.async_copy_shared_to_global(o_desc, [off_m, off_n], s_bufs.index(0))
            tma.store_wait(0)
            mbarrier.arrive(s_empty.index(0))
        elif SWIGLU == 2:
            mbarrier.wait(e_ready.index(0), j & 1)
            mbarrier.arrive(s_empty.index(0))
            tma.async_copy_shared_to_global(o_desc, [off_m, off_n], e_bufs.index(0))
            tma.async_copy_shared_to_global(o_desc, [off_m, F + off_n], e_bufs.index(1))
            tma.store_wait(0)
            _g_gate_up(y_desc, e_bufs, e_ready, tile + gl.num_programs(0), tiles, M, F, BM, BN, GROUP)
        elif SWIGLU == 3:
            mbarrier.wait(e_ready.index(0), j & 1)
            rows = gl.arange(0, C, layout=gl.SliceLayout(1, blk))
            cols = gl.arange(0, BN, layout=gl.SliceLayout(0, blk))
            for c in gl.static_range(BM // C):
                dy = s_bufs.index(0).slice(c * C, C).load(blk).to(gl.float32)
                ga = e_bufs.index(0).slice(c * C, C).load(blk).to(gl.float32)
                ub = e_bufs.index(1).slice(c * C, C).load(blk).to(gl.float32)
                sg = _sigmoid(ga)
                at = out + (off_m + c * C + rows).to(gl.int64)[:, None] * out_rows + (off_n + cols)[None, :]
                gl.store(at, (dy * ub * sg * (1.0 + ga * (1.0 - sg))).to(gl.bfloat16))
                gl.store(at + F, (dy * ga * sg).to(gl.bfloat16))
            mbarrier.arrive(s_empty.index(0))
            fence_async_shared()                        # the reads above before the next tile's TMA
            _g_gate_up(y_desc, e_bufs, e_ready, tile + gl.num_programs(0), tiles, M, F, BM, BN, GROUP)
        elif SWIGLU:
            mbarrier.wait(e_ready.index(0), j & 1)
            for c in gl.static_range(BM // C):
                dy = s_bufs.index(0).slice(c * C, C).load(blk).to(gl.float32)
                ga = e_bufs.index(0).slice(c * C, C).load(blk).to(gl.float32)
                ub = e_bufs.index(1).slice(c * C, C).load(blk).to(gl.float32)
                sg = _sigmoid(ga)
                e_bufs.index(0).slice(c * C, C).store((dy * ub * sg * (1.0 + ga * (1.0 - sg))).to(gl.bfloat16))
                e_bufs.index(1).slice(c * C, C).store((dy * ga * sg).to(gl.bfloat16))
            mbarrier.arrive(s_empty.index(0))
            fence_async_shared()
            tma.async_copy_shared_to_global(o_desc, [off_m, off_n], e_bufs.index(0))
            tma.async_copy_shared_to_global(o_desc, [off_m, F + off_n], e_bufs.index(1))
            tma.store_wait(0)
            _g_gate_up(y_desc, e_bufs, e_ready, tile + gl.num_programs(0), tiles, M, F, BM, BN, GROUP)
        else:
            tma.async_copy_shared_to_global(o_desc, [off_m, off_n], s_bufs.index(0))
            tma.store_wait(0)
            mbarrier.arrive(s_empty.index(0))
        j += 1


@gluon.jit
def _g_kernel(a_desc, b_desc, y_desc, o_desc, out, out_rows, M, F, K, FORWARD: gl.constexpr, SWIGLU: gl.constexpr,
              GROUP: gl.constexpr, S: gl.constexpr):
    """Forward: y = a @ [W_gate; W_up]^T (b: the weight (2F, K)), with SWIGLU o = h; backward:
    o = dh = a @ b (b (K, F)), or with SWIGLU o = [dgate | dup] from it and y's gate and up
    (`_g_epilogue`'s modes). Two MMA warpgroups, a loader warp, four epilogue warps (13 warps; a
    warp-specialized program takes at most 16, so eight epilogue warps do not launch)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [S] + a_desc.block_type.shape, a_desc.layout)
    if FORWARD:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [2 * S] + b_desc.block_type.shape, b_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [S] + b_desc.block_type.shape, b_desc.layout)
    s_bufs = gl.allocate_shared_memory(o_desc.dtype, [2 if FORWARD else 1] + o_desc.block_type.shape, o_desc.layout)
    if SWIGLU and not FORWARD:
        e_bufs = gl.allocate_shared_memory(y_desc.dtype, [2] + y_desc.block_type.shape, y_desc.layout)
    else:
        e_bufs = s_bufs                                 # not used
    ready = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [S, 1], mbarrier.MBarrierLayout())
    s_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    s_empty = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    e_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(S):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)            # both warpgroups read a slot
    mbarrier.init(s_ready.index(0), count=2)
    mbarrier.init(s_empty.index(0), count=1)
    mbarrier.init(e_ready.index(0), count=1)
    gl.warp_specialize([
        (_g_multiply, (a_bufs, b_bufs, s_bufs, ready, empty, s_ready, s_empty, M, F, K, FORWARD, 0)),
        (_g_multiply, (a_bufs, b_bufs, s_bufs, ready, empty, s_ready, s_empty, M, F, K, FORWARD, 64)),
        (_g_loads, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, M, F, K, FORWARD, GROUP)),
        (_g_epilogue, (s_bufs, e_bufs, s_ready, s_empty, e_ready, y_desc, o_desc, out, out_rows, M, F, FORWARD,
                       SWIGLU, GROUP)),
    ], [4, 1, 4], [192, 40, 80])


def gluon_forward(x, w, y, h, swiglu, bn=128, stages=6, bk=32, group=8):
    """Gluon's forward: tiles of 128 tokens x (bn gate + bn up features), steps of bk."""
    M, K = x.shape
    F = w.shape[0] // 2
    bf = gl.bfloat16
    a_desc = GluonDescriptor.from_tensor(x, [128, bk], layout((128, bk), bf))
    b_desc = GluonDescriptor.from_tensor(w, [bn, bk], layout((bn, bk), bf))
    y_desc = GluonDescriptor.from_tensor(y, [128, bn], layout((128, bn), bf))
    o_desc = GluonDescriptor.from_tensor(h, [128, bn], layout((128, bn), bf))
    grid = (min(MULTIPROCESSORS, triton.cdiv(M, 128) * triton.cdiv(F, bn)),)
    return lambda: _g_kernel[grid](a_desc, b_desc, y_desc, o_desc, h, h.stride(0), M, F, K, FORWARD=True,
                                   SWIGLU=swiglu, GROUP=group, S=stages, num_warps=4, maxnreg=128)


def gluon_backward(g, w, dh, y, d, swiglu, bn=128, stages=4, bk=64, group=8):
    """Gluon's backward: dh = g @ w in tiles of 128 tokens x bn, steps of bk; with swiglu d = [dgate | dup]."""
    M, K = g.shape
    F = w.shape[1]
    bf = gl.bfloat16
    a_desc = GluonDescriptor.from_tensor(g, [128, bk], layout((128, bk), bf))
    b_desc = GluonDescriptor.from_tensor(w, [bk, bn], layout((bk, bn), bf))
    y_desc = GluonDescriptor.from_tensor(y, [128, bn], layout((128, bn), bf))
    out = d if swiglu else dh
    o_desc = GluonDescriptor.from_tensor(out, [128, bn], layout((128, bn), bf))
    grid = (min(MULTIPROCESSORS, triton.cdiv(M, 128) * triton.cdiv(F, bn)),)
    return lambda: _g_kernel[grid](a_desc, b_desc, y_desc, o_desc, out, out.stride(0), M, F, K, FORWARD=False,
                                   SWIGLU=swiglu, GROUP=group, S=stages, num_warps=4, maxnreg=128)


def triton_forward(x, w, y, bm, bn, bk, stages, warps):
    """Triton's forward GEMM (gate's and up's columns of a tile together), one program a multiprocessor."""
    M, K = x.shape
    F = w.shape[0] // 2
    descs = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]),
             TensorDescriptor.from_tensor(y, [bm, bn]))
    grid = (min(MULTIPROCESSORS, triton.cdiv(M, bm) * triton.cdiv(F, bn)),)
    return lambda: _forward_kernel[grid](*descs, M, F, K, BM=bm, BN=bn, BK=bk, STAGES=stages, num_warps=warps)


def triton_backward(g, w, dh, bm, bn, bk, stages, warps, persistent, ws):
    """Triton's backward GEMM: persistent or one program a tile, its K loop warp-specialized or not."""
    M, K = g.shape
    F = w.shape[1]
    descs = (TensorDescriptor.from_tensor(g, [bm, bk]), TensorDescriptor.from_tensor(w, [bk, bn]),
             TensorDescriptor.from_tensor(dh, [bm, bn]))
    tiles = triton.cdiv(M, bm) * triton.cdiv(F, bn)
    grid = (min(MULTIPROCESSORS, tiles) if persistent else tiles,)
    return lambda: _backward_kernel[grid](*descs, M, F, K, BM=bm, BN=bn, BK=bk, STAGES=stages, WS=bool(ws),
                                          num_warps=warps)


# Triton's tiles (BM, BN, BK, stages, warps): the forward's; the backward's GEMM also (persistent, warp-specialized)
TILES = [(128, 128, 64, 3, 8)]
GEMMS = [(128, 256, 64, 3, 8, 1, 0), (128, 128, 64, 4, 8, 1, 0)]
# Gluon's (bn, stages, bk): the forward's (bn: gate's and up's columns each), the backward's
GLUON_FORWARD = [(128, 6, 32)]
GLUON_BACKWARD = [(128, 4, 64)]


SHAPES = {"llama-3.2-1b": (8192, 2048, 8192, 48), "llama-3.1-8b": (8192, 4096, 14336, 48),
          "smoke": (1024, 512, 1024, 48)}       # (tokens, hidden, intermediate, joined columns)


def main(path, shape="llama-3.2-1b"):
    torch.manual_seed(0)
    M, D, F, J = SHAPES[shape]
    smoke = shape == "smoke"
    dev, bf = "cuda", torch.bfloat16
    x = torch.randn(M, D + J, device=dev, dtype=bf)
    w = torch.randn(2 * F, D + J, device=dev, dtype=bf) * 0.02
    gd = torch.randn(M, D + J, device=dev, dtype=bf) * 0.01
    wd = torch.randn(D + J, F, device=dev, dtype=bf) * 0.02
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "model": shape, "shapes": dict(M=M, D=D, F=F, joined=J)}

    # The separate path: cuBLAS, then the package's SwiGLU kernel.
    y_ref, h_ref = torch.empty(M, 2 * F, device=dev, dtype=bf), torch.empty(M, F, device=dev, dtype=bf)
    dh_ref, d_ref = torch.empty(M, F, device=dev, dtype=bf), torch.empty(M, 2 * F, device=dev, dtype=bf)

    def cublas_forward():
        torch.mm(x, w.T, out=y_ref)

    def separate_forward():
        torch.mm(x, w.T, out=y_ref)
        _swiglu_launch(y_ref[:, :F], y_ref[:, F:], h_ref, h_ref, h_ref, backward=False)

    def cublas_backward():
        torch.mm(gd, wd, out=dh_ref)

    def separate_backward():
        torch.mm(gd, wd, out=dh_ref)
        _swiglu_launch(y_ref[:, :F], y_ref[:, F:], dh_ref, d_ref[:, :F], d_ref[:, F:], backward=True)

    separate_forward()
    separate_backward()
    torch.cuda.synchronize()

    # Each variant's outputs against the separate path's: the GEMM's (max difference; 0 = its
    # bits) and the SwiGLU's, which must be its bits wherever the GEMM's are.
    y, h = torch.empty_like(y_ref), torch.empty_like(h_ref)
    dh, d = torch.empty_like(dh_ref), torch.empty_like(d_ref)
    runs, checks = {}, {}

    def differs(a, b):
        return (a.float() - b.float()).abs().max().item()

    def add(name, fn, check):
        try:
            for t in (y, h, dh, d):
                t.zero_()
            fn()
            torch.cuda.synchronize()
            checks[name] = check()
            runs[name] = fn
        except Exception as e:                      # a variant that does not compile or fit: recorded
            checks[name] = repr(e)[:400]

    for tile in TILES:
        add("triton forward " + "x".join(map(str, tile)), triton_forward(x, w, y, *tile), lambda: differs(y, y_ref))
    for tile in GEMMS:
        add("triton backward " + "x".join(map(str, tile)), triton_backward(gd, wd, dh, *tile),
            lambda: differs(dh, dh_ref))
    for v in GLUON_FORWARD:
        name = "x".join(map(str, v))
        add(f"gluon forward {name}", gluon_forward(x, w, y, h, False, *v), lambda: differs(y, y_ref))
        add(f"gluon forward+swiglu {name}", gluon_forward(x, w, y, h, True, *v),
            lambda: dict(y=differs(y, y_ref), h=differs(h, h_ref)))
    for group in (4, 16):
        add(f"gluon backward+swiglu 128x4x64 group {group}", gluon_backward(gd, wd, dh, y_ref, d, True, group=group),
            lambda: differs(d, d_ref))
    add("gluon backward+copy 128x4x64 (timing only)", gluon_backward(gd, wd, dh, y_ref, d, 2), lambda: None)
    add("gluon backward+swiglu stored from registers 128x4x64", gluon_backward(gd, wd, dh, y_ref, d, 3),
        lambda: differs(d, d_ref))
    for v in GLUON_BACKWARD:
        name = "x".join(map(str, v))
        add(f"gluon backward {name}", gluon_backward(gd, wd, dh, y_ref, d, False, *v), lambda: differs(dh, dh_ref))
        add(f"gluon backward+swiglu {name}", gluon_backward(gd, wd, dh, y_ref, d, True, *v),
            lambda: differs(d, d_ref))
    out["checks"] = checks
    print(json.dumps(checks, indent=1), flush=True)
    if smoke:
        return
    out["us"] = timed({"separate forward": separate_forward, "cublas forward": cublas_forward,
                       "separate backward": separate_backward, "cublas backward": cublas_backward, **runs})
    print(json.dumps(out["us"], indent=1), flush=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])

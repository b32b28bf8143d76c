"""A warp-specialized fused NF4 product for Hopper (Gluon), measured against the package's kernels.

The package's fused NF4 kernels (`aner.kernels.nf4`) decode a weight tile and multiply it in the
same warps, so the decode's instructions and the tensor cores take turns. Here each program
splits its warps into two partitions that run side by side and hand tiles over through rings of
shared memory guarded by mbarriers:

    decode   DW warps    a TMA ring of the packed code words -> absmax -> the weight tile in
                         BF16/FP16, stored in shared memory for the MMA (w_ready / w_empty)
    default  BM/32 warps a TMA ring of the activation tiles, warpgroup MMAs (FP32 accumulation)
                         over the reduced steps, then the output tile

    forward      y (M, N) = x (M, K) @ W^T   weight tile (128 rows, 64 columns) a step, operand B^T
    input grad  dx (M, K) = g (M, N) @ W     weight tile (64 rows, 128 columns) a step, operand B

The decode is `nf4._TABLE_*` (the per-block table of the 16 rounded products): the operand bits
are `NF4Weight.dequantize()` rounded to the operand dtype; each output is summed by one program
in ascending steps, no atomics. Needs sm_90, FP16/BF16, K % 64 == 0, and N % 8 == 0 backward.
Correct and deterministic, but no faster than the package's kernels (NOTES, nineteenth session),
so it is not in the package. `SKIP` replaces the decode by a conversion of the code words (wrong
values, same traffic and handoffs): the time of everything but the decode.

    python benchmarks/nf4_ws.py results/<date>-h200-nf4-ws.json     (GPU machine, ~90 s)
"""
import json
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from aner.kernels import nf4 as K
from aner.kernels.nf4 import _TABLE_BF16, _TABLE_F16, _TABLE_IO
from aner.quant.nf4 import NF4Weight

BO = 128            # output features a tile
STEP = 64           # reduced elements a step: one NF4 block of a row forward, 64 rows backward
GROUP_M = 8


@gluon.jit
def _load_a(a_desc, a_bufs, a_ready, off_m, i, pred):
    """TMA of the activation tile of step i into its slot (a no-op where not pred)."""
    s = i % a_bufs.type.shape[0]
    mbarrier.expect(a_ready.index(s), a_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(a_desc, [off_m, i * a_desc.block_type.shape[1]], a_ready.index(s),
                                    a_bufs.index(s), pred=pred)


@gluon.jit
def _load_codes(c_desc, c_bufs, c_ready, off_o, i, pred, TRANS: gl.constexpr):
    """TMA of the code words of step i's weight tile into its slot (a no-op where not pred)."""
    R: gl.constexpr = c_desc.block_type.shape[0]
    G: gl.constexpr = c_desc.block_type.shape[1]
    s = i % c_bufs.type.shape[0]
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
def _decode(c_desc, c_bufs, w_bufs, c_ready, w_ready, w_empty, absmax, acodes, ascales, aoffset, dyncb,
            off_o, N, K, steps, TRANS: gl.constexpr, DQ: gl.constexpr, SKIP: gl.constexpr):
    """The decode partition: code words (its own TMA ring) + absmax -> weight tiles in shared memory."""
    CS: gl.constexpr = c_bufs.type.shape[0]
    WS: gl.constexpr = w_bufs.type.shape[0]
    R: gl.constexpr = c_bufs.type.shape[1]          # weight rows a step
    G: gl.constexpr = c_bufs.type.shape[2]          # NF4 blocks of a row a step (64 columns each)
    NW: gl.constexpr = gl.num_warps()
    S: gl.constexpr = NW * 32 // (R * G)            # threads a block: each takes 8 / S of its words
    words_layout: gl.constexpr = gl.BlockedLayout([1, 1, 8 // S], [32 // (G * S), G, S], [NW, 1, 1], [2, 1, 0])
    blocks_layout: gl.constexpr = gl.SliceLayout(2, words_layout)
    KB = K // 64
    r = gl.arange(0, R, layout=gl.SliceLayout(1, blocks_layout))
    g = gl.arange(0, G, layout=gl.SliceLayout(0, blocks_layout))
    for s in gl.static_range(CS):
        _load_codes(c_desc, c_bufs, c_ready, off_o, s, s < steps, TRANS)
    for i in range(steps):
        if TRANS:
            rows = i * R + r
            grps = off_o // 64 + g
        else:
            rows = off_o + r
            grps = i * G + g
        mask = (rows < N)[:, None] & (grps < KB)[None, :]
        blk = rows.to(gl.int64)[:, None] * KB + grps[None, :]
        am = _absmax(blk, mask, absmax, acodes, ascales, aoffset, dyncb, DQ)[:, :, None]
        mbarrier.wait(c_ready.index(i % CS), (i // CS) & 1)
        words = c_bufs.index(i % CS).load(words_layout)                    # (R, G, 8 // S) int32
        gl.thread_barrier()                         # every thread has read the slot: refill it
        fence_async_shared()
        _load_codes(c_desc, c_bufs, c_ready, off_o, i + CS, i + CS < steps, TRANS)
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
        mbarrier.wait(w_empty.index(i % WS), ((i // WS) & 1) ^ 1)
        w_bufs.index(i % WS).store(w)
        fence_async_shared()
        mbarrier.arrive(w_ready.index(i % WS))


@gluon.jit
def _multiply(a_desc, a_bufs, w_bufs, a_ready, w_ready, w_empty, out, M, O, off_m, off_o, steps,
              BOc: gl.constexpr, TRANS: gl.constexpr, num_warps: gl.constexpr):
    """The MMA partition: its own TMA ring of activation tiles, the decoded weight tiles, the output."""
    BMc: gl.constexpr = a_bufs.type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BOc, 16])
    AS: gl.constexpr = a_bufs.type.shape[0]
    WS: gl.constexpr = w_bufs.type.shape[0]
    for s in gl.static_range(AS):
        _load_a(a_desc, a_bufs, a_ready, off_m, s, s < steps)
    acc = gl.zeros((BMc, BOc), dtype=gl.float32, layout=layout)
    for i in range(steps):
        mbarrier.wait(a_ready.index(i % AS), (i // AS) & 1)
        mbarrier.wait(w_ready.index(i % WS), (i // WS) & 1)
        if TRANS:
            b = w_bufs.index(i % WS)
        else:
            b = w_bufs.index(i % WS).permute((1, 0))
        acc = warpgroup_mma(a_bufs.index(i % AS), b, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        # the MMA of step i - 1 is done: its activation slot takes step i - 1 + AS, its weight slot is free
        _load_a(a_desc, a_bufs, a_ready, off_m, i - 1 + AS, (i > 0) & (i - 1 + AS < steps))
        mbarrier.arrive(w_empty.index((i + WS - 1) % WS), pred=i > 0)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    rows = off_m + gl.arange(0, BMc, layout=gl.SliceLayout(1, layout))
    cols = off_o + gl.arange(0, BOc, layout=gl.SliceLayout(0, layout))
    mask = (rows < M)[:, None] & (cols < O)[None, :]
    gl.store(out + rows.to(gl.int64)[:, None] * O + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)


@gluon.jit
def _nf4_ws_kernel(a_desc, c_desc, out, absmax, acodes, ascales, aoffset, dyncb, M, N, K, O, steps,
                   W_LAYOUT: gl.constexpr, W_ROWS: gl.constexpr, W_COLS: gl.constexpr, TRANS: gl.constexpr,
                   DQ: gl.constexpr, GROUP: gl.constexpr, AS: gl.constexpr, WS: gl.constexpr, CS: gl.constexpr,
                   DW: gl.constexpr, DREGS: gl.constexpr, SKIP: gl.constexpr, num_warps: gl.constexpr):
    """out (M, O) = a (M, reduced) @ (W^T forward, W with TRANS); a program per (BM, BO) tile."""
    BMc: gl.constexpr = a_desc.block_type.shape[0]
    BOc: gl.constexpr = W_COLS if TRANS else W_ROWS
    pid = gl.program_id(0)
    m_tiles = gl.cdiv(M, BMc)
    per_group = GROUP * gl.cdiv(O, BOc)
    first_m = (pid // per_group) * GROUP
    size_m = gl.minimum(m_tiles - first_m, GROUP)
    off_m = (first_m + (pid % per_group) % size_m) * BMc
    off_o = ((pid % per_group) // size_m) * BOc

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
        (_multiply, (a_desc, a_bufs, w_bufs, a_ready, w_ready, w_empty, out, M, O, off_m, off_o, steps,
                     BOc, TRANS, num_warps)),
        (_decode, (c_desc, c_bufs, w_bufs, c_ready, w_ready, w_empty, absmax, acodes, ascales, aoffset,
                   dyncb, off_o, N, K, steps, TRANS, DQ, SKIP)),
    ], [DW], [DREGS])


_GL = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def nf4_ws_matmul(a, packed, trans, bm, dw, dregs, stages, skip=False):
    """a (M, K) @ W^T, or with `trans` a (M, N) @ W, in a's dtype: bm tokens a tile (32 a warp of
    the MMA partition), dw decode warps at dregs registers, (activation, weight, code) ring depths."""
    N, Kin = packed.shape
    M = a.shape[0]
    O = Kin if trans else N
    out = torch.empty(M, O, device=a.device, dtype=a.dtype)
    dt = _GL[a.dtype]
    a_desc = TensorDescriptor.from_tensor(a, [bm, STEP], gl.NVMMASharedLayout.get_default_for([bm, STEP], dt))
    rows, grps = (STEP, BO // 64) if trans else (BO, 1)
    words = packed.codes.view(torch.int32).view(N, Kin // 64, 8)
    c_desc = TensorDescriptor.from_tensor(words, [rows, grps, 8],
                                          gl.NVMMASharedLayout.get_default_for([rows, grps, 8], gl.int32))
    w_layout = gl.NVMMASharedLayout.get_default_for([rows, grps * 64], dt)
    steps = -(-N // STEP) if trans else Kin // STEP
    warps = bm // 32
    _, absmax, acodes, ascales, aoffset, _, dyncb = packed._args()
    _nf4_ws_kernel[(-(-M // bm) * -(-O // BO),)](
        a_desc, c_desc, out, absmax, acodes, ascales, aoffset, dyncb, M, N, Kin, O, steps,
        W_LAYOUT=w_layout, W_ROWS=rows, W_COLS=grps * 64, TRANS=trans, DQ=packed.double_quant, GROUP=GROUP_M,
        AS=stages[0], WS=stages[1], CS=stages[2], DW=dw, DREGS=dregs, SKIP=skip, num_warps=warps,
        maxnreg=65536 // (32 * (warps + dw)) // 8 * 8, enable_fp_fusion=False)
    return out


# (bm, decode warps, their registers, ring depths, skip the decode)
VARIANTS = [(256, 4, 152, (4, 4, 8), False), (256, 8, 88, (3, 4, 8), False), (128, 8, 128, (4, 4, 8), False),
            (256, 4, 152, (4, 4, 8), True), (256, 8, 88, (3, 4, 8), True)]
PROBLEMS = [(4096, 4096, 2048), (4096, 4096, 8192), (8192, 2048, 8192), (2048, 8192, 8192)]   # N, K, tokens


def run_variant(v):
    bm, dw, dregs, stages, skip = VARIANTS[v]
    kw = dict(bm=bm, dw=dw, dregs=dregs, stages=stages, skip=skip)
    torch.manual_seed(0)

    def packed(N, Kin):
        w = NF4Weight.quantize(torch.randn(N, Kin) * 0.02, double_quant=True)
        return K.DevicePacked.from_weight(w, "cuda"), w.dequantize().to("cuda", torch.float64)

    row = {"bm": bm, "decode_warps": dw, "decode_registers": dregs, "stages": stages, "skip_decode": skip,
           "checks": {}, "problems": []}
    if not skip:        # against float64 (BF16 bound of tests/test_kernels.py), and twice the same bits
        for N, Kin, M in [(1000, 576, 300), (4096, 4096, 2048)]:
            p, Wd = packed(N, Kin)
            x, g = torch.randn(M, Kin, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
            for trans, a, want, scale in [(False, x, x.double() @ Wd.t(), x.double().abs() @ Wd.abs().t()),
                                          (True, g, g.double() @ Wd, g.double().abs() @ Wd.abs())]:
                y = nf4_ws_matmul(a, p, trans, **kw)
                ok = bool(((y.double() - want).abs() <= 1e-2 * scale).all()) \
                    and torch.equal(y, nf4_ws_matmul(a, p, trans, **kw))
                row["checks"][f"{N}x{Kin}x{M}{'-input-grad' if trans else ''}"] = ok
    bench = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3
    for N, Kin, M in PROBLEMS:
        p, Wd = packed(N, Kin)
        wd = Wd.bfloat16()
        x, g = torch.randn(M, Kin, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
        t = {"dense": bench(lambda: x @ wd.t()), "dense_t": bench(lambda: g @ wd),
             "package": bench(lambda: K.nf4_matmul(x, p)), "package_t": bench(lambda: K.nf4_matmul_t(g, p)),
             "ws": bench(lambda: nf4_ws_matmul(x, p, False, **kw)), "ws_t": bench(lambda: nf4_ws_matmul(g, p, True, **kw))}
        row["problems"].append({"N": N, "K": Kin, "tokens": M, "us": t,
                                "package_vs_dense": [t["package"] / t["dense"], t["package_t"] / t["dense_t"]],
                                "ws_vs_dense": [t["ws"] / t["dense"], t["ws_t"] / t["dense_t"]]})
        print(VARIANTS[v], f"N{N} K{Kin} M{M}: package {t['package'] / t['dense']:.2f}x/{t['package_t'] / t['dense_t']:.2f}x"
              f" ws {t['ws'] / t['dense']:.2f}x/{t['ws_t'] / t['dense_t']:.2f}x (forward/input gradient vs dense)",
              file=sys.stderr, flush=True)
    return row


def main():
    if sys.argv[1] == "--variant":
        print(json.dumps(run_variant(int(sys.argv[2]))))
        return
    rows = []
    for v in range(len(VARIANTS)):      # one process each: a variant that hangs is cut and recorded
        try:
            done = subprocess.run([sys.executable, __file__, "--variant", str(v)], capture_output=True, text=True,
                                  timeout=120)
            sys.stderr.write(done.stderr[-2000:])
            rows.append(json.loads(done.stdout) if done.returncode == 0 else {"variant": VARIANTS[v], "error": done.stderr[-500:]})
        except subprocess.TimeoutExpired:
            rows.append({"variant": VARIANTS[v], "error": "timed out after 120 s"})
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "variants": rows}, f, indent=1)


if __name__ == "__main__":
    main()

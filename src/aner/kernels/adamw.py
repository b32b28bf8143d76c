"""AdamW over a list of FP32 tensors in one launch (Triton): the arithmetic of torch's fused
AdamW kernel, with the gradients only read.

`torch._fused_adamw_` given a `grad_scale` (the clipping divisor) writes every gradient back
divided: 4 bytes an element more than the 28 the update needs (read parameter, gradient and two
moments, write parameter and moments). This kernel reads the divisor as torch's does and writes
nothing else. Per element, in FP32 as torch's CUDA kernel computes it (the hyperparameters
rounded to FP32 first; fma rounds once, every other operation rounds its result, division and
square root IEEE):

    g  = g / divisor
    p  = fma(-(lr * wd), p, p)                              (only when wd != 0)
    m  = fma(b1, m, fma(-b1, g, g))                         (b1 m + (1 - b1) g)
    v  = fma(b2, v, fma(-b2, g*g, g*g))
    p  = p - (s * m) / (sqrt(v) / r2 + eps)

where s = lr / (1 - b1^t) and r2 = sqrt(1 - b2^t) come from torch's own pow, division and square
root on the device (`_corrections`, once an update). The tests compare every bit against
`torch._fused_adamw_` on the GPU. The tensors are found through a table of their offsets from
one base pointer: program i updates chunk i, CHUNK elements of the tensor that a map of chunks
to table rows names (made once per list of sizes). Each element sees the same operations
whatever the list, its order or its slicing; no atomics, no reduction.

A parameter may come with its cast, a FP16/BF16 tensor of its shape that the kernel writes with
the updated parameter rounded to nearest even (the bits of `p.to(dtype)`): the operand that the
next forward would otherwise make by reading the parameter again.

`squares` is the clipping norm's pass over the same kind of list (`train.optim.sum_of_squares`):
every FP32 gradient element squared and summed in float64, each chunk by one program's fixed tree
and the chunks' sums by one reduction of fixed shape, so the same list gives the same bits. Over
Llama-3.2-1B's 1.24G gradients on the H200 it reads 3.8 TB/s (1.30 ms), where torch's float64
multi-tensor norm read 3.2 (1.56 ms; `benchmarks/adamw.py`).
"""
import functools
import struct

import numpy as np
import torch
import triton
import triton.language as tl

from .launch import after_prior, launch_options

CHUNK = 4096        # elements a program updates (16 a thread: four 16-byte loads of each tensor)
COLUMNS = 7         # a table row: parameter, gradient, m, v offsets from the base; numel; first chunk;
                    # the cast's offset from the cast base (-1: none)


@triton.jit
def _adamw_kernel(base, cast_base, table, chunks, corrections, divisor, b1, b2, eps, lw,
                  DIVIDE: tl.constexpr, DECAY: tl.constexpr, CAST: tl.constexpr, ALIGNED: tl.constexpr,
                  COLUMNS: tl.constexpr, CHUNK: tl.constexpr):
    """Program i: chunk i, CHUNK elements of the tensor in row chunks[i] of the table. `base` is
    an FP32 pointer, `cast_base` one of the casts' dtype; a row's offsets (in elements, from
    them) locate its tensors. ALIGNED: every offset and numel is a multiple of 4 (16-byte loads).
    `corrections`: the update's s and r2; lw = lr * wd, FP32."""
    after_prior()
    pid = tl.program_id(0)
    row = table + tl.load(chunks + pid).to(tl.int64) * COLUMNS
    p_off, g_off = tl.load(row), tl.load(row + 1)
    m_off, v_off, numel = tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
    if ALIGNED:
        p_off, g_off = tl.multiple_of(p_off, 4), tl.multiple_of(g_off, 4)
        m_off, v_off, numel = tl.multiple_of(m_off, 4), tl.multiple_of(v_off, 4), tl.multiple_of(numel, 4)
    start = (pid - tl.load(row + 5)).to(tl.int64) * CHUNK
    step_size, root2 = tl.load(corrections), tl.load(corrections + 1)
    by = tl.load(divisor)

    offs = start + tl.arange(0, CHUNK)
    inside = offs < numel
    p = tl.load(base + p_off + offs, mask=inside)
    g = tl.load(base + g_off + offs, mask=inside)
    m = tl.load(base + m_off + offs, mask=inside)
    v = tl.load(base + v_off + offs, mask=inside)
    if DIVIDE:
        g = tl.div_rn(g, by)
    if DECAY:
        p = tl.fma(-lw, p, p)
    m = tl.fma(b1, m, tl.fma(-b1, g, g))
    gg = g * g
    v = tl.fma(b2, v, tl.fma(-b2, gg, gg))
    p = p - tl.div_rn(step_size * m, tl.div_rn(tl.sqrt_rn(v), root2) + eps)
    tl.store(base + p_off + offs, p, mask=inside)
    if CAST:
        c_off = tl.load(row + 6)
        if c_off >= 0:
            if ALIGNED:
                c_off = tl.multiple_of(c_off, 4)
            tl.store(cast_base + c_off + offs, p.to(cast_base.dtype.element_ty), mask=inside)
    tl.store(base + m_off + offs, m, mask=inside)
    tl.store(base + v_off + offs, v, mask=inside)


def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _corrections(hyper: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """[s, r2] (FP32) of update `step` by torch's own pow, division and square root on its
    device, as its fused kernel makes them: s = lr / (1 - b1^t), r2 = sqrt(1 - b2^t), from
    `hyper` = (beta1, beta2, lr) in float64 there, rounded to FP32."""
    b1, b2, lr = hyper.float()
    c = 1 - torch.pow(torch.stack([b1, b2]), step)
    return torch.stack([lr / c[0], c[1].sqrt()])


@functools.lru_cache(maxsize=16)
def _chunk_rows(numels: tuple, device, chunk: int = CHUNK) -> torch.Tensor:
    """(chunks,) int32 on `device`: the table row of each chunk of tensors of these sizes."""
    counts = [triton.cdiv(n, chunk) for n in numels]
    return torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32),
                                   torch.tensor(counts)).to(device)


def adamw_(params, grads, exp_avgs, exp_avg_sqs, step, *, lr, beta1, beta2, weight_decay, eps,
           divisor=None, casts=None) -> None:
    """One AdamW update in place of contiguous FP32 tensors on one CUDA device (lists of one
    length, each position one shape); `step` the update number and `divisor` (or None) 0-dim FP32
    tensors there. The gradients are read, never written. `casts` (or None): for each parameter
    None or a contiguous tensor of its shape in one FP16/BF16 dtype for all, written with the
    updated parameter's cast."""
    if not params:
        return
    casts = [None] * len(params) if casts is None else casts
    kept = [c for c in casts if c is not None]
    cast_base = min(kept, key=torch.Tensor.data_ptr) if kept else params[0]   # offsets >= 0
    start, cast_start = params[0].data_ptr(), cast_base.data_ptr()
    rows, first = [], 0
    for four, cast in zip(zip(params, grads, exp_avgs, exp_avg_sqs), casts):
        assert all(t.dtype == torch.float32 and t.is_contiguous() and t.shape == four[0].shape for t in four), \
            "a parameter, its gradient and moments must be contiguous FP32 tensors of one shape"
        assert cast is None or (cast.dtype == cast_base.dtype and cast.is_contiguous()
                                and cast.shape == four[0].shape), \
            "a cast must be a contiguous tensor of its parameter's shape, all casts of one dtype"
        if four[0].numel():
            cast_offset = -1 if cast is None else (cast.data_ptr() - cast_start) // cast.element_size()
            rows.append([(t.data_ptr() - start) // 4 for t in four] + [four[0].numel(), first, cast_offset])
            first += triton.cdiv(four[0].numel(), CHUNK)
    if not rows:
        return
    base = params[0]
    chunks = _chunk_rows(tuple(r[4] for r in rows), base.device)
    aligned = all(x % 4 == 0 for r in rows for x in r[:5] + r[6:] if x >= 0) and start % 16 == 0 \
        and cast_start % (4 * cast_base.element_size()) == 0
    # the rows, then (beta1, beta2, lr) as float64 bits: one copy to the device, from pinned
    # memory so that the host does not wait for the work queued before it
    table = torch.tensor(rows + [[_bits(beta1), _bits(beta2), _bits(lr)] + [0] * (COLUMNS - 3)], dtype=torch.int64)
    if base.is_cuda:
        table = table.pin_memory().to(base.device, non_blocking=True)
    corrections = _corrections(table[-1, :3].view(torch.float64), step)
    f32 = lambda x: float(np.float32(x))  # noqa: E731   the FP32 value torch's kernel uses
    _adamw_kernel[(first,)](base, cast_base, table, chunks, corrections,
                            corrections if divisor is None else divisor,
                            f32(beta1), f32(beta2), f32(eps), f32(np.float32(lr) * np.float32(weight_decay)),
                            DIVIDE=divisor is not None, DECAY=weight_decay != 0, CAST=bool(kept),
                            ALIGNED=aligned, COLUMNS=COLUMNS, CHUNK=CHUNK, num_warps=8, enable_fp_fusion=False,
                            **launch_options(base.device))


@triton.jit
def _squares_kernel(base, table, chunks, sums, ALIGNED: tl.constexpr, CHUNK: tl.constexpr):
    """Program i: the float64 sum of the squares of chunk i, CHUNK elements of the tensor in row
    chunks[i] of the table (its offset from the FP32 pointer `base`, numel, first chunk).
    ALIGNED: every offset and numel is a multiple of 4 (16-byte loads)."""
    after_prior()
    pid = tl.program_id(0)
    row = table + tl.load(chunks + pid).to(tl.int64) * 3
    offset, numel = tl.load(row), tl.load(row + 1)
    if ALIGNED:
        offset, numel = tl.multiple_of(offset, 4), tl.multiple_of(numel, 4)
    offs = (pid - tl.load(row + 2)).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    g = tl.load(base + offset + offs, mask=offs < numel, other=0.0).to(tl.float64)
    tl.store(sums + pid, tl.sum(g * g))


@functools.lru_cache(maxsize=1024)
def _dense(shape: tuple, stride: tuple) -> bool:
    """Whether a tensor of this shape and stride fills its span of memory with no gap
    (contiguous in some order of its dims)."""
    size = 1
    for step, n in sorted((st, n) for st, n in zip(stride, shape) if n > 1):
        if step != size:
            return False
        size *= n
    return True


@functools.lru_cache(maxsize=8)
def _squares_plan(layout: tuple, device, chunk: int):
    """(table on `device`, chunk map, aligned, index of the lowest tensor) for FP32 tensors
    at these (address, numel) pairs: each row the tensor's offset from the lowest address, its
    numel and its first chunk. A pure function of its arguments, so kept across updates."""
    low = min(range(len(layout)), key=lambda i: layout[i][0])
    rows, first = [], 0
    for address, numel in layout:
        rows.append([(address - layout[low][0]) // 4, numel, first])
        first += triton.cdiv(numel, chunk)
    table = torch.tensor(rows, dtype=torch.int64)
    if device.type == "cuda":     # from pinned memory: the host does not wait for the queued work
        table = table.pin_memory().to(device, non_blocking=True)
    aligned = layout[low][0] % 16 == 0 and all(x % 4 == 0 for r in rows for x in r[:2])
    return table, _chunk_rows(tuple(n for _, n in layout), device, chunk), aligned, low


def squares(tensors: list, chunk: int = 8192, warps: int = 8) -> torch.Tensor:
    """The sum of the squares of every element of FP32 tensors on one device, in float64, as a
    0-dim tensor there (no wait for the host). Each tensor is read in its memory order (a
    transposed view as it lies; one with gaps is copied first)."""
    assert tensors and all(t.dtype == torch.float32 and t.device == tensors[0].device for t in tensors), \
        "squares takes FP32 tensors on one device"
    device = tensors[0].device
    tensors = [t if _dense(t.shape, t.stride()) else t.contiguous() for t in tensors if t.numel()]
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    table, chunks, aligned, low = _squares_plan(tuple((t.data_ptr(), t.numel()) for t in tensors),
                                                       device, chunk)
    sums = torch.empty(chunks.numel(), dtype=torch.float64, device=device)
    _squares_kernel[(chunks.numel(),)](tensors[low], table, chunks, sums, ALIGNED=aligned, CHUNK=chunk, num_warps=warps,
                                       **launch_options(device))
    return sums.sum()

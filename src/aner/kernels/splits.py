"""The ordered sum of split-reduction parts, shared by the kernels that split a reduction."""
import torch
import triton
import triton.language as tl

from . import TARGET_PROGRAMS
from .fp32 import bf16_parts, scaled
from .launch import after_prior, launch_options


@triton.jit
def _sum_splits_kernel(part, out, numel, cols, out_plane, out_rows, out_cols, scale, joined, joined_rows, left, right,
                       SPLIT: tl.constexpr, BLOCK: tl.constexpr, PARTS: tl.constexpr, JOINED: tl.constexpr,
                       SCALED: tl.constexpr):
    """The sum over s = 0, 1, .. SPLIT - 1 of part[s] (FP32, always in that order), times `scale`
    when SCALED, written cast to out, or with PARTS as its BF16 parts (`store_parts`, into
    `joined` too when JOINED). part[s] holds rows of `cols` elements; out takes them out_rows
    apart and their elements out_cols apart (not 1: a transposed out, without PARTS)."""
    after_prior()
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    ptr = part + offs
    acc = tl.load(ptr, mask=mask, other=0.0)
    for _ in tl.static_range(1, SPLIT):
        # Step the pointer by numel per part: `s * numel` would be an int32 product, which wraps
        # once split * numel reaches 2^31 (an explicit config with a large split).
        ptr += numel
        acc += tl.load(ptr, mask=mask, other=0.0)
    if SCALED:
        acc = scaled(acc, scale)
    if PARTS:
        store_parts(acc, offs // cols, offs % cols, mask, out, out_plane, out_rows, joined, joined_rows, cols, left,
                    right, JOINED)
    else:
        tl.store(out + (offs // cols) * out_rows + (offs % cols) * out_cols, acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def store_parts(acc, row, col, mask, out, out_plane, out_rows, joined, joined_rows, cols, left, right,
                JOINED: tl.constexpr):
    """acc's BF16 parts hi, mid, lo (`fp32.bf16_parts`) at (row, col) of three planes of out,
    out_plane apart, rows out_rows apart and a unit column stride. JOINED: also at `row` of
    `joined` (joined_rows apart) as hi, mid, hi in three blocks of the columns' width, of `cols`
    columns those below `left` at 0 and the others at `right` (`kernels.lora`'s joined operand)."""
    hi, mid, lo = bf16_parts(acc)
    at = out + row * out_rows + col
    tl.store(at, hi, mask=mask)
    tl.store(at + out_plane, mid, mask=mask)
    tl.store(at + 2 * out_plane, lo, mask=mask)
    if JOINED:
        first = col < left
        width = tl.where(first, left, cols - left)
        at = joined + row * joined_rows + tl.where(first, col, right + col - left)
        tl.store(at, hi, mask=mask)
        tl.store(at + width, mid, mask=mask)
        tl.store(at + 2 * width, hi, mask=mask)


def joined_args(joined: tuple[torch.Tensor, int] | None, cols: int, placeholder: torch.Tensor) -> tuple:
    """`store_parts`'s (joined, joined_rows, left, right) for a sum of `cols` columns whose parts
    also go to `joined` (x', left) as `sum_splits` describes (without: `placeholder`, never written)."""
    if joined is None:
        return placeholder, 0, 0, 0
    wide, left = joined
    assert wide.dtype == torch.bfloat16 and wide.stride(1) == 1
    return wide, wide.stride(0), left, wide.shape[1] - 3 * (cols - left)


def sum_splits(part: torch.Tensor, out: torch.Tensor | None = None,
               parts: torch.Tensor | None = None, joined: tuple[torch.Tensor, int] | None = None,
               scale: float = 1.0) -> torch.Tensor:
    """part (S, ...) FP32 -> out (...) = part[0] + part[1] + ... in that order (FP32 sums), times
    `scale` if it is not 1 (FP32, the bits of torch's product of the sum and that float), cast to
    out's dtype (FP32 when no out is given: a single unscaled part is returned as it is); a 2-D
    out may have any strides (e.g. a transposed view). With `parts`
    ((3, ...) BF16; for a 2-D sum, planes whose rows may have any stride, e.g. columns of wider
    planes) the sum is written there instead, as its exact BF16 parts (`fp32.bf16_parts`), and
    parts is returned. With `joined` (x' BF16 (M, ...) with unit column stride, and `left`, for
    a 2-D sum with parts): each row's parts also go to x''s row as hi, mid, hi in blocks of their
    columns' width, the first `left` columns' at column 0 and the rest's at the end of x''s row."""
    if parts is not None:
        assert out is None and parts.dtype == torch.bfloat16 and parts.shape == (3, *part.shape[1:])
        out = parts
    elif out is None:
        if part.shape[0] == 1 and scale == 1.0:
            return part[0]
        out = torch.empty(part.shape[1:], device=part.device, dtype=torch.float32)
    # Each element's sum is a chain of loads and adds: blocks small enough for TARGET_PROGRAMS
    # programs where the output is small, e.g. a norm's weight gradient: 256 parts of 2048
    # took 23.4 us in 2 programs of 1024, 3.0 us in 64 of 32 (`benchmarks/norm_kernels.py`), the
    # same bits.
    numel, cols = part[0].numel(), part.shape[-1]
    plane = out[0] if parts is not None else out
    if plane.is_contiguous():
        rows, step = cols, 1
    else:
        assert plane.dim() == 2 and (parts is None or plane.stride(1) == 1)
        rows, step = plane.stride()
    assert joined is None or parts is not None
    if numel:
        block = min(1024, max(32, triton.next_power_of_2(triton.cdiv(numel, TARGET_PROGRAMS))))
        _sum_splits_kernel[(triton.cdiv(numel, block),)](
            part, out, numel, cols, out.stride(0) if parts is not None else 0, rows, step, scale,
            *joined_args(joined, cols, out), SPLIT=part.shape[0], BLOCK=block, PARTS=parts is not None,
            JOINED=joined is not None, SCALED=scale != 1.0, num_warps=max(1, min(4, block // 128)),
            enable_fp_fusion=False, **launch_options(part.device))
    return out

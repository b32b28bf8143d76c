"""The ordered sum of split-reduction parts, shared by the kernels that split a reduction."""
import torch
import triton
import triton.language as tl

from . import TARGET_PROGRAMS


@triton.jit
def _sum_splits_kernel(part, out, numel, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum over s = 0, 1, .. SPLIT - 1 of part[s] (FP32, always in that order), cast."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    ptr = part + offs
    acc = tl.load(ptr, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT):
        # Step the pointer by numel per part: `s * numel` would be an int32 product, which
        # wraps once split * M * out_cols reaches 2^31 (an explicit config with a large split).
        ptr += numel
        acc += tl.load(ptr, mask=mask, other=0.0)
    tl.store(out + offs, acc.to(out.dtype.element_ty), mask=mask)


def sum_splits(part: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """part (S, ...) FP32 -> out (...) = part[0] + part[1] + ... in that order (FP32 sums), cast
    to out's dtype (FP32 when no out is given: a single part is returned as it is)."""
    if out is None and part.shape[0] == 1:
        return part[0]
    if out is None:
        out = torch.empty(part.shape[1:], device=part.device, dtype=torch.float32)
    # Each element's sum is a chain of loads and adds: blocks small enough for TARGET_PROGRAMS
    # programs where the output is small, e.g. a norm's weight gradient: 256 parts of 2048
    # took 23.4 us in 2 programs of 1024, 3.0 us in 64 of 32 (`benchmarks/norm_kernels.py`), the
    # same bits.
    numel = out.numel()
    if numel:
        block = min(1024, max(32, triton.next_power_of_2(triton.cdiv(numel, TARGET_PROGRAMS))))
        _sum_splits_kernel[(triton.cdiv(numel, block),)](part, out, numel, SPLIT=part.shape[0], BLOCK=block,
                                                         num_warps=max(1, min(4, block // 128)),
                                                         enable_fp_fusion=False)
    return out

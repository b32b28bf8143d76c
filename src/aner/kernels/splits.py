"""The ordered sum of split-reduction parts, shared by the kernels that split a reduction."""
import torch
import triton
import triton.language as tl


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
    numel, block = out.numel(), 1024
    if numel:
        _sum_splits_kernel[(triton.cdiv(numel, block),)](part, out, numel, SPLIT=part.shape[0], BLOCK=block,
                                                         num_warps=4, enable_fp_fusion=False)
    return out

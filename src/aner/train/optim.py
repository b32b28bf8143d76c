"""AdamW on FP32 masters and FP32 moments, written out so every operation is fixed and visible.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments):
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + lr * wd * p
Every operation is elementwise and runs as one multi-tensor (`torch._foreach_*`) launch over a
group of tensors: on CUDA that is a handful of launches per update instead of ten per tensor,
and each element still sees the same operations in the same order, so the result does not
depend on how tensors are grouped or chunked. The paged optimizer relies on that: updating a
tensor in page-sized slices gives the same bits as updating it whole. On the CPU the multi-tensor
calls run the per-tensor operations.
"""
from dataclasses import dataclass

import torch

GROUP_ELEMENTS = 1 << 26    # at most 64 Mi elements (256 MiB of FP32) of moments per launch group


def groups(names: list[str], params: dict) -> list[list[str]]:
    """Consecutive runs of `names` holding at most GROUP_ELEMENTS elements each (a larger tensor
    is a group of its own): bounds the temporary of the denominator to one group."""
    out, size = [], 0
    for n in names:
        if not out or size + params[n].numel() > GROUP_ELEMENTS:
            out.append([])
            size = 0
        out[-1].append(n)
        size += params[n].numel()
    return out


@dataclass(frozen=True)
class AdamW:
    rate: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    @torch.no_grad()
    def update(self, ps: list, gs: list, ms: list, vs: list, t: int) -> None:
        """One AdamW update of (slices of) parameters and their moments, in place."""
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        torch._foreach_mul_(ms, b1)
        torch._foreach_add_(ms, gs, alpha=1 - b1)
        torch._foreach_mul_(vs, b2)
        torch._foreach_addcmul_(vs, gs, gs, value=1 - b2)
        if self.weight_decay:
            torch._foreach_mul_(ps, 1 - self.rate * self.weight_decay)
        denom = torch._foreach_div(vs, c2)
        torch._foreach_sqrt_(denom)
        torch._foreach_add_(denom, self.eps)
        torch._foreach_addcdiv_(ps, ms, denom, value=-self.rate / c1)

    def init_moments(self, params: dict) -> dict:
        return {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}

    def step(self, params: dict, grads: dict, moments: dict, t: int) -> None:
        """Update `params` and `moments` in place for update number `t` (1-based)."""
        for group in groups(sorted(params), params):
            self.update([params[n] for n in group], [grads[n] for n in group],
                        [moments[n][0] for n in group], [moments[n][1] for n in group], t)


@torch.no_grad()
def clip_by_global_norm(grads: dict, clip_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most clip_norm. Each tensor's norm is taken
    in float64 and the squares are summed in float64 in name order."""
    names = sorted(grads)
    norms = torch._foreach_norm([grads[n] for n in names], 2, dtype=torch.float64)
    norm = float(torch.stack(norms).pow(2).sum().sqrt())
    if clip_norm > 0 and norm > clip_norm:
        torch._foreach_mul_([grads[n] for n in names], clip_norm / (norm + 1e-6))
    return norm


def all_finite(grads: dict) -> bool:
    """One multi-tensor reduction and a single host synchronisation for the whole gradient set:
    a tensor's float64 L2 norm is finite exactly when all its elements are (FP32 squares cannot
    overflow float64)."""
    norms = torch._foreach_norm([g for _, g in sorted(grads.items())], 2, dtype=torch.float64)
    return bool(torch.isfinite(torch.stack(norms)).all())

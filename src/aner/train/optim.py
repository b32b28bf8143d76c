"""AdamW on FP32 masters and FP32 moments, written out so every operation is fixed and visible.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments):
    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p -= lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps) + lr * wd * p
Each tensor is updated on its own, in a fixed order, with no fused or multi-tensor kernels, so
the same inputs give the same bits and a resumed run replays an uninterrupted one exactly. Every
operation is elementwise, so updating a tensor in chunks (the paged optimizer) gives the same bits
as updating it whole.
"""
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AdamW:
    rate: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    @torch.no_grad()
    def update(self, p, g, m, v, t: int) -> None:
        """One AdamW update of (a slice of) a parameter and its moments, in place."""
        b1, b2 = self.betas
        c1, c2 = 1 - b1 ** t, 1 - b2 ** t
        m.mul_(b1).add_(g, alpha=1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        if self.weight_decay:
            p.mul_(1 - self.rate * self.weight_decay)
        denom = (v / c2).sqrt_().add_(self.eps)
        p.addcdiv_(m, denom, value=-self.rate / c1)

    def init_moments(self, params: dict) -> dict:
        return {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}

    def step(self, params: dict, grads: dict, moments: dict, t: int) -> None:
        """Update `params` and `moments` in place for update number `t` (1-based)."""
        for name in sorted(params):
            m, v = moments[name]
            self.update(params[name], grads[name], m, v, t)


@torch.no_grad()
def clip_by_global_norm(grads: dict, clip_norm: float) -> float:
    """Scale gradients so their global L2 norm is at most clip_norm; the norm sums in float64."""
    total = torch.zeros((), dtype=torch.float64, device=next(iter(grads.values())).device)
    for name in sorted(grads):
        total += grads[name].double().pow(2).sum()
    norm = float(total.sqrt())
    if clip_norm > 0 and norm > clip_norm:
        factor = clip_norm / (norm + 1e-6)
        for g in grads.values():
            g.mul_(factor)
    return norm


def all_finite(grads: dict) -> bool:
    """One device-side reduction and a single host synchronisation for the whole gradient set."""
    flags = torch.stack([torch.isfinite(g).all() for _, g in sorted(grads.items())])
    return bool(flags.all())

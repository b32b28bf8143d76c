"""AdamW on FP32 masters and FP32 moments: torch.optim.AdamW(fused=True)'s update.

    m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
    p = p (1 - lr wd) - (lr / (1 - b1^t)) m / (sqrt(v) / sqrt(1 - b2^t) + eps)

One pass reads each parameter, gradient and moment once and writes parameter and moments once,
where the equivalent multi-tensor ops make eight: on CUDA our kernel (`kernels/adamw.py`, one
launch for the whole list, the bits of torch's fused kernel, the gradients only read), on the CPU
`torch._fused_adamw_` (one threaded loop; given a divisor it also writes the divided gradients
back). Every element sees the same operations whatever the list of tensors, its order or the
thread count; a tensor may be updated in slices that start at multiples of 1024 elements (the
paged optimizer's pages) with the same bits. (On the CPU a slice starting elsewhere moves an
element between the vector loop and its scalar tail, which rounds v differently; nothing here
slices that way.)
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
    def update(self, ps: list, gs: list, ms: list, vs: list, t: torch.Tensor, divisor=None, cs=None) -> None:
        """One AdamW update of (slices of) parameters and their moments, in place; t is the update
        number (1-based) as a 0-dim FP32 tensor on their device (`step_count`). `divisor` (a 0-dim
        FP32 tensor there, from `clip_divisor`, or None): each gradient is divided by it as it is
        read (IEEE FP32 division); what the gradients hold afterwards is not part of the result.
        The kernels walk flat memory: parameters and moments must be contiguous, and gradients are
        made so (an adapter factor's gradient is often a transposed view). `cs` (or None): for each
        parameter None or its kept cast to the operand dtype, rewritten from the updated parameter
        (`Dense.cast`)."""
        assert all(x.is_contiguous() for x in (*ps, *ms, *vs)), "AdamW state must be contiguous"
        gs = [g.contiguous() for g in gs]
        hyper = dict(lr=self.rate, beta1=self.betas[0], beta2=self.betas[1], weight_decay=self.weight_decay,
                     eps=self.eps)
        if ps and ps[0].is_cuda:
            from ..kernels.adamw import adamw_
            adamw_(ps, gs, ms, vs, t, divisor=divisor, casts=cs, **hyper)
        else:
            torch._fused_adamw_(ps, gs, ms, vs, [], [t] * len(ps), amsgrad=False, maximize=False,
                                grad_scale=divisor, **hyper)
            for c, p in zip(cs or (), ps):
                if c is not None:
                    c.copy_(p)

    def init_moments(self, params: dict) -> dict:
        return {n: (torch.zeros_like(p), torch.zeros_like(p)) for n, p in params.items()}

    def step(self, params: dict, grads: dict, moments: dict, t: int, divisor=None, casts=None) -> None:
        """Update `params` and `moments` in place for update number `t` (1-based), and the kept
        casts of those in `casts` (name -> tensor)."""
        names = sorted(params)
        casts = casts or {}
        if names:
            self.update([params[n] for n in names], [grads[n] for n in names], [moments[n][0] for n in names],
                        [moments[n][1] for n in names], step_count(t, params[names[0]].device), divisor,
                        [casts.get(n) for n in names])


def step_count(t: int, device) -> torch.Tensor:
    """The update number as the fused kernel reads it: FP32 (exact up to 2^24 updates)."""
    return torch.full((), float(t), dtype=torch.float32, device=device)


@torch.no_grad()
def sum_of_squares(grads: dict) -> torch.Tensor:
    """The sum of the squares of every gradient element, in float64, as a 0-dim tensor on their
    device: on CUDA one pass of our kernel (`kernels.adamw.squares`), on the CPU each tensor's
    float64 norm squared and summed in name order. The same gradients give the same bits."""
    gs = [grads[n] for n in sorted(grads)]
    if gs and gs[0].is_cuda:
        from ..kernels.adamw import squares
        return squares(gs)
    return torch.stack(torch._foreach_norm(gs, 2, dtype=torch.float64)).pow(2).sum()


@torch.no_grad()
def clip_divisor(grads: dict, clip_norm: float) -> torch.Tensor | None:
    """What the gradients are divided by so their global L2 norm is at most clip_norm: (norm +
    1e-6) / clip_norm where the norm exceeds clip_norm, else exactly 1, as a 0-dim FP32 tensor
    made on their device (no wait for the host); None when clip_norm is 0 (no clipping). The norm
    is the square root of `sum_of_squares`. AdamW divides each gradient as it reads it
    (`AdamW.update`), so clipping makes no pass of its own over the gradients."""
    if clip_norm <= 0:
        return None
    norm = sum_of_squares(grads).sqrt()
    return torch.where(norm > clip_norm, (norm + 1e-6) / clip_norm, 1.0).float()


def all_finite(grads: dict) -> bool:
    """One pass and a single host synchronisation for the whole gradient set: the float64 sum of
    squares is finite exactly when every element is (FP32 squares cannot overflow float64)."""
    return bool(torch.isfinite(sum_of_squares(grads)))

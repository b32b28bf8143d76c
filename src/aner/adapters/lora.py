"""LoRA, rsLoRA and LoRA-FA: delta W = s * B @ A with A (r, in) Kaiming-uniform from the seed, B (out, r) zero.

s = alpha / r for LoRA and LoRA-FA, alpha / sqrt(r) for rsLoRA. A is drawn as PEFT does
(`kaiming_uniform_(a=sqrt(5))`, i.e. U(-1/sqrt(in), 1/sqrt(in))), from a generator seeded by
(seed, target index) so that each target's factors do not depend on which others were chosen.

LoRA-FA (arXiv:2308.03303) keeps A frozen at that initialisation and trains B alone. B's gradient
is preconditioned before clipping and AdamW as  g_B <- s^-2 * g_B @ pinv(A A^T + 1e-8 I):  with
g_B = s G A^T for the full-weight gradient G, that is the dB whose s dB A is the least-squares
closest to G, i.e. the full fine-tuning direction projected onto what B can express. A never
changes, so the r x r preconditioner is computed once at selection (FP32) and saved with the adapter.
"""
import math

import torch
from torch import nn

from .base import Method, add_low_rank, seeded

LORA_FA_DAMPING = 1e-8   # added to A A^T before the pseudo-inverse


class LoRALinear(nn.Module):
    """base(x) + s * (x @ A^T) @ B^T, the adapter part in the adapter's dtype (FP32 in models;
    float64 only in gradient checks)."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float, fused: bool = False):
        super().__init__()
        self.base = base
        self.lora_a = a
        self.lora_b = b
        self.scale = scale
        self.fused = fused

    def forward(self, x):
        # The scale multiplies B (out x r), not the (..., out) product: the same value up to
        # rounding (exactly the same bits when s is a power of two, as alpha = 2r is), without
        # a pass over the output in forward and backward.
        return add_low_rank(self.base, x, self.lora_a, self.lora_b, self.fused, self.scale)

    @staticmethod
    def joint(x, modules):
        """The outputs of `modules` for one input x: through the fused kernels together (x read
        once for all of them) when every one is fused, else each on its own."""
        if not all(m.fused for m in modules):
            return tuple(m(x) for m in modules)
        from ..kernels.lora import adapted_projections
        return adapted_projections([m.base for m in modules], x, [m.lora_a for m in modules],
                                   [m.lora_b for m in modules], [m.scale for m in modules])

    @staticmethod
    def gated_mlp(x, gate, up, down):
        """The feed-forward down(silu(gate(x)) * up(x)) with the SwiGLU inside the fused kernels'
        GEMMs where they take it (`kernels.lora.gated_mlp`), else None."""
        if not all(m.fused for m in (gate, up, down)):
            return None
        from ..kernels.lora import gated_mlp
        return gated_mlp(x, gate, up, down)


class LoRA(Method):
    def __init__(self, config):
        self.config = config

    def init(self, weights):
        out = {}
        for i, target in enumerate(self.config.targets):
            rows, cols = weights[target].shape
            bound = 1.0 / math.sqrt(cols)
            g = seeded(self.config.seed, i)
            a = torch.empty(self.config.rank, cols, dtype=torch.float32).uniform_(-bound, bound, generator=g)
            out[f"{target}.lora_a"] = a
            out[f"{target}.lora_b"] = torch.zeros(rows, self.config.rank, dtype=torch.float32)
        return out

    def trainable(self):
        return ("lora_a", "lora_b")

    def wrap(self, target, base, tensors, fused=False):
        return LoRALinear(base, tensors[f"{target}.lora_a"], tensors[f"{target}.lora_b"], self.config.scale, fused)

    def lora_factors(self, target, tensors):
        return tensors[f"{target}.lora_a"], tensors[f"{target}.lora_b"]


def lora_fa_preconditioner(a: torch.Tensor) -> torch.Tensor:
    """pinv(A A^T + 1e-8 I) for A (r, in), in FP32: (r, r)."""
    a = a.float()
    eye = torch.eye(a.shape[0], dtype=torch.float32, device=a.device)
    return torch.linalg.pinv(a @ a.t() + LORA_FA_DAMPING * eye)


class LoRAFA(LoRA):
    """LoRA with A frozen (no gradient, no moments) and B's gradient preconditioned."""

    def init(self, weights):
        out = super().init(weights)
        for target in self.config.targets:
            out[f"{target}.lora_fa_precond"] = lora_fa_preconditioner(out[f"{target}.lora_a"])
        return out

    def trainable(self):
        return ("lora_b",)

    @torch.no_grad()
    def precondition(self, grads, tensors):
        # FP32: (g_B (out, r) @ P (r, r)) then times s^-2, written into the gradient in place so that
        # clipping and AdamW (and `.grad`) all see the preconditioned gradient.
        inv_s2 = 1.0 / self.config.scale ** 2
        for target in self.config.targets:
            g = grads[f"{target}.lora_b"]
            assert g is not None and g.dtype == torch.float32, target
            g.copy_(torch.mm(g, tensors[f"{target}.lora_fa_precond"]).mul_(inv_s2))

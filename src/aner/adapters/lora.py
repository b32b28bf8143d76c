"""LoRA and rsLoRA: delta W = s * B @ A with A (r, in) Kaiming-uniform from the seed, B (out, r) zero.

s = alpha / r for LoRA and alpha / sqrt(r) for rsLoRA. A is drawn as PEFT does
(`kaiming_uniform_(a=sqrt(5))`, i.e. U(-1/sqrt(in), 1/sqrt(in))), from a generator seeded by
(seed, target index) so that each target's factors do not depend on which others were chosen.
"""
import math

import torch
from torch import nn

from .base import Method, seeded


class LoRALinear(nn.Module):
    """base(x) + s * (x @ A^T) @ B^T, the adapter part in FP32."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.base = base
        self.lora_a = a
        self.lora_b = b
        self.scale = scale

    def forward(self, x):
        y = self.base(x)
        delta = (x.float() @ self.lora_a.t()) @ self.lora_b.t()  # (..., r) then (..., out)
        return y + (self.scale * delta).to(y.dtype)


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

    def wrap(self, target, base, tensors):
        return LoRALinear(base, tensors[f"{target}.lora_a"], tensors[f"{target}.lora_b"], self.config.scale)

    def lora_factors(self, target, tensors):
        return tensors[f"{target}.lora_a"], tensors[f"{target}.lora_b"]

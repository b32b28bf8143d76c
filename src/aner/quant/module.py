"""A packed NF4 weight in the Llama's module tree: the projection/embedding interface of `Dense`.

forward(x) = nf4_linear(x, W): decodes bounded row tiles (DEFAULT_TILE_BYTES of FP32 at a time),
FP32 out, FP32 input gradient, no weight gradient. lookup(tokens) decodes only the selected rows.
A tied output head is the embedding's module used as a projection, so it decodes by tiles too.
Nothing keeps a dense copy of the matrix between calls. Adapters wrap this module exactly as they
wrap `Dense`: they only call it.
"""
import torch
from torch import nn

from ..errors import ConfigError
from .nf4 import DEFAULT_TILE_BYTES, NF4Weight, nf4_linear


class NF4Module(nn.Module):
    """A frozen NF4 weight (out, in) as a projection (x @ W^T) or an embedding table (rows of W)."""

    def __init__(self, weight: NF4Weight, tile_bytes: int = DEFAULT_TILE_BYTES):
        super().__init__()
        if not isinstance(weight, NF4Weight):
            raise ConfigError(f"weight must be an NF4Weight, got {type(weight).__name__}")
        self.weight = weight            # a plain attribute: not a Parameter, never trained
        self.tile_bytes = tile_bytes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4_linear(x, self.weight, self.tile_bytes)     # (..., in) -> (..., out), FP32

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.weight.dequantize_rows(tokens)              # (B, T) -> (B, T, in), FP32

    def extra_repr(self) -> str:
        kind = "double_quant" if self.weight.double_quant else "absmax"
        return f"shape={self.weight.shape}, {kind}, tile_bytes={self.tile_bytes}"

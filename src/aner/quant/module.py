"""A packed NF4 weight in the Llama's module tree: the projection/embedding interface of `Dense`.

Four kernels (the profile's `nf4_kernel`):
  host_tiled  forward(x) = nf4_linear(x, W): the packed buffers stay on the host and bounded row
              tiles (DEFAULT_TILE_BYTES of FP32 at a time) are decoded there and copied to x's
              device; out in x's dtype, input gradient only. lookup(tokens) decodes only the rows.
  fused       a device copy of the packed buffers (`kernels.nf4.DevicePacked`); the GPU kernels
              decode inside the matrix tile. Under a FP16/BF16 autocast policy x is rounded to
              that dtype and each decoded weight too, with FP32 accumulation, as cuBLAS does for
              a dense weight under autocast; otherwise everything is FP32.
  decoded     the same device copy; each product decodes the whole matrix into a transient
              buffer of x's dtype and multiplies it with cuBLAS: a dense weight's bits (that of
              NF4Weight.dequantize() rounded to the dtype). As the loss's head it is decoded once
              for all chunks of a micro-batch (`train/loss.py`).
  decoded_kept as decoded, but a product that trains something keeps its forward's decoded
              weight for its backward, as autograd keeps a dense weight's cast, instead of
              decoding it again there: one decode of each matrix a micro-batch, not two, for every
              decoded matrix alive from the forward to the backward (counted).
A tied output head is the embedding's module used as a projection. Nothing keeps a dense copy
of the matrix between micro-batches. Adapters wrap this module exactly as they wrap `Dense`.
"""
import torch
from torch import nn

from ..errors import ConfigError
from .nf4 import DEFAULT_TILE_BYTES, NF4Weight, nf4_linear


class NF4Module(nn.Module):
    """A frozen NF4 weight (out, in) as a projection (x @ W^T) or an embedding table (rows of W)."""

    def __init__(self, weight: NF4Weight, tile_bytes: int = DEFAULT_TILE_BYTES, device_copy=None,
                 decoded: bool = False, kept: bool = False):
        super().__init__()
        if not isinstance(weight, NF4Weight):
            raise ConfigError(f"weight must be an NF4Weight, got {type(weight).__name__}")
        self.weight = weight            # a plain attribute: not a Parameter, never trained
        self.tile_bytes = tile_bytes
        self.device_copy = device_copy  # kernels.nf4.DevicePacked for the fused kernels, else None
        self.decoded = decoded          # with a device copy: whole-matrix decode + cuBLAS
        # decoded_kept: the decoded operand is kept for backward, else made again there (one at a time)
        self.keeps_operand = decoded and kept
        # a decoded operand is made for each product, so it can have columns or rows to spare (an
        # adapter's factor joined to the product, `kernels.lora`)
        self.spare_room = decoded and device_copy is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.device_copy is None:
            return nf4_linear(x, self.weight, self.tile_bytes)  # (..., in) -> (..., out)
        from ..kernels.nf4 import fused_nf4_linear
        if torch.is_autocast_enabled(x.device.type):
            x = x.to(torch.get_autocast_dtype(x.device.type))
        with torch.autocast(x.device.type, enabled=False):
            return fused_nf4_linear(x, self.device_copy, self.decoded, self.keeps_operand)  # (..., out), x's dtype

    def operand(self, dtype: torch.dtype, left: int = 0, right: int = 0, below: int = 0,
                out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The whole decoded weight in `dtype` as a product's operand, for the decoded kernel
        (with `left` and `right` columns to spare on each side and `below` rows under it,
        unwritten; into `out` when given, as `nf4_decode` takes it); None for the others (their
        products decode inside)."""
        if self.device_copy is None or not self.decoded:
            return None
        from ..kernels.nf4 import nf4_decode
        return nf4_decode(self.device_copy, dtype, left, right, below, out)

    def lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.device_copy is None:
            return self.weight.dequantize_rows(tokens)          # (B, T) -> (B, T, in), FP32
        from ..kernels.nf4 import nf4_embedding
        return nf4_embedding(self.device_copy, tokens)

    def extra_repr(self) -> str:
        kind = "double_quant" if self.weight.double_quant else "absmax"
        kernel = f"host_tiled, tile_bytes={self.tile_bytes}" if self.device_copy is None else \
            "decoded_kept" if self.keeps_operand else "decoded" if self.decoded else "fused"
        return f"shape={self.weight.shape}, {kind}, {kernel}"

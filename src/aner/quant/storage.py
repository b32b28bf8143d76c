"""NF4 as a model's base storage: which tensors are packed, how, and what that costs.

Every 2-D tensor of a Llama (projections, the token embedding, an untied output head) is packed
into an `NF4Weight`; norm vectors stay FP32. A model's storage is one of STORAGES:

    float32            nothing packed
    nf4                NF4 codes + FP32 absmax per 64-block              (4.5 bits per weight)
    nf4_double_quant   NF4 codes + dynamic8 absmax codes, FP32 scale per  (~4.127 bits per weight)
                       256 absmax values, one FP32 offset per matrix

Packing runs over a matrix in flat chunks of PACK_CHUNK elements (a multiple of the 64-element
NF4 block), so it needs the FP32 source matrix plus a bounded chunk workspace, never several
FP32 temporaries of the whole matrix. Every block lies in one chunk and is quantized by the very
same `quantize_nf4` operations, and double quantization runs once over the whole absmax vector
(its offset is the whole vector's mean), so the result equals `NF4Weight.quantize` bit for bit
(tests/test_qlora.py).
"""
from collections.abc import Mapping

import torch

from ..errors import ConfigError
from .nf4 import ABSMAX_BLOCK, NF4_BLOCK, NF4Weight, double_quantize, quantize_nf4

STORAGES = ("float32", "nf4", "nf4_double_quant")
PACK_CHUNK = 1 << 18        # elements quantized at once: 1 MiB of FP32, a multiple of NF4_BLOCK
# quantize_nf4's temporaries per chunk element: |w|, w / absmax, its clamp (FP32), the int32 index,
# its uint8 copy and the packed halves: about 18 bytes; 24 leaves room for allocator slack.
PACK_WORKSPACE_BYTES = 24 * PACK_CHUNK

assert PACK_CHUNK % NF4_BLOCK == 0


def check_double_quant(double_quant) -> bool:
    if not isinstance(double_quant, bool):
        raise ConfigError(f"double_quant={double_quant!r} must be True or False "
                          f"(got a {type(double_quant).__name__})")
    return double_quant


def storage_name(double_quant: bool) -> str:
    return "nf4_double_quant" if double_quant else "nf4"


def packed_nbytes(shape, double_quant: bool) -> int:
    """Bytes an NF4Weight of `shape` owns (equals NF4Weight.nbytes()), without packing it."""
    n = int(shape[0]) * int(shape[1])
    blocks = -(-n // NF4_BLOCK)
    codes = (n + 1) // 2
    if double_quant:
        return codes + blocks + 4 * -(-blocks // ABSMAX_BLOCK) + 4    # codes, scales, offset
    return codes + 4 * blocks


def stored_nbytes(shape, double_quant: bool) -> int:
    """Bytes of one tensor of a packed model: packed when 2-D, FP32 otherwise (norm vectors)."""
    if len(shape) == 2:
        return packed_nbytes(shape, double_quant)
    n = 1
    for s in shape:
        n *= int(s)
    return 4 * n


def pack_matrix(w: torch.Tensor, double_quant: bool, chunk: int = PACK_CHUNK) -> NF4Weight:
    """A finite FP32 (out, in) CPU matrix -> NF4Weight, quantized `chunk` elements at a time."""
    assert chunk % NF4_BLOCK == 0 and w.dim() == 2 and w.dtype == torch.float32, (chunk, w.shape, w.dtype)
    rows, cols = w.shape
    flat = w.detach().reshape(-1)
    n = flat.numel()
    codes = torch.empty((n + 1) // 2, dtype=torch.uint8)
    absmax = torch.empty(-(-n // NF4_BLOCK), dtype=torch.float32)
    for start in range(0, n, chunk):
        stop = min(n, start + chunk)
        # (1, stop - start): quantize_nf4 takes matrices; blocks run over the flat order anyway.
        c, a = quantize_nf4(flat[start:stop].view(1, -1))
        codes[start // 2:start // 2 + c.numel()] = c              # start is even: byte aligned
        absmax[start // NF4_BLOCK:start // NF4_BLOCK + a.numel()] = a
    shape = (int(rows), int(cols))
    if not double_quant:
        return NF4Weight(codes=codes, shape=shape, double_quant=False, absmax=absmax)
    a_codes, a_scales, a_offset = double_quantize(absmax)
    return NF4Weight(codes=codes, shape=shape, double_quant=True, absmax_codes=a_codes,
                     absmax_scales=a_scales, absmax_offset=a_offset)


def pack_weights(weights: dict, double_quant: bool) -> dict:
    """name -> FP32 tensor  =>  name -> NF4Weight for matrices; norm vectors are shared as they are."""
    return {n: pack_matrix(w.detach().cpu(), double_quant) if w.dim() == 2 else w for n, w in weights.items()}


class DecodedTargets(Mapping):
    """name -> FP32 CPU matrix, decoding a packed weight on each access and keeping nothing.

    Adapter initialisation reads its targets one at a time (LoRA only their shapes, TinyLoRA their
    values for an SVD), so at most one decoded matrix is alive, not one per target.
    """

    def __init__(self, weights: dict):
        self._weights = weights

    def __getitem__(self, name):
        w = self._weights[name]
        return (w if isinstance(w, torch.Tensor) else w.dequantize()).cpu()

    def __iter__(self):
        return iter(self._weights)

    def __len__(self):
        return len(self._weights)

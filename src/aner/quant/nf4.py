"""Packed NF4 weights (QLoRA), bit-exact with bitsandbytes 0.50.2 on CPU, and `nf4_linear`.

Notation: W is (out, in) = (rows, cols), flattened row-major into n = rows * cols elements.
NF4 blocks are 64 consecutive flat elements (the last may be partial, and blocks run across row
ends). A block stores one FP32 absmax; each element stores a 4-bit index into NF4_CODEBOOK, two
per byte, the first element of a pair in the HIGH nibble (bnb's order); an odd n is padded with
index 7 (the code of 0.0), which is what bnb writes.

Double quantization (bnb `compress_statistics=True`): the per-block absmax vector is centred by
its FP32 mean (`offset`, the same bits on any number of threads), and the centred values are
quantized to 8-bit indices into the signed dynamic map in blocks of 256, each with its own FP32
scale (that block's absmax).

Numerics (all FP32, CPU, deterministic; each operation is rounded as bnb rounds it):
  nf4 index   = number of NF4 midpoints < w * (1/absmax)  (full blocks; the partial last block
                divides instead: w / absmax, as bnb does), so a value on a midpoint takes the
                lower index.
  nf4 value   = NF4_CODEBOOK[index] * absmax              (one FP32 multiply)
  dq absmax   = DYNAMIC8_CODEBOOK[code] * scale + offset  (FP32 multiply, then FP32 add)
  dynamic8 index: bnb's CPU kernel does NOT search for the nearest code. It snaps
                v = c * (1/scale) onto a grid of 65536 points over [-1, 1] (index
                trunc((v + 1) * 0.5 * 65535 + 0.5)) and looks the grid point's nearest code up in
                a table. We reproduce that table; the extra error it adds is at most half a grid
                step, 1/65535 of the scale, against a code spacing of up to 0.014 of it. The grid
                has no point at 0: a centred absmax of exactly 0 comes back as 2.125e-5 * scale.
Measured: every element of the dequantized weights, the packed codes, the absmax codes, scales
and offset equal bnb 0.50.2's bit for bit (tests/test_nf4.py, shapes 1823x781 ... 576x1536). Over
32768 blocks bnb's offset follows the thread count and ours does not (`double_quantize`).

The weight is frozen: `nf4_linear` returns input gradients only, decoding bounded row tiles.
"""
from dataclasses import dataclass

import torch

from ..errors import ConfigError, FormatError

NF4_BLOCK = 64              # elements per NF4 absmax block (QLoRA, bnb default)
ABSMAX_BLOCK = 256          # absmax values per dynamic8 block under double quantization (bnb)
DEFAULT_TILE_BYTES = 4 << 20    # decoded FP32 weight tile limit of nf4_linear: 4 MiB
FORMAT_VERSION = 1          # of the flat tensor dict written by NF4Weight.tensors()
# Every key NF4Weight.tensors() may write (checkpoints store them as `<name>.<part>`).
TENSOR_PARTS = ("nf4_version", "shape", "codes", "absmax", "absmax_codes", "absmax_scales", "absmax_offset")

# bnb `get_4bit_type("nf4")`: the 16 quantiles of N(0, 1) rescaled to [-1, 1], with an exact 0.
NF4_CODEBOOK = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
], dtype=torch.float32)
# bnb's decision thresholds: midpoints of neighbouring codes, computed in FP32.
NF4_BOUNDS = (NF4_CODEBOOK[:-1] + NF4_CODEBOOK[1:]) / 2
NF4_ZERO_INDEX = 7          # NF4_CODEBOOK[7] == 0.0; also the pad nibble of an odd n


def _dynamic8_codebook() -> torch.Tensor:
    """bnb `create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)`, same FP32 ops.

    For exponent i = 0..6, 2**i fraction values (midpoints of linspace(0.1, 1, 2**i + 1)) scaled
    by 10**(i - 6), both signs: 254 values, plus 0 and 1.0. The smallest is -0.99297, not -1.
    """
    parts = [torch.tensor([0.0, 1.0], dtype=torch.float32)]
    for i in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** i + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        scale = 10 ** (i - 6)       # Python float (int 1 for i = 6), exactly as bnb writes it
        parts += [scale * means, -scale * means]
    return torch.sort(torch.cat(parts)).values


DYNAMIC8_CODEBOOK = _dynamic8_codebook()

_GRID = 65536   # bnb CPU quantize_blockwise: points of the [-1, 1] lookup grid


def _dynamic8_grid_table() -> torch.Tensor:
    """Grid point g_i = -1 + 2i/65535 (FP32) -> index of the code nearest to it, ties low.

    bnb builds it by walking the FP32 midpoints 0.5 * (c[j] + c[j+1]): the index is the number of
    midpoints strictly below g_i.
    """
    mid = 0.5 * (DYNAMIC8_CODEBOOK[:-1] + DYNAMIC8_CODEBOOK[1:])
    grid = -1.0 + (2.0 * torch.arange(_GRID, dtype=torch.float32)) / float(_GRID - 1)
    return torch.searchsorted(mid, grid, right=False).to(torch.uint8)


_DYNAMIC8_TABLE = _dynamic8_grid_table()

# byte -> (value of high nibble, value of low nibble): decodes a packed byte with one lookup.
_NF4_PAIRS = torch.stack([NF4_CODEBOOK.repeat_interleave(16), NF4_CODEBOOK.repeat(16)], dim=1)


# ----------------------------------------------------------------------------- primitives

def pack_nibbles(idx: torch.Tensor) -> torch.Tensor:
    """(n,) indices 0..15 -> ((n + 1) // 2,) uint8, element 2k in the high nibble of byte k."""
    idx = idx.reshape(-1).to(torch.uint8)
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_full((1,), NF4_ZERO_INDEX)])
    return (idx[0::2] << 4) | idx[1::2]


def unpack_nibbles(codes: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of pack_nibbles: (bytes,) uint8 -> (n,) uint8 indices."""
    pairs = torch.stack([codes >> 4, codes & 0xF], dim=1)     # (bytes, 2): high first
    return pairs.reshape(-1)[:n]


def _check_weight(w) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise ConfigError(f"weight must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2 or w.numel() == 0:
        raise ConfigError(f"weight must be a non-empty 2-D (out, in) matrix, got shape {tuple(w.shape)}")
    if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError(f"weight dtype {w.dtype} is not one of float32, float16, bfloat16")
    w = w.detach().to("cpu", torch.float32)     # exact for float16/bfloat16, as in bnb
    if not torch.isfinite(w).all():
        bad = int((~torch.isfinite(w)).sum())
        raise ConfigError(f"weight of shape {tuple(w.shape)} has {bad} non-finite values; NF4 needs finite weights")
    return w


def _check_block(block: int, allowed) -> None:
    if block not in allowed:
        raise ConfigError(f"block={block!r} is not one of {tuple(allowed)}")


def quantize_nf4(w: torch.Tensor, block: int = NF4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w (any 2-D, finite) -> (codes uint8 ((n + 1) // 2,), absmax float32 (ceil(n / block),)).

    Mirrors bnb's torch quantize_4bit (its CPU path), rounding for rounding:
    full blocks scale by the FP32 reciprocal 1 / max(absmax, 1e-38) and store the unclamped
    absmax (0 for an all-zero block); the partial last block divides by max(absmax, 1e-38) and
    stores the clamped value. Scaled values are clamped to [-1, 1]; the index is the count of
    midpoints strictly below (bucketize), so a tie goes to the lower code.
    """
    _check_block(block, (32, 64, 128, 256, 512, 1024, 2048, 4096))
    flat = _check_weight(w).reshape(-1)
    n = flat.numel()
    full = n - n % block
    head = flat[:full].reshape(-1, block)                     # (full / block, block)
    absmax = head.abs().amax(dim=1)
    scaled = torch.clamp(head * (1.0 / absmax.clamp(min=1e-38)).unsqueeze(1), -1, 1).reshape(-1)
    if full < n:
        tail_max = flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, tail_max.reshape(1)])
        scaled = torch.cat([scaled, torch.clamp(flat[full:] / tail_max, -1, 1)])
    idx = torch.bucketize(scaled, NF4_BOUNDS, out_int32=True)
    return pack_nibbles(idx), absmax


def _scale_blocks(values: torch.Tensor, scales: torch.Tensor, block: int) -> torch.Tensor:
    """values (n,) * scales[i // block], one FP32 multiply per element, in place where possible."""
    n = values.numel()
    pad = -n % block
    if pad:
        values = torch.cat([values, values.new_zeros(pad)])
    return values.view(-1, block).mul_(scales.unsqueeze(1)).view(-1)[:n]


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, shape, block: int = NF4_BLOCK) -> torch.Tensor:
    """codes, absmax from quantize_nf4 -> float32 `shape`: NF4_CODEBOOK[idx] * absmax[block]."""
    rows, cols = shape
    n = rows * cols
    values = _NF4_PAIRS.index_select(0, codes.reshape(-1).int()).reshape(-1)[:n]   # (n,)
    return _scale_blocks(values, absmax, block).reshape(rows, cols)


def quantize_dynamic8(x: torch.Tensor, block: int = ABSMAX_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x (n,) float32 -> (codes uint8 (n,), scales float32 (ceil(n / block),)) as bnb CPU does.

    scale = the block's absmax; v = clamp(x * (1/scale), -1, 1) (FP32 reciprocal, then multiply);
    grid index k = trunc((v + 1) * 0.5 * 65535 + 0.5), each step rounded to FP32 (an FMA for the
    last two steps agrees on every boundary value we probed); code = table[k]. A block whose
    scale is 0 gets code 0 throughout, which decodes to -1 * 0 = -0.
    """
    x = x.reshape(-1)
    n = x.numel()
    pad = -n % block
    blocks = torch.cat([x, x.new_zeros(pad)]).view(-1, block)    # zero padding leaves absmax alone
    scales = blocks.abs().amax(dim=1)
    nonzero = scales > 0
    inv = torch.where(nonzero, 1.0 / torch.where(nonzero, scales, 1.0), 0.0)
    v = torch.clamp(blocks * inv.unsqueeze(1), -1, 1)
    k = ((v + 1.0) * 0.5 * float(_GRID - 1) + 0.5).to(torch.int64)  # truncation, as the C cast
    codes = torch.where(nonzero.unsqueeze(1), _DYNAMIC8_TABLE[k], 0).to(torch.uint8)
    return codes.reshape(-1)[:n], scales


def _sum(x: torch.Tensor) -> torch.Tensor:
    """x's FP32 sum, the same bits on any number of threads. PyTorch sums fewer than 32768 elements
    (its parallel grain) on one thread, and a longer vector in one part a thread, so its rounding
    follows the thread count; a longer x is summed as the sum of its 16384-element parts' sums."""
    if x.numel() < 1 << 15:
        return x.sum()
    return _sum(torch.stack([part.sum() for part in x.split(1 << 14)]))


def double_quantize(absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """absmax (blocks,) float32 -> (codes uint8, scales float32, offset 0-dim float32).

    offset is the FP32 mean, sum then divide, as torch's mean (the call bnb makes): the two agree
    bit for bit below 32768 blocks. Above, torch's mean depends on the number of threads and ours
    does not (`_sum`), so a packed matrix has the same bytes on any number of threads.
    """
    offset = _sum(absmax) / absmax.numel()
    codes, scales = quantize_dynamic8(absmax - offset)
    return codes, scales, offset


def double_dequantize(codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor,
                      block_ids: torch.Tensor) -> torch.Tensor:
    """Absmax of the NF4 blocks `block_ids` from their codes: code * scale, then + offset.

    Two FP32 roundings (multiply, then add), never fused, as bnb's dequantize_blockwise + add.
    """
    return DYNAMIC8_CODEBOOK[codes.long()] * scales[block_ids // ABSMAX_BLOCK] + offset


# ----------------------------------------------------------------------------- weight type

@dataclass(frozen=True, eq=False)   # eq over tensors would be ambiguous; identity it is
class NF4Weight:
    """A frozen packed NF4 matrix (out, in); absmax plain or double-quantized. Lives on the CPU."""
    codes: torch.Tensor                             # ((n + 1) // 2,) uint8, high nibble first
    shape: tuple[int, int]                          # (out, in)
    double_quant: bool
    absmax: torch.Tensor | None = None              # (blocks,) float32, when not double_quant
    absmax_codes: torch.Tensor | None = None        # (blocks,) uint8, when double_quant
    absmax_scales: torch.Tensor | None = None       # (ceil(blocks / 256),) float32
    absmax_offset: torch.Tensor | None = None       # () float32

    def __post_init__(self):
        if not (isinstance(self.shape, tuple) and len(self.shape) == 2
                and all(isinstance(s, int) and s > 0 for s in self.shape)):
            raise ConfigError(f"shape={self.shape!r} must be a tuple of two positive ints (out, in)")
        rows, cols = self.shape
        n = rows * cols
        blocks = -(-n // NF4_BLOCK)
        _expect("codes", self.codes, torch.uint8, ((n + 1) // 2,))
        if self.double_quant:
            if self.absmax is not None:
                raise ConfigError("absmax must be None when double_quant=True")
            _expect("absmax_codes", self.absmax_codes, torch.uint8, (blocks,))
            _expect("absmax_scales", self.absmax_scales, torch.float32, (-(-blocks // ABSMAX_BLOCK),))
            _expect("absmax_offset", self.absmax_offset, torch.float32, ())
        else:
            if any(t is not None for t in (self.absmax_codes, self.absmax_scales, self.absmax_offset)):
                raise ConfigError("absmax_codes/absmax_scales/absmax_offset must be None when double_quant=False")
            _expect("absmax", self.absmax, torch.float32, (blocks,))

    @classmethod
    def quantize(cls, w: torch.Tensor, double_quant: bool = True) -> "NF4Weight":
        codes, absmax = quantize_nf4(w)
        shape = (int(w.shape[0]), int(w.shape[1]))
        if not double_quant:
            return cls(codes=codes, shape=shape, double_quant=False, absmax=absmax)
        a_codes, a_scales, a_offset = double_quantize(absmax)
        return cls(codes=codes, shape=shape, double_quant=True, absmax_codes=a_codes,
                   absmax_scales=a_scales, absmax_offset=a_offset)

    def _owned(self) -> list[torch.Tensor]:
        if self.double_quant:
            return [self.codes, self.absmax_codes, self.absmax_scales, self.absmax_offset]
        return [self.codes, self.absmax]

    def nbytes(self) -> int:
        """Bytes of the tensor buffers this weight owns (codes, scales, offset); no dense cache."""
        return sum(t.numel() * t.element_size() for t in self._owned())

    def block_absmax(self, first: int, stop: int) -> torch.Tensor:
        """Decoded FP32 absmax of NF4 blocks first .. stop - 1."""
        if not self.double_quant:
            return self.absmax[first:stop]
        return double_dequantize(self.absmax_codes[first:stop], self.absmax_scales, self.absmax_offset,
                                 torch.arange(first, stop))

    def decode_span(self, start: int, stop: int) -> torch.Tensor:
        """Flat elements start .. stop - 1 as float32, touching only their blocks.

        Decodes whole 64-blocks (so at most 2 * 63 extra elements) and slices: the values equal
        those of dequantize() bit for bit, as each is the same single FP32 multiply.
        """
        first, last = start // NF4_BLOCK, -(-stop // NF4_BLOCK)
        lo, hi = first * NF4_BLOCK, min(last * NF4_BLOCK, self.shape[0] * self.shape[1])
        pairs = self.codes[lo // 2:(hi + 1) // 2]                    # lo is even: block aligned
        values = _NF4_PAIRS.index_select(0, pairs.int()).reshape(-1)[:hi - lo]
        return _scale_blocks(values, self.block_absmax(first, last), NF4_BLOCK)[start - lo:stop - lo]

    def dequantize(self) -> torch.Tensor:
        """The whole (out, in) float32 matrix. A full dense copy: for export and tests."""
        rows, cols = self.shape
        return self.decode_span(0, rows * cols).view(rows, cols)

    def decode_rows(self, first: int, stop: int) -> torch.Tensor:
        """Contiguous rows first .. stop - 1 as a (stop - first, in) float32 tile."""
        cols = self.shape[1]
        return self.decode_span(first * cols, stop * cols).view(stop - first, cols)

    def dequantize_rows(self, row_indices: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: (...,) integer row ids -> (..., in) float32, decoding only those rows.

        Each row is the flat run [r * in, (r + 1) * in), which may start and end inside a block.
        Per element: index nibble, block = flat // 64, value = code * absmax[block] (same FP32
        operations as dequantize(), so the rows are bit-identical to its rows).
        """
        rows, cols = self.shape
        if not isinstance(row_indices, torch.Tensor) or row_indices.is_floating_point() \
                or row_indices.is_complex() or row_indices.dtype == torch.bool:
            raise ConfigError(f"row_indices must be an integer tensor, got {row_indices!r:.80}")
        ids = row_indices.to("cpu", torch.int64)
        if ids.numel() and (ids.min() < 0 or ids.max() >= rows):
            raise ConfigError(f"row_indices span {int(ids.min())} .. {int(ids.max())}, "
                              f"outside 0 .. {rows - 1} of a ({rows}, {cols}) weight")
        flat = ids.reshape(-1, 1) * cols + torch.arange(cols)      # (k, in) flat element ids
        byte = self.codes[flat >> 1]
        idx = torch.where((flat & 1) == 0, byte >> 4, byte & 0xF)
        block = flat // NF4_BLOCK
        if self.double_quant:
            scale = double_dequantize(self.absmax_codes[block], self.absmax_scales, self.absmax_offset, block)
        else:
            scale = self.absmax[block]
        out = NF4_CODEBOOK[idx.long()] * scale
        return out.reshape(*row_indices.shape, cols).to(row_indices.device)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Flat dict for a safetensors checkpoint; the caller prefixes the names."""
        meta = {"nf4_version": torch.tensor(FORMAT_VERSION, dtype=torch.int64),
                "shape": torch.tensor(self.shape, dtype=torch.int64)}
        if self.double_quant:
            return {**meta, "codes": self.codes, "absmax_codes": self.absmax_codes,
                    "absmax_scales": self.absmax_scales, "absmax_offset": self.absmax_offset}
        return {**meta, "codes": self.codes, "absmax": self.absmax}

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "NF4Weight":
        """Inverse of tensors(); a malformed dict raises FormatError naming what it found."""
        keys = set(tensors)
        plain = {"nf4_version", "shape", "codes", "absmax"}
        nested = {"nf4_version", "shape", "codes", "absmax_codes", "absmax_scales", "absmax_offset"}
        if keys not in (plain, nested):
            raise FormatError(f"NF4 tensors have keys {sorted(keys)}; expected {sorted(plain)} "
                              f"or {sorted(nested)}")
        version = tensors["nf4_version"]
        if version.numel() != 1 or int(version) != FORMAT_VERSION:
            raise FormatError(f"NF4 tensor format version {version.tolist()} is not {FORMAT_VERSION}; "
                              f"re-export the checkpoint with this version of aner")
        shape = tensors["shape"]
        if shape.dtype != torch.int64 or tuple(shape.shape) != (2,):
            raise FormatError(f"NF4 'shape' must be 2 int64 values, got {shape.dtype} {tuple(shape.shape)}")
        fields = {k: v for k, v in tensors.items() if k not in ("nf4_version", "shape")}
        try:
            return cls(shape=tuple(int(s) for s in shape), double_quant=keys == nested, **fields)
        except ConfigError as e:
            raise FormatError(f"malformed NF4 tensors: {e}") from e


def _expect(name: str, t, dtype: torch.dtype, shape: tuple) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != shape:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ConfigError(f"{name} must be a {dtype} tensor of shape {shape}, got {got}")
    if t.device.type != "cpu":
        raise ConfigError(f"{name} must live on the CPU (packed NF4 buffers stay on the host), got {t.device}")


# ----------------------------------------------------------------------------- linear

def _tiles(weight: NF4Weight, tile_bytes: int):
    """(first, stop, (rows, in) float32 tile) over the rows; a tile holds <= tile_bytes of FP32
    (at least one row), plus at most two partial 64-blocks decoded alongside."""
    rows, cols = weight.shape
    step = max(1, tile_bytes // (4 * cols))
    for first in range(0, rows, step):
        stop = min(rows, first + step)
        yield first, stop, weight.decode_rows(first, stop)


class _NF4Linear(torch.autograd.Function):
    """y = x @ W^T through a frozen NF4 W; backward gives grad_x = grad_y @ W only (FP32)."""

    @staticmethod
    def forward(ctx, x2d, weight, tile_bytes):
        ctx.weight, ctx.tile_bytes = weight, tile_bytes
        ctx.dtype = x2d.dtype
        y = x2d.new_empty(x2d.shape[0], weight.shape[0])                  # (M, out)
        for first, stop, tile in _tiles(weight, tile_bytes):
            # A CUDA x gets the host-decoded tile copied over: one bounded host->device transfer
            # per tile, no persistent device copy of the weight. Under a FP16/BF16 policy the
            # FP32 tile is rounded to x's dtype (the GEMM still accumulates in FP32).
            y[:, first:stop] = x2d @ tile.to(x2d.device, x2d.dtype).t()    # (M, stop - first)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_y = grad_y.contiguous()
            grad_x = grad_y.new_zeros(grad_y.shape[0], ctx.weight.shape[1], dtype=torch.float32)  # (M, in)
            for first, stop, tile in _tiles(ctx.weight, ctx.tile_bytes):
                # Sums over `out` tile by tile in FP32, so the order differs from a dense GEMM.
                part = grad_y[:, first:stop] @ tile.to(grad_y.device, grad_y.dtype)
                grad_x += part.float()
            grad_x = grad_x.to(ctx.dtype)
        return grad_x, None, None


def nf4_linear(x: torch.Tensor, weight: NF4Weight, tile_bytes: int = DEFAULT_TILE_BYTES) -> torch.Tensor:
    """x (..., in) float32/16, bfloat16 -> (..., out) = x @ W^T, decoding W in row tiles of <= tile_bytes FP32.

    Forward: each output's dot product runs over the full `in`, as in a dense x @ W^T; a tile
    only changes how many columns one GEMM computes, and the BLAS may pick other kernels for
    that width. Measured (CPU, torch 2.13): bit-identical to x @ weight.dequantize().T for
    576x1536 and 49152x576 at the default tile; up to 1e-6 apart (about 2e-7 of |x| @ |W|^T)
    for 1823x781, with default or 7-row tiles.
    Backward: input gradient only, accumulated over row tiles in FP32, so its summation order
    differs from a dense grad_y @ W (measured: both within ~2e-7 of |g| @ |W| of float64).
    x may be on CUDA; the weight stays on the host.
    """
    if not isinstance(weight, NF4Weight):
        raise ConfigError(f"weight must be an NF4Weight, got {type(weight).__name__}")
    if isinstance(tile_bytes, bool) or not isinstance(tile_bytes, int) or tile_bytes < 1:
        raise ConfigError(f"tile_bytes={tile_bytes!r} must be a positive int")
    if not isinstance(x, torch.Tensor) or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ConfigError("x must be a float32, float16 or bfloat16 tensor, got "
                          f"{getattr(x, 'dtype', type(x).__name__)}")
    rows, cols = weight.shape
    if x.dim() == 0 or x.shape[-1] != cols:
        raise ConfigError(f"x of shape {tuple(x.shape)} does not end in in_features={cols} of a "
                          f"({rows}, {cols}) weight")
    y = _NF4Linear.apply(x.reshape(-1, cols), weight, tile_bytes)
    return y.reshape(*x.shape[:-1], rows)

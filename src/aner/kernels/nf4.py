"""Fused NF4 kernels (Triton): matmul, its input gradient, the embedding lookup and the decode.

Each op has three layers: a `@triton.jit` kernel, a launcher that checks its inputs, allocates
the output and picks the grid, and (for the projection) an autograd Function. The pure-torch
references are `NF4Weight.dequantize()` (+ a matmul) and `NF4Weight.dequantize_rows`.

Format (see aner.quant.nf4): W is (N, K) = (out, in), flat index f = n * K + k. Byte f >> 1 of
`codes` holds element f in its HIGH nibble when f is even, in its low nibble when f is odd.
Block b = f >> 6 has absmax[b], or with double quantization
    absmax[b] = DYNAMIC8_CODEBOOK[absmax_codes[b]] * absmax_scales[b >> 8] + absmax_offset.

Numerics (identical to NF4Weight.dequantize(), bit for bit):
  w = NF4_CODEBOOK[nibble] * absmax[b]   one FP32 multiply; the double-quant absmax is an FP32
                                         multiply then an FP32 add. Every launch passes
                                         enable_fp_fusion=False so the compiler never fuses
                                         them into an FMA (which would round once, not twice).
  matmul operand = w rounded to x's dtype (round to nearest even) for FP16/BF16, w for FP32.
  products accumulate in FP32 (tl.dot, out_dtype FP32). FP32 operands get products to FP32
  accuracy, never TF32 (the library's precision policy): on the BF16 tensor cores through exact
  BF16 parts (`fp32.fp32_dot`, as the adapter kernels), or with FP32 multiply-adds (tc=False).

The fused products (`nf4_matmul`, `nf4_matmul_t`) hold the decoded weight only as a tile in
registers/shared memory inside a matmul program: there is no dense copy of W on the device. With
no TileConfig given, a Hopper GPU runs the large FP16/BF16 ones through Gluon kernels: both
through `nf4_rs.py` (the MMA warps decode into the MMA's register operand; `nf4_rs.supported`)
where the device copy holds W^T's codes and the blocks' FP32 absmax too (`transposed_copy`, made
for nf4_kernel="fused" on a Hopper GPU); the others through the warp-specialized kernels of
`nf4_ws.py` (the decode in warps of its own beside the MMA's; `nf4_ws.supported`). The
decoded products (`fused_nf4_linear(..., decoded=True)`, the profile's nf4_kernel="decoded")
decode the whole W with `nf4_decode` into a transient buffer of the operand dtype, multiply it
with cuBLAS and free it; backward decodes it again (nf4_kernel="decoded_kept": the forward's is
kept for it). Their bits are those of a dense weight equal to NF4Weight.dequantize() rounded to
that dtype.

Nothing uses atomics or autotuning: each output element is summed by one program in a fixed
order (split-K partials are reduced by a second kernel in split order; cuBLAS runs under the
library's deterministic policy), and the tile configuration is a fixed function of (M, N, K,
dtype), so the same inputs give bitwise identical outputs on every run.
"""
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from ..quant.nf4 import (ABSMAX_BLOCK, DYNAMIC8_CODEBOOK, NF4_BLOCK, NF4_CODEBOOK, NF4Weight, pack_nibbles,
                         unpack_nibbles)
from . import FLOATS, INTERPRETING
from .fp32 import fp32_dot
from .launch import after_prior, launch_options
from .splits import sum_splits

# The kernels shift instead of dividing: flat >> 6 is the NF4 block, block >> 8 its scale.
assert NF4_BLOCK == 64 and ABSMAX_BLOCK == 256

MULTIPROCESSORS = 132   # H200/H100 SXM: split-K aims at one wave of >= this many programs


def hopper(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU, where the Gluon kernels (`nf4_rs`, `nf4_ws`) run."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


# ----------------------------------------------------------------------------- packed weight

@dataclass(frozen=True, eq=False)
class DevicePacked:
    """An immutable device copy of an NF4Weight: the packed tensors and the two codebooks."""
    shape: tuple[int, int]                      # (N, K) = (out, in)
    double_quant: bool
    codes: torch.Tensor                         # (ceil(N*K / 2),) uint8, high nibble first
    absmax: torch.Tensor | None                 # (blocks,) float32, plain
    absmax_codes: torch.Tensor | None           # (blocks,) uint8, double quant
    absmax_scales: torch.Tensor | None          # (ceil(blocks / 256),) float32
    absmax_offset: torch.Tensor | None          # (1,) float32
    nf4_codebook: torch.Tensor                  # (16,) float32
    dynamic8_codebook: torch.Tensor             # (256,) float32
    # the transposed copy, for the products with the weight as the MMA's register operand: the input
    # gradient reads its codes, both directions its absmax
    codes_t: torch.Tensor | None = None         # (K * N / 2,) uint8: W^T's codes (`transposed_copy`)
    absmax_t: torch.Tensor | None = None        # (K / 64, N) float32: block (n, b)'s in row b (`transposed_copy`)

    @classmethod
    def from_weight(cls, weight: NF4Weight, device, transposed: bool = False) -> "DevicePacked":
        """The device copy; with `transposed`, also the transposed copy where the register-operand
        kernels run (a Hopper GPU, both dimensions whole NF4 blocks)."""
        if not isinstance(weight, NF4Weight):
            raise ConfigError(f"weight must be an NF4Weight, got {type(weight).__name__}")
        device = torch.device(device)

        def put(t):
            return None if t is None else t.detach().to(device).contiguous()

        offset = None if weight.absmax_offset is None else weight.absmax_offset.reshape(1)
        codes = put(weight.codes)
        N, K = weight.shape
        codes_t = absmax_t = None
        if transposed and hopper(device) and N % 64 == 0 and K % 64 == 0:
            codes_t, absmax_t = transposed_copy(weight, codes)
        return cls(shape=weight.shape, double_quant=weight.double_quant, codes=codes,
                   absmax=put(weight.absmax), absmax_codes=put(weight.absmax_codes),
                   absmax_scales=put(weight.absmax_scales), absmax_offset=put(offset),
                   nf4_codebook=put(NF4_CODEBOOK), dynamic8_codebook=put(DYNAMIC8_CODEBOOK),
                   codes_t=codes_t, absmax_t=absmax_t)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def nbytes(self) -> int:
        """Bytes of the packed tensors held on the device (codes, scales, offset, codebooks, the
        transposed copy)."""
        held = [self.codes, self.absmax, self.absmax_codes, self.absmax_scales, self.absmax_offset,
                self.nf4_codebook, self.dynamic8_codebook, self.codes_t, self.absmax_t]
        return sum(t.numel() * t.element_size() for t in held if t is not None)

    def _args(self):
        """Pointer arguments of every kernel; unused slots get `codes` (never dereferenced)."""
        if self.double_quant:
            return (self.codes, self.codes, self.absmax_codes, self.absmax_scales, self.absmax_offset,
                    self.nf4_codebook, self.dynamic8_codebook)
        return (self.codes, self.absmax, self.codes, self.codes, self.codes,
                self.nf4_codebook, self.dynamic8_codebook)


def transposed_copy(weight: NF4Weight, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W^T's codes (made where `codes`, W's, lie), each 64 of a row in the order below, and the FP32
    absmax of W's blocks a column of W^T: (codes_t (K * N / 2,) uint8, absmax_t (K / 64, N) float32
    there, row b holding blocks (n, b), each 64 columns in the order below)."""
    N, K = weight.shape
    codes_t = pack_nibbles(unpack_nibbles(codes, N * K).view(N, K).t())
    # byte 4 w + t of each 32 (columns 8 w + 2 t, 8 w + 2 t + 1, packed as W's are) stored at 8 t + w:
    # the 8 bytes that one thread of the operand layout decodes (t = lane % 4) side by side, so the
    # 4 threads of a row read 8 bytes each, not the row's 32 each
    codes_t = codes_t.view(K, N // NF4_BLOCK, 8, 4).transpose(2, 3).reshape(-1)
    absmax_t = weight.block_absmax(0, N * K // NF4_BLOCK).view(N, K // NF4_BLOCK).t()
    # column 8 w + 2 t + e of each 64 stored at 16 (w // 2) + 4 t + 2 e + w % 2: the 16 that one
    # thread of the operand layout multiplies by (t = lane % 4) in four 16-byte loads, each of which
    # the 4 threads of a row make from separate banks; in the forward, where the 64 are rows, the two
    # rows of a thread (8 apart) side by side, one 8-byte load
    absmax_t = absmax_t.reshape(K // NF4_BLOCK, N // 64, 4, 2, 4, 2).permute(0, 1, 2, 4, 5, 3)
    return codes_t, absmax_t.reshape(K // NF4_BLOCK, N).to(codes.device).contiguous()


# ----------------------------------------------------------------------------- decode (device)

@triton.jit
def _nf4_value(nib, nf4cb, LUT: tl.constexpr):
    """4-bit index -> FP32 NF4 code value. LUT 0: gather from the 64-byte device table (one L1
    line); otherwise a select tree over literal constants (exact FP32 values of NF4_CODEBOOK):
    LUT 1 everywhere, LUT 2 where the whole-byte decode does not apply (K % 64 != 0)."""
    if LUT == 0:
        return tl.load(nf4cb + nib.to(tl.int32))
    else:
        b0 = (nib & 1) != 0
        b1 = (nib & 2) != 0
        b2 = (nib & 4) != 0
        b3 = (nib & 8) != 0
        v0 = tl.where(b0, -0.6961928009986877, -1.0)
        v1 = tl.where(b0, -0.39491748809814453, -0.5250730514526367)
        v2 = tl.where(b0, -0.18477343022823334, -0.28444138169288635)
        v3 = tl.where(b0, 0.0, -0.09105003625154495)
        v4 = tl.where(b0, 0.16093020141124725, 0.07958029955625534)
        v5 = tl.where(b0, 0.33791524171829224, 0.24611230194568634)
        v6 = tl.where(b0, 0.5626170039176941, 0.44070982933044434)
        v7 = tl.where(b0, 1.0, 0.7229568362236023)
        u0 = tl.where(b1, v1, v0)
        u1 = tl.where(b1, v3, v2)
        u2 = tl.where(b1, v5, v4)
        u3 = tl.where(b1, v7, v6)
        t0 = tl.where(b2, u1, u0)
        t1 = tl.where(b2, u3, u2)
        return tl.where(b3, t1, t0).to(tl.float32)


def _select_ptx(codes: str) -> list[str]:
    """PTX for the byte-permute lookup's selectors from four 4-bit codes (nibbles 0..3 of
    `codes`): s, the selector nibbles (code & 7: an entry of a plane half); m, byte k 0xFF where
    code k >= 8 (the upper half). Needs c80 = 0x8000 and scratch ms."""
    return [f"and.b32 s, {codes}, 0x7777;", f"shr.b32 ms, {codes}, 3;", "and.b32 ms, ms, 0x1111;",
            "or.b32 ms, ms, 0x8888;", "prmt.b32 m, c80, 0, ms;"]


def _plane_ptx(out: str, plane: tuple[str, str, str, str]) -> list[str]:
    """PTX for `out` byte k = entry (code k) of a 16-byte plane held in four registers, with s and
    m from `_select_ptx`: a `prmt` in each half, and m picks between them. Scratch a, b."""
    return [f"prmt.b32 a, {plane[0]}, {plane[1]}, s;", f"prmt.b32 b, {plane[2]}, {plane[3]}, s;",
            f"lop3.b32 {out}, b, a, m, 0xE4;"]                          # (b & m) | (a & ~m)


def _prmt_lookup_asm() -> str:
    """PTX for 4 code bytes (one register) -> their 8 NF4 values as FP32 bit patterns.

    Byte k holds element 2k in its high nibble and 2k + 1 in its low nibble; outputs $0..$3 are
    the high-nibble values of bytes 0..3, $4..$7 the low-nibble values; $8 is the input. The 16
    FP32 codebook values are split into four byte planes of four registers each; `prmt` picks
    four bytes of a plane at once (`_plane_ptx`), and eight more `prmt` per four values gather
    the planes back into words. About 6 instructions per value instead of a 15-way select.
    """
    bits = NF4_CODEBOOK.view(torch.int32).tolist()
    plane = [[sum(((bits[4 * q + i] >> (8 * j)) & 255) << (8 * i) for i in range(4))
              for q in range(4)] for j in range(4)]                      # plane[j][q]: byte j of 4q..4q+3
    lines = [".reg .b32 x, y, s, ms, m, a, b, p0, p1, p2, p3, t0, t1, t2, t3, c80;",
             "mov.b32 c80, 0x8000;"]
    lines += [f".reg .b32 T{j}{q}; mov.b32 T{j}{q}, {plane[j][q]:#x};" for j in range(4) for q in range(4)]
    for out, shift in ((0, 4), (4, 0)):                                 # high nibbles, then low
        lines += [f"shr.b32 x, $8, {shift};" if shift else "mov.b32 x, $8;",
                  "and.b32 x, x, 0x0F0F0F0F;",                          # nibbles at positions 0, 2, 4, 6
                  "shr.b32 y, x, 12;", "or.b32 y, y, x;"]               # positions 0..3 = bytes 0, 2, 1, 3
        lines += _select_ptx("y")
        for j in range(4):
            lines += _plane_ptx(f"p{j}", tuple(f"T{j}{q}" for q in range(4)))
        lines += ["prmt.b32 t0, p0, p1, 0x5140;", "prmt.b32 t1, p2, p3, 0x5140;",
                  "prmt.b32 t2, p0, p1, 0x7362;", "prmt.b32 t3, p2, p3, 0x7362;",
                  f"prmt.b32 ${out}, t0, t1, 0x5410;", f"prmt.b32 ${out + 2}, t0, t1, 0x7632;",
                  f"prmt.b32 ${out + 1}, t2, t3, 0x5410;", f"prmt.b32 ${out + 3}, t2, t3, 0x7632;"]
    return "{\n" + "\n".join(lines) + "\n}"


_PRMT_LOOKUP = tl.constexpr(_prmt_lookup_asm())


def _table_lookup_asm(cvt: str) -> str:
    """PTX for one 32-bit code word (8 codes of ONE NF4 block) and that block's absmax -> the 8
    products, rounded to a 16-bit float by `cvt` (cvt.rn.bf16x2.f32 or cvt.rn.f16x2.f32).

    A block's weights take only 16 values, round(code_i * absmax): they are made once (16 FP32
    multiplies, 8 packed roundings) and split into a low-byte and a high-byte plane of four
    registers each. A block's 8 words share one absmax register, so the compiler keeps one table
    per block and thread. The lookup is the byte-permute scheme of `_prmt_lookup_asm` on two
    planes instead of four: the word's nibbles are swapped pairwise so that selector nibble j is
    the code of element j (byte k holds element 2k in its high nibble), and two `prmt` pair the
    looked-up bytes into 16-bit words. Same bits as decoding to FP32, multiplying and rounding
    each element. Outputs $0..$7: elements 0..7; $8 the code word; $9 the absmax.
    """
    bits = NF4_CODEBOOK.view(torch.int32).tolist()
    lines = [".reg .b32 x, s, ms, m, pl, ph, a, b, c80, P<4>;", ".reg .f32 f<16>;",
             ".reg .b32 B<8>, L<4>, H<4>;", "mov.b32 c80, 0x8000;"]
    lines += [f"mov.b32 f{i}, {bits[i]:#x}; mul.rn.f32 f{i}, f{i}, $9;" for i in range(16)]
    lines += [f"{cvt} B{q}, f{2 * q + 1}, f{2 * q};" for q in range(8)]           # B_q = (v_2q, v_2q+1)
    lines += [f"prmt.b32 L{q}, B{2 * q}, B{2 * q + 1}, 0x6420; prmt.b32 H{q}, B{2 * q}, B{2 * q + 1}, 0x7531;"
              for q in range(4)]                                                   # planes of v_4q..v_4q+3
    lines += ["shr.b32 a, $8, 4; and.b32 a, a, 0x0F0F0F0F;", "shl.b32 b, $8, 4; and.b32 b, b, 0xF0F0F0F0;",
              "or.b32 x, a, b;"]                                                   # nibble j = code of element j
    for half in range(2):                                                          # elements 0..3, then 4..7
        lines += ["shr.b32 x, x, 16;"] if half else []
        lines += _select_ptx("x")
        lines += _plane_ptx("pl", ("L0", "L1", "L2", "L3")) + _plane_ptx("ph", ("H0", "H1", "H2", "H3"))
        lines += [f"prmt.b32 P{2 * half}, pl, ph, 0x5140;", f"prmt.b32 P{2 * half + 1}, pl, ph, 0x7362;"]
    lines += [f"mov.b32 {{${2 * q}, ${2 * q + 1}}}, P{q};" for q in range(4)]
    return "{\n" + "\n".join(lines) + "\n}"


_TABLE_BF16 = tl.constexpr(_table_lookup_asm("cvt.rn.bf16x2.f32"))
_TABLE_F16 = tl.constexpr(_table_lookup_asm("cvt.rn.f16x2.f32"))
_TABLE_IO = tl.constexpr("=h," * 8 + "r,r")


@triton.jit
def _nf4_byte_values(byte, nf4cb, LUT: tl.constexpr):
    """Code bytes -> (value of the high nibble, value of the low nibble), FP32."""
    if LUT >= 2:
        return tl.inline_asm_elementwise(_PRMT_LOOKUP, "=r,=r,=r,=r,=r,=r,=r,=r,r", [byte],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        return _nf4_value(byte >> 4, nf4cb, LUT), _nf4_value(byte & 15, nf4cb, LUT)


@triton.jit
def _block_absmax(blk, mask, absmax, acodes, ascales, aoffset, dyncb, DQ: tl.constexpr):
    """FP32 absmax of NF4 blocks `blk`. Masked lanes give 0, or with DQ the (finite) offset;
    the callers only pair such lanes with zero operands or masked outputs."""
    if DQ:
        code = tl.load(acodes + blk, mask=mask, other=0).to(tl.int32)
        scale = tl.load(ascales + (blk >> 8), mask=mask, other=0.0)
        # FP32 multiply, then FP32 add: two roundings (the launch disables FMA contraction).
        return tl.load(dyncb + code) * scale + tl.load(aoffset)
    else:
        return tl.load(absmax + blk, mask=mask, other=0.0)


@triton.jit
def _decode_any(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, rows, row_mask, cols, K,
                DQ: tl.constexpr, LUT: tl.constexpr):
    """(R,) rows x (C,) cols -> (R, C) FP32 tile, general flat-index decode (any K, blocks that
    straddle rows, partial last block). Masked elements decode to a finite value: (+/-)0, or
    -absmax_offset with DQ."""
    flat = rows.to(tl.int64)[:, None] * K + cols[None, :]              # (R, C) flat element ids
    mask = row_mask[:, None] & (cols < K)[None, :]
    byte = tl.load(codes + (flat >> 1), mask=mask, other=0)
    nib = tl.where((flat & 1) == 0, byte >> 4, byte & 15)
    am = _block_absmax(flat >> 6, mask, absmax, acodes, ascales, aoffset, dyncb, DQ)
    return _nf4_value(nib, nf4cb, LUT) * am


@triton.jit
def _decode_k64(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, rows, row_mask, grp0, K,
                R: tl.constexpr, G: tl.constexpr, DQ: tl.constexpr, LUT: tl.constexpr, DT: tl.constexpr):
    """Fast path for K % 64 == 0: rows x columns [64 * grp0, 64 * (grp0 + G)) -> (R, 64 G) in DT.

    Each row's 64-column group is exactly one NF4 block (b = row * K/64 + group) stored in 32
    bytes, so the tile loads 32 bytes per block, one absmax per block, and splits nibbles.
    """
    KG = K // 64
    g = grp0 + tl.arange(0, G)                                          # (G,) column groups
    mask = row_mask[:, None] & (g < KG)[None, :]                        # (R, G)
    blk = rows.to(tl.int64)[:, None] * KG + g[None, :]                  # (R, G) NF4 block ids
    am = _block_absmax(blk, mask, absmax, acodes, ascales, aoffset, dyncb, DQ)[:, :, None]
    if LUT == 3 and DT != tl.float32:
        # 8 words of 8 codes per block: each word is decoded whole with its own block's absmax.
        words = codes.to(tl.pointer_type(tl.int32)) + blk[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]
        word = tl.load(words, mask=mask[:, :, None], other=0)                   # (R, G, 8)
        if DT == tl.bfloat16:
            v = tl.inline_asm_elementwise(_TABLE_BF16, _TABLE_IO, [word, am], dtype=(tl.bfloat16,) * 8,
                                          is_pure=True, pack=1)
        else:
            v = tl.inline_asm_elementwise(_TABLE_F16, _TABLE_IO, [word, am], dtype=(tl.float16,) * 8,
                                          is_pure=True, pack=1)
        # join's new axis is the last: (R, G, 8, a, b, c) holds element 4a + 2b + c of each word
        e = tl.join(tl.join(tl.join(v[0], v[4]), tl.join(v[2], v[6])),
                    tl.join(tl.join(v[1], v[5]), tl.join(v[3], v[7])))
        return tl.reshape(e, (R, G * 64))
    else:
        byte_ofs = blk[:, :, None] * 32 + tl.arange(0, 32)[None, None, :]  # (R, G, 32)
        byte = tl.load(codes + byte_ofs, mask=mask[:, :, None], other=0)
        hi, lo = _nf4_byte_values(byte, nf4cb, LUT)                     # even, odd elements
        return tl.reshape(tl.join(hi * am, lo * am), (R, G * 64)).to(DT)  # (R, G, 32, 2) -> (R, 64 G)


@triton.jit
def _decode_tile(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, rows, row_mask, col0, K,
                 R: tl.constexpr, C: tl.constexpr, FAST: tl.constexpr, DQ: tl.constexpr,
                 LUT: tl.constexpr, DT: tl.constexpr):
    """Weight rows `rows` x columns col0 .. col0 + C - 1 -> (R, C) in the matmul operand dtype DT
    (FAST: col0 % 64 == 0)."""
    if FAST:
        return _decode_k64(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, rows, row_mask,
                           col0 // 64, K, R, C // 64, DQ, LUT, DT)
    else:
        return _decode_any(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, rows, row_mask,
                           col0 + tl.arange(0, C), K, DQ, LUT).to(DT)


@triton.jit
def _tile_ids(M_TILES, O_TILES, GROUP_M: tl.constexpr):
    """Program id -> (token tile, output-feature tile), grouped so that GROUP_M token tiles
    walk the same weight tiles together (weight tiles stay in L2)."""
    pid = tl.program_id(0)
    per_group = GROUP_M * O_TILES
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(M_TILES - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _dot(a, b, acc, TC: tl.constexpr):
    """acc + a @ b, accumulated in FP32: FP16/BF16 operands as they are, FP32 ones to FP32
    accuracy (`fp32_dot`: BF16 parts on the tensor cores with TC, else FP32 multiply-adds)."""
    if a.dtype == tl.float32:
        return fp32_dot(a, b, acc, False, TC)
    return tl.dot(a, b, acc, out_dtype=tl.float32)


# ----------------------------------------------------------------------------- kernels

@triton.jit
def _nf4_matmul_kernel(x, y, part, codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb,
                       M, N, K, STEPS_PER_SPLIT: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       SPLIT: tl.constexpr, FAST: tl.constexpr, DQ: tl.constexpr, LUT: tl.constexpr,
                       SWAP: tl.constexpr, TC: tl.constexpr):
    """y (M, N) = x (M, K) @ W^T; program (tile, s) sums K steps [s, s + 1) * STEPS_PER_SPLIT of BK.

    SWAP computes the transposed tile W x^T, so the decoded weight is the register operand (A)
    of the MMA and x^T is read from shared memory.
    """
    after_prior()
    pid_m, pid_n = _tile_ids(tl.cdiv(M, BM), tl.cdiv(N, BN), GROUP_M)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_rows = x + offs_m.to(tl.int64)[:, None] * K
    if SWAP:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    # A fixed trip count (constexpr: one compile per (shape, split), a handful per model); the
    # last part may run past K, and those steps are fully masked (zeros).
    for i in range(0, STEPS_PER_SPLIT):
        k0 = (pid_s * STEPS_PER_SPLIT + i) * BK
        offs_k = k0 + tl.arange(0, BK)
        xt = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)
        w = _decode_tile(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, offs_n, n_mask, k0, K,
                         BN, BK, FAST, DQ, LUT, xt.dtype)                # (BN, BK), x's dtype
        if SWAP:
            acc = _dot(w, tl.trans(xt), acc, TC)
        else:
            acc = _dot(xt, tl.trans(w), acc, TC)
    if SWAP:
        acc = tl.trans(acc)                                             # (BN, BM) -> (BM, BN)
    out_mask = m_mask[:, None] & n_mask[None, :]
    out_ofs = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    if SPLIT == 1:
        tl.store(y + out_ofs, acc.to(y.dtype.element_ty), mask=out_mask)
    else:
        tl.store(part + pid_s.to(tl.int64) * M * N + out_ofs, acc, mask=out_mask)


@triton.jit
def _nf4_matmul_t_kernel(g, dx, part, codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb,
                         M, N, K, STEPS_PER_SPLIT: tl.constexpr,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                         SPLIT: tl.constexpr, FAST: tl.constexpr, DQ: tl.constexpr, LUT: tl.constexpr,
                         SWAP: tl.constexpr, TC: tl.constexpr):
    """dx (M, K) = g (M, N) @ W; program (tile, s) sums N steps [s, s + 1) * STEPS_PER_SPLIT of BN.

    The output tile is (BM, BK); the decoded weight tile (BN, BK) is the B operand, or with SWAP
    its transpose is the A operand of dx^T = W^T g^T.
    """
    after_prior()
    pid_m, pid_k = _tile_ids(tl.cdiv(M, BM), tl.cdiv(K, BK), GROUP_M)
    pid_s = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_k = pid_k * BK + tl.arange(0, BK)
    m_mask = offs_m < M
    g_rows = g + offs_m.to(tl.int64)[:, None] * N
    if SWAP:
        acc = tl.zeros((BK, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BK), dtype=tl.float32)
    # A fixed trip count (constexpr, as in the forward); steps past N are fully masked (zeros).
    for i in range(0, STEPS_PER_SPLIT):
        offs_n = (pid_s * STEPS_PER_SPLIT + i) * BN + tl.arange(0, BN)
        n_mask = offs_n < N
        gt = tl.load(g_rows + offs_n[None, :], mask=m_mask[:, None] & n_mask[None, :], other=0.0)
        w = _decode_tile(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, offs_n, n_mask,
                         pid_k * BK, K, BN, BK, FAST, DQ, LUT, gt.dtype)      # (BN, BK), g's dtype
        if SWAP:
            acc = _dot(tl.trans(w), tl.trans(gt), acc, TC)
        else:
            acc = _dot(gt, w, acc, TC)
    if SWAP:
        acc = tl.trans(acc)                                             # (BK, BM) -> (BM, BK)
    out_mask = m_mask[:, None] & (offs_k < K)[None, :]
    out_ofs = offs_m.to(tl.int64)[:, None] * K + offs_k[None, :]
    if SPLIT == 1:
        tl.store(dx + out_ofs, acc.to(dx.dtype.element_ty), mask=out_mask)
    else:
        tl.store(part + pid_s.to(tl.int64) * M * K + out_ofs, acc, mask=out_mask)


@triton.jit
def _nf4_rows_kernel(ids, out, codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, n_ids, K,
                     BR: tl.constexpr, BC: tl.constexpr, DQ: tl.constexpr, LUT: tl.constexpr):
    """out[i, :] = decoded row ids[i] (FP32), BR ids x BC columns per program."""
    after_prior()
    offs_i = tl.program_id(0) * BR + tl.arange(0, BR)
    i_mask = offs_i < n_ids
    rows = tl.load(ids + offs_i, mask=i_mask, other=0)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    w = _decode_any(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, rows, i_mask, cols, K, DQ, LUT)
    tl.store(out + offs_i.to(tl.int64)[:, None] * K + cols[None, :], w,
             mask=i_mask[:, None] & (cols < K)[None, :])


@triton.jit
def _nf4_decode_kernel(out, out_rows, codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, N, K,
                       BR: tl.constexpr, BC: tl.constexpr, FAST: tl.constexpr, DQ: tl.constexpr,
                       LUT: tl.constexpr):
    """out (N, K) = W in out's dtype (rows out_rows apart), one (BR, BC) tile per program (FAST:
    K % 64 == 0)."""
    after_prior()
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    col0 = tl.program_id(1) * BC
    cols = col0 + tl.arange(0, BC)
    r_mask = rows < N
    w = _decode_tile(codes, absmax, acodes, ascales, aoffset, nf4cb, dyncb, rows, r_mask, col0, K,
                     BR, BC, FAST, DQ, LUT, out.dtype.element_ty)
    tl.store(out + rows.to(tl.int64)[:, None] * out_rows + cols[None, :], w, mask=r_mask[:, None] & (cols < K)[None, :])


# ----------------------------------------------------------------------------- configs

@dataclass(frozen=True)
class TileConfig:
    """Tiles of one launch. bm: tokens; bn: weight rows (out features); bk: weight columns (in
    features). split: parts of the reduced dimension (K forward, N input gradient), summed by a
    second kernel in order. lut, the codebook lookup: 0 gather (a global load per element),
    1 select tree, 2 byte permutes on whole code bytes where K % 64 == 0 (inline PTX: GPU only;
    elsewhere the select tree), 3 as 2 but FP16/BF16 operands come from a per-block table of
    the 16 rounded products (FP32 operands as 2). swap: weight as MMA operand A. tc: FP32
    operands' products on the tensor cores through BF16 parts, else FP32 multiply-adds."""
    bm: int
    bn: int
    bk: int
    split: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    lut: int = 3
    swap: bool = False
    tc: bool = True

    def check(self):
        for name in ("bm", "bn", "bk"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ConfigError(f"TileConfig.{name}={v} must be a power of two >= 16")
        if self.split < 1 or self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) \
                or self.num_stages < 1 or self.lut not in (0, 1, 2, 3):
            raise ConfigError(f"{self} has a value outside split >= 1, group_m >= 1, num_warps in "
                              f"1..16 (power of two), num_stages >= 1, lut in (0, 1, 2, 3)")
        if self.lut >= 2 and INTERPRETING:
            raise ConfigError(f"{self}: lut={self.lut} runs inline PTX, which Triton's interpreter cannot; use lut=1")
        if self.tc and INTERPRETING:
            raise ConfigError(f"{self}: tc=True multiplies BF16 parts, which Triton's interpreter gets wrong "
                              "(numpy has no BF16); use tc=False")


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, n - 1).bit_length())


def _split(tiles: int, steps: int) -> int:
    """Parts of the reduction for `tiles` output tiles: double while the programs still fit one
    wave (MULTIPROCESSORS programs) and every part keeps >= 4 steps (a fixed function of the shape)."""
    split = 1
    while tiles * split * 2 <= MULTIPROCESSORS and steps >= 8 * split and split < 16:
        split *= 2
    return split


def default_config(op: str, M: int, N: int, K: int, dtype: torch.dtype) -> TileConfig:
    """The tile configuration used when none is given: a fixed function of the problem."""
    assert op in ("matmul", "matmul_t")
    if dtype == torch.float32:
        # Six BF16 products a step (`fp32_dot`). 128-token tiles at 8 warps compile without
        # spills where K % 64 == 0 (benchmarks/nf4_sass.py: ~715 SASS instructions a thread a
        # step against ~1500 tensor-core cycles; the general decode's input gradient spills 120
        # bytes, 64-token tiles more); FP32 multiply-add dots spill ~5 KB a thread.
        bm, bn, bk, stages, swap = min(128, _pow2_at_least(M, 16)), 64, 64, 2, False
        warps = 8 if bm >= 128 else 4
    else:
        # The fastest measured on the H200 (benchmarks/results/2026-12-01-h200-nf4-kernels-*.json):
        # from 256 tokens, 256-token tiles with the decoded weight as MMA operand A: the forward
        # 128 weight rows at 8 warps and 4 stages, the input gradient 64 x 64 weight tiles at one
        # warpgroup (247 registers: two programs a multiprocessor, each one's decode beside the
        # other's products); from 128, 128-token tiles, the input gradient with the weight as
        # operand A, the forward as B. The general decode (K % 64 != 0) keeps 128 tokens and
        # operand B: it spills at 256.
        fast = K % 64 == 0
        if M >= 256 and fast:
            bm, swap = 256, True
            bn, bk, warps, stages = (128, 64, 8, 4) if op == "matmul" else (64, 64, 4, 3)
        else:
            if M >= 128:
                bm, swap = 128, fast and op == "matmul_t"
            else:
                bm, swap = _pow2_at_least(M, 16), False
            warps, stages = (8 if bm >= 128 else 4), 3
            bn, bk = (128 if M >= 128 else 64, 64) if op == "matmul" else (64, 128)
    if op == "matmul":
        split = _split(-(-M // bm) * -(-N // bn), -(-K // bk))
    else:
        split = _split(-(-M // bm) * -(-K // bk), -(-N // bn))
    return TileConfig(bm=bm, bn=bn, bk=bk, split=split, num_warps=warps, num_stages=stages, swap=swap,
                      lut=1 if INTERPRETING else 3, tc=not INTERPRETING)


# ----------------------------------------------------------------------------- launchers

def _check_packed(packed):
    if not isinstance(packed, DevicePacked):
        raise ConfigError(f"packed must be a DevicePacked (DevicePacked.from_weight), got {type(packed).__name__}")


def _check_matrix(name: str, t, cols: int, packed: DevicePacked) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in FLOATS:
        raise ConfigError(f"{name} must be a float32, float16 or bfloat16 tensor, got "
                          f"{getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != 2 or t.shape[1] != cols:
        raise ConfigError(f"{name} of shape {tuple(t.shape)} must be (M, {cols}) for a weight of shape {packed.shape}")
    if t.device != packed.device:
        raise ConfigError(f"{name} is on {t.device} but the packed weight is on {packed.device}")
    if not t.is_contiguous():
        raise ConfigError(f"{name} must be contiguous (strides {t.stride()} for shape {tuple(t.shape)})")


def _launch_matmul(kernel, a, packed, M, R, Q, out_cols, config, op):
    """Shared launcher: a (M, R) @ (weight or its transpose) -> (M, out_cols), R reduced."""
    N, K = packed.shape
    if config is None and M and a.is_cuda:
        from . import nf4_rs, nf4_ws    # Gluon (Triton's lower-level language): imported where it may run
        if nf4_rs.supported(a, packed, op == "matmul_t"):
            return nf4_rs.nf4_rs_matmul(a, packed, op == "matmul_t")
        if nf4_ws.supported(a, packed, op == "matmul_t"):
            return nf4_ws.nf4_ws_matmul(a, packed, op == "matmul_t")
    cfg = config or default_config(op, M, N, K, a.dtype)
    cfg.check()
    out = torch.empty(M, out_cols, device=a.device, dtype=a.dtype)
    if M == 0:
        return out
    # Tiles along the reduced dimension: BK (in features) forward, BN (out features) backward.
    red_tile = cfg.bk if op == "matmul" else cfg.bn
    steps = -(-R // red_tile)
    split = min(cfg.split, steps)
    per = -(-steps // split)
    split = -(-steps // per)                        # no empty part
    part = torch.empty(split, M, out_cols, device=a.device, dtype=torch.float32) if split > 1 else out
    fast = K % 64 == 0 and cfg.bk % 64 == 0
    tiles = -(-M // cfg.bm) * -(-Q // (cfg.bn if op == "matmul" else cfg.bk))
    kernel[(tiles, split)](a, out, part, *packed._args(), M, N, K, STEPS_PER_SPLIT=per,
                           BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m, SPLIT=split,
                           FAST=fast, DQ=packed.double_quant, LUT=cfg.lut, SWAP=cfg.swap, TC=cfg.tc,
                           num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False,
                           **launch_options(a.device))
    if split > 1:
        sum_splits(part, out)
    return out


def nf4_matmul(x2d: torch.Tensor, packed: DevicePacked, config: TileConfig | None = None) -> torch.Tensor:
    """y (M, N) = x2d (M, K) @ W^T in x2d's dtype; FP32 accumulation, W decoded in the tile."""
    _check_packed(packed)
    N, K = packed.shape
    _check_matrix("x2d", x2d, K, packed)
    return _launch_matmul(_nf4_matmul_kernel, x2d, packed, x2d.shape[0], K, N, N, config, "matmul")


def nf4_matmul_t(g2d: torch.Tensor, packed: DevicePacked, config: TileConfig | None = None) -> torch.Tensor:
    """dx (M, K) = g2d (M, N) @ W in g2d's dtype (the input gradient of nf4_matmul)."""
    _check_packed(packed)
    N, K = packed.shape
    _check_matrix("g2d", g2d, N, packed)
    return _launch_matmul(_nf4_matmul_t_kernel, g2d, packed, g2d.shape[0], N, K, K, config, "matmul_t")


def nf4_embedding(packed: DevicePacked, ids: torch.Tensor, lut: int = 0) -> torch.Tensor:
    """ids (...) integer rows -> (..., K) float32, equal bit for bit to NF4Weight.dequantize_rows.

    Out-of-range ids raise ConfigError; checking them costs one device-to-host read, which a CUDA
    graph recording cannot contain, so replays do not check (training tokens come from data
    prepared with the model's own tokenizer, which the fine-tuning call verifies).
    """
    _check_packed(packed)
    N, K = packed.shape
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point() or ids.is_complex() \
            or ids.dtype == torch.bool:
        raise ConfigError(f"ids must be an integer tensor, got {ids!r:.80}")
    if ids.device != packed.device:
        raise ConfigError(f"ids are on {ids.device} but the packed weight is on {packed.device}")
    if lut not in (0, 1):
        raise ConfigError(f"lut={lut!r} is not one of (0, 1)")
    flat = ids.reshape(-1).to(torch.int64).contiguous()                 # (n_ids,)
    out = torch.empty(flat.numel(), K, device=ids.device, dtype=torch.float32)
    if flat.numel():
        if flat.device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            lo, hi = torch.aminmax(flat)
            lo, hi = int(lo), int(hi)
            if lo < 0 or hi >= N:
                raise ConfigError(f"ids span {lo} .. {hi}, outside 0 .. {N - 1} of a {packed.shape} weight")
        br, bc = 4, min(1024, _pow2_at_least(K, 16))
        grid = (-(-flat.numel() // br), -(-K // bc))
        _nf4_rows_kernel[grid](flat, out, *packed._args(), flat.numel(), K, BR=br, BC=bc,
                               DQ=packed.double_quant, LUT=lut, num_warps=4, enable_fp_fusion=False,
                               **launch_options(out.device))
    return out.reshape(*ids.shape, K)


DECODE_TILE = (16, 256, 4)     # rows, columns (a multiple of 64), warps


def nf4_decode(packed: DevicePacked, dtype: torch.dtype = torch.float32, left: int = 0, right: int = 0,
               below: int = 0, out: torch.Tensor | None = None, tile=DECODE_TILE) -> torch.Tensor:
    """The whole (N, K) weight in `dtype` on the device: NF4Weight.dequantize() rounded once to
    `dtype`, bit for bit (the matrix kernels' own tile decode, `tile` = (rows, columns, warps) a
    program; another tile for benchmarks, the same bits). With `left`, `right` and `below`:
    (N + below, left + K + right), the weight in rows [0, N) and columns [left, left + K), the others
    left for the caller to write. Into `out` when given: (N + below, left + K + right) in `dtype`, its
    rows at any stride (e.g. rows of a taller matrix)."""
    _check_packed(packed)
    if dtype not in FLOATS:
        raise ConfigError(f"dtype={dtype} is not one of float32, float16, bfloat16")
    N, K = packed.shape
    if out is None:
        out = torch.empty(N + below, left + K + right, device=packed.device, dtype=dtype)
    assert out.shape == (N + below, left + K + right) and out.dtype == dtype and out.stride(1) == 1
    br, bc, warps = tile
    _nf4_decode_kernel[(-(-N // br), -(-K // bc))](out[:, left:], out.stride(0), *packed._args(), N, K, BR=br, BC=bc,
                                                   FAST=K % 64 == 0, DQ=packed.double_quant,
                                                   LUT=1 if INTERPRETING else 3, num_warps=warps,
                                                   enable_fp_fusion=False, **launch_options(out.device))
    return out


# ----------------------------------------------------------------------------- autograd

class _FusedNF4Linear(torch.autograd.Function):
    """y = x @ W^T through a frozen packed W; backward returns the input gradient only."""

    @staticmethod
    def forward(ctx, x2d, packed):
        ctx.packed = packed
        return nf4_matmul(x2d, packed)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = nf4_matmul_t(grad_y.contiguous(), ctx.packed)
        return grad_x, None


class _DecodedNF4Linear(torch.autograd.Function):
    """y = x @ W^T through a frozen packed W decoded whole for each product (cuBLAS): a dense
    weight's bits. The decoded (N, K) buffer of x's dtype is freed after the product and made
    again for the input gradient, or with `kept` saved for it (a decode less, the buffer alive
    until backward)."""

    @staticmethod
    def forward(ctx, x2d, packed, kept):
        w = nf4_decode(packed, x2d.dtype)
        ctx.packed = None if kept else packed
        if kept:
            ctx.save_for_backward(w)
        return torch.nn.functional.linear(x2d, w)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_y):
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = ctx.saved_tensors[0] if ctx.packed is None else nf4_decode(ctx.packed, grad_y.dtype)
            grad_x = grad_y @ w
        return grad_x, None, None


def fused_nf4_linear(x: torch.Tensor, packed: DevicePacked, decoded: bool = False, kept: bool = False) -> torch.Tensor:
    """x (..., K) -> (..., N) = x @ W^T in x's dtype, with an input gradient: through the fused
    kernels (nf4_matmul, nf4_matmul_t), or with `decoded` through a whole decoded W and cuBLAS
    (with `kept` the forward's decoded W is kept for the input gradient, not decoded again)."""
    _check_packed(packed)
    N, K = packed.shape
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOATS:
        raise ConfigError("x must be a float32, float16 or bfloat16 tensor, got "
                          f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() == 0 or x.shape[-1] != K:
        raise ConfigError(f"x of shape {tuple(x.shape)} does not end in in_features={K} of a {packed.shape} weight")
    x2d = x.reshape(-1, K).contiguous()                               # (M, K), M = prod(x.shape[:-1])
    y = _DecodedNF4Linear.apply(x2d, packed, kept) if decoded else _FusedNF4Linear.apply(x2d, packed)
    return y.reshape(*x.shape[:-1], N)

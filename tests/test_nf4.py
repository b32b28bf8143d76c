"""NF4: bit-exact against bitsandbytes 0.50.2 on CPU, hand-built vectors, and nf4_linear vs dense.

Random inputs are fresh every run; each failure message carries the seed that reproduces it.
The bnb oracle tests skip (with the import error) only if bitsandbytes is missing: it is a test
dependency (`bitsandbytes==0.50.2`, runs on CPU).
"""
import os

import pytest
import torch

from aner.errors import ConfigError, FormatError
from aner.quant import nf4
from aner.quant.nf4 import (
    DYNAMIC8_CODEBOOK, NF4_BOUNDS, NF4_CODEBOOK, NF4Weight, dequantize_nf4, double_quantize, nf4_linear,
    quantize_dynamic8, quantize_nf4,
)

try:
    import bitsandbytes.functional as bnbF
    BNB_SKIP = None
except ImportError as e:    # not an excuse to pass: the skip reason shows in `pytest -ra`
    bnbF, BNB_SKIP = None, f"bitsandbytes==0.50.2 (test oracle) not importable: {e}"
needs_bnb = pytest.mark.skipif(BNB_SKIP is not None, reason=BNB_SKIP or "")

SHAPES = [(1823, 781), (7, 9), (64, 64), (576, 1536), (1, 3), (3, 1), (300, 257)]


def fresh():
    seed = int.from_bytes(os.urandom(4), "little")
    return seed, torch.Generator().manual_seed(seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 view: equality of bits, so -0.0 != 0.0 and nothing hides in ==."""
    return t.contiguous().view(torch.int32)


def ugly_weight(shape, g) -> torch.Tensor:
    """randn with per-row scales over 1e-3 .. 1e2, exact zeros, an all-zero block, outliers."""
    rows, cols = shape
    w = torch.randn(shape, generator=g) * 10 ** (torch.rand(rows, 1, generator=g) * 5 - 3)
    flat = w.view(-1)
    n = flat.numel()
    flat[torch.randint(0, n, (max(1, n // 50),), generator=g)] = 0.0
    flat[torch.randint(0, n, (3,), generator=g)] *= 1e4
    if n >= 3 * 64:
        flat[64:128] = 0.0          # one whole NF4 block of zeros: absmax 0
    return w


def bnb_quantize(w, double_quant):
    q, state = bnbF.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=double_quant)
    ref = bnbF.dequantize_4bit(q, state, quant_type="nf4")
    return q.reshape(-1), state, ref.reshape(w.shape)   # bnb returns (1, n) for n <= 2 elements


# ----------------------------------------------------------------------------- codebooks

@needs_bnb
def test_codebooks_equal_bnb():
    from bitsandbytes.backends.utils import CODE
    assert torch.equal(bits(NF4_CODEBOOK), bits(bnbF.get_4bit_type("nf4", device="cpu")))
    assert torch.equal(bits(NF4_CODEBOOK), bits(CODE["nf4"].cpu()))
    assert torch.equal(bits(DYNAMIC8_CODEBOOK), bits(bnbF.create_dynamic_map(signed=True)))


def test_codebooks_by_hand():
    assert NF4_CODEBOOK.dtype == torch.float32 and NF4_CODEBOOK.shape == (16,)
    assert (NF4_CODEBOOK[0], NF4_CODEBOOK[7], NF4_CODEBOOK[15]) == (-1.0, 0.0, 1.0)
    assert torch.all(NF4_CODEBOOK[1:] > NF4_CODEBOOK[:-1])
    assert DYNAMIC8_CODEBOOK.shape == (256,) and torch.all(DYNAMIC8_CODEBOOK[1:] > DYNAMIC8_CODEBOOK[:-1])
    # smallest is -(1 - 0.9/128), not -1; 1.0 and 0.0 are present; 127 values each side of 0
    assert DYNAMIC8_CODEBOOK[0].item() == pytest.approx(-0.99296875, abs=1e-7)
    assert DYNAMIC8_CODEBOOK[-1] == 1.0 and (DYNAMIC8_CODEBOOK == 0).sum() == 1
    assert (DYNAMIC8_CODEBOOK < 0).sum() == 127 and (DYNAMIC8_CODEBOOK > 0).sum() == 128


# ----------------------------------------------------------------------------- hand vectors

def test_nibble_order_and_odd_padding_by_hand():
    codes, absmax = quantize_nf4(torch.tensor([[1.0, -1.0, 0.0]]))
    # indices 15, 0, 7 and a pad nibble 7 (the code of 0.0); first element in the HIGH nibble
    assert codes.tolist() == [0xF0, 0x77]
    assert absmax.tolist() == [1.0]
    assert nf4.unpack_nibbles(codes, 3).tolist() == [15, 0, 7]


def test_codebook_values_round_trip_exactly():
    w = (NF4_CODEBOOK * 2.5).repeat(8).reshape(2, 64)     # two full blocks, absmax 2.5
    codes, absmax = quantize_nf4(w)
    assert nf4.unpack_nibbles(codes, 128).tolist() == list(range(16)) * 8
    assert torch.equal(bits(dequantize_nf4(codes, absmax, (2, 64))), bits(w))


def test_midpoint_tie_goes_to_lower_code():
    # A full block with absmax 1 scales by 1 / 1 = 1 exactly, so these values are compared as is.
    lo, hi = NF4_BOUNDS[7], torch.nextafter(NF4_BOUNDS[7], torch.tensor(1.0))
    w = torch.zeros(1, 64)
    w[0, :3] = torch.stack([torch.tensor(1.0), lo, hi])
    idx = nf4.unpack_nibbles(quantize_nf4(w)[0], 64)
    assert idx[:3].tolist() == [15, 7, 8]


def test_zero_blocks_by_hand():
    # A full zero block stores absmax 0; bnb clamps only the partial last block's absmax (1e-38).
    codes, absmax = quantize_nf4(torch.zeros(1, 64 + 5))
    assert absmax[0] == 0.0 and absmax[1] == torch.tensor(1e-38, dtype=torch.float32)
    assert nf4.unpack_nibbles(codes, 69).tolist() == [7] * 69
    assert torch.equal(dequantize_nf4(codes, absmax, (1, 69)), torch.zeros(1, 69))


def test_dynamic8_snaps_to_the_65536_point_grid():
    # bnb CPU maps v (scale 1) to grid point trunc((v + 1) * 32767.5 + 0.5). For v = 1e-6 and for
    # v = 0 that is point 32768 = -1 + 65536/65535 = +1.526e-5 (the grid has no 0), whose nearest
    # code is 0.2125e-4 (index 131): an exact 0 does not come back as 0, and 1e-6 does not get
    # its own nearest code 0.55e-6. -1 goes to the smallest code, -0.99297.
    codes, scales = quantize_dynamic8(torch.tensor([1.0, 1e-6, -1.0, 0.0]))
    assert scales.tolist() == [1.0]
    assert codes.tolist() == [255, 131, 0, 131]
    assert DYNAMIC8_CODEBOOK[131].item() == pytest.approx(0.2125e-4, rel=1e-6)
    assert (DYNAMIC8_CODEBOOK - 1e-6).abs().argmin() != 131


# ----------------------------------------------------------------------------- bnb oracle

@needs_bnb
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_bit_exact_vs_bnb(shape, double_quant):
    seed, g = fresh()
    w = ugly_weight(shape, g)
    q, state, ref = bnb_quantize(w, double_quant)
    ours = NF4Weight.quantize(w, double_quant=double_quant)
    msg = f"seed={seed} shape={shape} double_quant={double_quant}"
    assert torch.equal(ours.codes, q), msg          # same packed bytes, so same nibble order
    if double_quant:
        assert torch.equal(ours.absmax_codes, state.absmax), msg
        assert torch.equal(bits(ours.absmax_scales), bits(state.state2.absmax)), msg
        assert torch.equal(bits(ours.absmax_offset.reshape(1)), bits(state.offset.reshape(1))), msg
    else:
        assert torch.equal(bits(ours.absmax), bits(state.absmax)), msg
        assert torch.equal(bits(dequantize_nf4(ours.codes, ours.absmax, shape)), bits(ref)), msg
    assert torch.equal(bits(ours.dequantize()), bits(ref)), msg


def test_double_quant_offset_is_the_same_on_any_number_of_threads():
    # torch's own mean of 2**18 absmax values sums one part a thread: its rounding differs between
    # 1, 2, 3 and 5 threads in most draws, so in one of 16 draws all but surely
    seed, g = fresh()
    absmax = torch.rand(16, 1 << 18, generator=g) * 10 ** (torch.rand(16, 1 << 18, generator=g) * 4 - 2)
    threads = torch.get_num_threads()
    offsets = []
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            offsets.append(torch.stack([double_quantize(a)[2] for a in absmax]))
    finally:
        torch.set_num_threads(threads)
    for o in offsets[1:]:
        assert torch.equal(bits(o), bits(offsets[0])), f"seed={seed}"


@needs_bnb
def test_constant_magnitude_gives_zero_nested_scale_vs_bnb():
    # Every block has absmax 1, so the centred absmax is all 0: dynamic8 scale 0, code 0.
    seed, g = fresh()
    w = torch.where(torch.rand(40, 64 * 3, generator=g) < 0.5, -1.0, 1.0)
    q, state, ref = bnb_quantize(w, True)
    ours = NF4Weight.quantize(w)
    assert ours.absmax_scales.tolist() == [0.0], seed
    assert torch.equal(ours.absmax_codes, state.absmax), seed
    assert torch.equal(bits(ours.dequantize()), bits(ref)), seed


@needs_bnb
def test_dynamic8_hand_vector_vs_bnb():
    x = torch.tensor([1.0, 1e-6, -1.0, 0.0])
    ref_codes, _ = torch.ops.bitsandbytes.quantize_blockwise.default(
        x, bnbF.create_dynamic_map(signed=True), 256)
    assert ref_codes.tolist() == quantize_dynamic8(x)[0].tolist() == [255, 131, 0, 131]


def ulp_walk(v: torch.Tensor, steps: int) -> torch.Tensor:
    """v and its neighbours up to `steps` float32 ulps either side."""
    out = [v]
    for direction in (1e30, -1e30):
        u = v
        for _ in range(steps):
            u = torch.nextafter(u, torch.full_like(u, direction))
            out.append(u)
    return torch.cat(out)


def in_blocks(values: torch.Tensor, lead: float, block: int) -> torch.Tensor:
    """Blocks of `block` elements, each led by `lead` (so the block absmax is lead), zero padded."""
    per = block - 1
    values = torch.cat([values, values.new_zeros(-values.numel() % per)]).reshape(-1, per)
    return torch.cat([torch.full((values.shape[0], 1), lead), values], dim=1).reshape(-1)


@needs_bnb
def test_nf4_midpoint_neighbours_vs_bnb():
    # Values within 4 ulps of midpoint * absmax, for absmax values with an inexact reciprocal:
    # there bnb's x * (1/absmax) (full blocks) and x / absmax (partial last block) pick
    # different codes, so this checks both roundings, not just the thresholds.
    parts, disagree = [], 0
    for a in (3.0, 0.7, 1.3):
        near = ulp_walk(NF4_BOUNDS * a, 4)
        a32 = torch.tensor(a)
        disagree += int((torch.bucketize(near * (1.0 / a32), NF4_BOUNDS)
                         != torch.bucketize(near / a32, NF4_BOUNDS)).sum())
        parts.append(in_blocks(near, a, 64))
    tail = torch.cat([torch.tensor([3.0]), ulp_walk(NF4_BOUNDS * 3.0, 1)[:40]])  # partial block
    w = torch.cat(parts + [tail]).reshape(1, -1)
    assert disagree >= 10 and w.numel() % 64 == 41      # found the cases it means to test
    q, state, ref = bnb_quantize(w, False)
    codes, absmax = quantize_nf4(w)
    assert torch.equal(codes, q) and torch.equal(bits(absmax), bits(state.absmax))
    assert torch.equal(bits(dequantize_nf4(codes, absmax, w.shape)), bits(ref))


@needs_bnb
def test_dynamic8_vs_bnb_quantize_blockwise_near_grid_boundaries():
    # Values within 3 ulps of scale * ((k - 1/2) / 32767.5 - 1), where the grid index rounds, for
    # scales 1 (exact), 3 and 0.7 (inexact reciprocals: x * (1/s) and x / s differ there), plus
    # random values in a partial tail block. All 65534 boundaries: a random subset of a few
    # thousand sometimes holds no x * (1/s) vs x / s disagreement at all (there are 60 in all).
    seed, g = fresh()
    k = torch.arange(1, 65535).double()
    edge = ((k - 0.5) / 32767.5 - 1.0).float()
    parts, disagree = [], 0
    for s in (1.0, 3.0, 0.7):
        near = ulp_walk(edge * s, 3)
        s32 = torch.tensor(s)
        disagree += int((quantize_dynamic8(in_blocks(near * (1.0 / s32), 1.0, 256))[0]
                         != quantize_dynamic8(in_blocks(near / s32, 1.0, 256))[0]).sum())
        parts.append(in_blocks(near, s, 256))
    x = torch.cat(parts + [torch.randn(1000, generator=g) * 0.01])
    assert disagree >= 50, f"only {disagree} values where x * (1/s) and x / s pick different codes"
    ref_codes, ref_scales = torch.ops.bitsandbytes.quantize_blockwise.default(
        x, bnbF.create_dynamic_map(signed=True), 256)
    codes, scales = quantize_dynamic8(x)
    assert torch.equal(bits(scales), bits(ref_scales)), seed
    mismatch = (codes != ref_codes).nonzero().reshape(-1)
    assert mismatch.numel() == 0, f"seed={seed}: {mismatch.numel()} codes differ, first at {mismatch[:5].tolist()}"


# ----------------------------------------------------------------------------- weight type

@pytest.mark.parametrize("double_quant", [False, True])
def test_dequantize_rows_equal_full_rows(double_quant):
    seed, g = fresh()
    w = ugly_weight((300, 257), g)        # 257 columns: rows start and end inside 64-blocks
    weight = NF4Weight.quantize(w, double_quant=double_quant)
    ids = torch.randint(0, 300, (3, 5), generator=g)
    ids[0, 0], ids[0, 1], ids[0, 2] = 0, 299, 299    # first, last, a repeat
    got = weight.dequantize_rows(ids)
    assert got.shape == (3, 5, 257)
    assert torch.equal(bits(got), bits(weight.dequantize()[ids])), seed
    with pytest.raises(ConfigError, match="300"):
        weight.dequantize_rows(torch.tensor([300]))
    with pytest.raises(ConfigError):
        weight.dequantize_rows(torch.tensor([0.0]))


@pytest.mark.parametrize("double_quant", [False, True])
def test_tensors_round_trip_through_safetensors(tmp_path, double_quant):
    from safetensors.torch import load_file, save_file
    seed, g = fresh()
    weight = NF4Weight.quantize(ugly_weight((7, 9), g), double_quant=double_quant)
    save_file({f"layers.0.q.{k}": v for k, v in weight.tensors().items()}, tmp_path / "w.safetensors")
    loaded = load_file(tmp_path / "w.safetensors")
    back = NF4Weight.from_tensors({k.removeprefix("layers.0.q."): v for k, v in loaded.items()})
    assert back.shape == (7, 9) and back.double_quant == double_quant
    assert all(torch.equal(a, b) for a, b in zip(back._owned(), weight._owned()))
    assert torch.equal(bits(back.dequantize()), bits(weight.dequantize())), seed


def test_from_tensors_rejects_malformed():
    good = NF4Weight.quantize(torch.randn(7, 9)).tensors()
    with pytest.raises(FormatError, match="keys"):
        NF4Weight.from_tensors({k: v for k, v in good.items() if k != "absmax_scales"})
    with pytest.raises(FormatError, match="version"):
        NF4Weight.from_tensors({**good, "nf4_version": torch.tensor(2)})
    with pytest.raises(FormatError, match="codes"):
        NF4Weight.from_tensors({**good, "codes": good["codes"][:-1]})
    with pytest.raises(FormatError, match="absmax_scales"):
        NF4Weight.from_tensors({**good, "absmax_scales": good["absmax_scales"].double()})


def test_nbytes_of_smollm2_shapes():
    # codes n/2 + absmax codes n/64 + fp32 scales ceil(n/64/256) * 4 + fp32 offset 4
    expected = {(576, 576): 171160, (192, 576): 57056, (1536, 576): 456412,
                (576, 1536): 456412, (49152, 576): 14605060}
    for shape, nbytes in expected.items():
        n = shape[0] * shape[1]
        blocks = -(-n // 64)
        assert nbytes == n // 2 + blocks + -(-blocks // 256) * 4 + 4
        assert NF4Weight.quantize(torch.randn(shape)).nbytes() == nbytes
    assert NF4Weight.quantize(torch.randn(576, 576), double_quant=False).nbytes() == 165888 + 5184 * 4


def test_bad_input_raises_config_error():
    with pytest.raises(ConfigError, match="2-D"):
        NF4Weight.quantize(torch.randn(64))
    with pytest.raises(ConfigError, match="non-finite"):
        NF4Weight.quantize(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ConfigError, match="dtype"):
        NF4Weight.quantize(torch.ones(2, 2, dtype=torch.int32))
    with pytest.raises(ConfigError, match="block"):
        quantize_nf4(torch.randn(2, 64), block=48)
    weight = NF4Weight.quantize(torch.randn(4, 8))
    with pytest.raises(ConfigError, match="in_features=8"):
        nf4_linear(torch.randn(2, 7), weight)
    with pytest.raises(ConfigError, match="float32"):
        nf4_linear(torch.randn(2, 8, dtype=torch.float64), weight)
    with pytest.raises(ConfigError, match="tile_bytes"):
        nf4_linear(torch.randn(2, 8), weight, tile_bytes=0)


# ----------------------------------------------------------------------------- nf4_linear

# Measured (this CPU, torch 2.13): the tiled forward equals the dense fp32 x @ W^T bit for bit
# for 576x1536 and 49152x576 at the default tile, and is up to 1e-6 apart (about 2e-7 of
# |x| @ |W|^T) for 1823x781; the tiled input gradient is within ~2e-7 of |g| @ |W| of float64,
# as is the dense fp32 one. The tolerance below, 1e-5 of the absolute product against a float64
# reference, is 50x that and far below the error of one wrong NF4 code (~0.1 of it).
REL = 1e-5


def assert_within(got, ref64, scale64, what):
    err = (got.double() - ref64).abs()
    worst = (err / scale64.clamp(min=1e-30)).max().item()
    assert worst <= REL, f"{what}: error {worst:.2e} of |a| @ |b| (allowed {REL:.0e})"


@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_linear_forward_and_input_grad_with_many_tiles(monkeypatch, double_quant):
    seed, g = fresh()
    out_f, in_f = 1823, 781
    weight = NF4Weight.quantize(ugly_weight((out_f, in_f), g) * 1e-2, double_quant=double_quant)
    dense = weight.dequantize().double()                           # (out, in)
    tile_rows = 7                                                  # 1823 = 260 * 7 + 3: partial last
    tile_bytes = 4 * in_f * tile_rows + 5
    calls = []
    decode_rows = NF4Weight.decode_rows
    monkeypatch.setattr(NF4Weight, "decode_rows",
                        lambda self, a, b: calls.append((a, b)) or decode_rows(self, a, b))

    x = torch.randn(2, 3, in_f, generator=g, requires_grad=True)   # (B, T, in)
    y = nf4_linear(x, weight, tile_bytes=tile_bytes)
    assert y.shape == (2, 3, out_f)
    x2 = x.detach().double().reshape(-1, in_f)
    assert_within(y.reshape(-1, out_f), x2 @ dense.t(), x2.abs() @ dense.abs().t(), f"forward seed={seed}")

    gy = torch.randn(y.shape, generator=g)
    y.backward(gy)
    g2 = gy.double().reshape(-1, out_f)
    assert_within(x.grad.reshape(-1, in_f), g2 @ dense, g2.abs() @ dense.abs(), f"grad_x seed={seed}")

    tiles = [(a, min(a + tile_rows, out_f)) for a in range(0, out_f, tile_rows)]
    assert len(tiles) == 261 and tiles[-1] == (1820, 1823)
    assert calls == tiles + tiles          # forward then backward; never the whole matrix at once


def test_nf4_linear_default_tile_and_1d_input():
    seed, g = fresh()
    weight = NF4Weight.quantize(torch.randn(576, 1536, generator=g) * 0.02)
    dense = weight.dequantize()
    x = torch.randn(1536, generator=g, requires_grad=True)
    y = nf4_linear(x, weight)
    assert y.shape == (576,)
    d64, x64 = dense.double(), x.detach().double()
    assert_within(y, d64 @ x64, d64.abs() @ x64.abs(), f"forward seed={seed}")
    gy = torch.randn(576, generator=g)
    y.backward(gy)
    assert_within(x.grad, gy.double() @ d64, gy.double().abs() @ d64.abs(), f"grad_x seed={seed}")
    assert not weight.codes.requires_grad and weight.codes.grad is None

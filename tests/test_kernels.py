"""Fused NF4 Triton kernels (aner.kernels.nf4) against the pure-torch references.

Runs on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) with a
reduced grid of small shapes; skips otherwise (`make test` runs it under the interpreter).
Oracle: float64 matmul of NF4Weight.dequantize(); embedding rows bit-exact vs dequantize_rows.
Tolerances, relative to |x| @ |W|^T (resp. |g| @ |W|): FP32 1e-5, FP16 2e-3, BF16 1e-2 (the
weight is rounded to the input dtype and the output is rounded once; accumulation is FP32).
"""
import dataclasses
import functools

import pytest
import torch

from kernel_device import INTERPRET, device_or_skip

DEV = device_or_skip()

from aner.errors import ConfigError  # noqa: E402
from aner.kernels import nf4 as K  # noqa: E402
from aner.quant.nf4 import NF4_CODEBOOK, NF4Weight, unpack_nibbles  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
gpu_only = pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="GPU only (too slow interpreted)")

if INTERPRET:
    # The interpreter runs every program in numpy: small shapes only. Its bf16 x bf16 tl.dot is
    # wrong (numpy has no bf16), so BF16 matmuls are checked on the GPU only.
    SHAPES = [(64, 100), (1, 64), (3, 130), (130, 192)]
    TOKENS = [1, 7, 128]
    DTYPES = [torch.float32, torch.float16]
else:
    SHAPES = [(1823, 781), (49152, 576), (576, 576), (64, 100), (1, 64), (3, 130)]
    TOKENS = [1, 7, 128, 1000]
    DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@functools.lru_cache(maxsize=None)
def packed(shape, double_quant):
    """(NF4Weight, DevicePacked with the transposed copy where it is made, dequantized float64 W on
    DEV); fresh random weights each run."""
    w = NF4Weight.quantize(torch.randn(*shape) * 0.02, double_quant=double_quant)
    return w, K.DevicePacked.from_weight(w, DEV, transposed=True), w.dequantize().to(DEV, torch.float64)


def randn(*shape, dtype):
    return torch.randn(*shape, device=DEV).to(dtype)


def poison(*shape, dtype):
    """Leave a NaN-filled block in the caching allocator, so the next output the launcher
    allocates of this size starts as NaN rather than as an earlier correct result."""
    t = torch.full(shape, float("nan"), device=DEV, dtype=dtype)
    del t


def check_close(got, want64, scale64, dtype, a):
    """|got - want| <= TOL * scale, plus for FP16 the underflow of its subnormal range: half a
    subnormal step (2^-25) for the output and for each weight times |a_k| (a: the left operand)."""
    assert got.dtype == dtype and got.shape == want64.shape
    assert torch.isfinite(got).all()
    err = (got.double() - want64).abs()
    floor = 2.0 ** -25 * (1 + a.double().abs().sum(1, keepdim=True)) if dtype == torch.float16 else 0
    bound = TOL[dtype] * scale64 + floor + 1e-30
    assert (err <= bound).all(), f"max rel err {(err / bound).max().item() * TOL[dtype]:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "dq"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("M", TOKENS)
def test_forward_and_input_grad(M, shape, double_quant, dtype):
    N, Kin = shape
    _, p, W = packed(shape, double_quant)
    x = randn(2, M, Kin, dtype=dtype)[1]                 # (M, K): a view into fresh data
    g = randn(M, N, dtype=dtype)
    xa, ga = x.double().abs(), g.double().abs()

    poison(M, N, dtype=dtype)
    check_close(K.nf4_matmul(x.contiguous(), p), x.double() @ W.t(), xa @ W.abs().t(), dtype, x)
    poison(M, Kin, dtype=dtype)
    check_close(K.nf4_matmul_t(g, p), g.double() @ W, ga @ W.abs(), dtype, g)

    # Through autograd, with a leading batch dimension: forward = nf4_matmul, backward = _t.
    x3 = x.reshape(1, M, Kin).clone().requires_grad_(True)
    y = K.fused_nf4_linear(x3, p)
    assert y.shape == (1, M, N) and y.dtype == dtype
    y.backward(g.reshape(1, M, N))
    check_close(y.detach()[0], x.double() @ W.t(), xa @ W.abs().t(), dtype, x)
    check_close(x3.grad[0], g.double() @ W, ga @ W.abs(), dtype, g)


def here(config):
    """The config as this device runs it: the interpreter cannot run lut 2 or 3 (inline PTX) and
    gets BF16 products wrong (FP32 operands take FMAs there, tc=False)."""
    return dataclasses.replace(config, lut=min(config.lut, 1), tc=False) if INTERPRET else config


# Every launcher option the benchmark may pick: split-K, each codebook lookup, swapped operands,
# BK below 64 (general decode on a K % 64 == 0 weight) and odd tile shapes.
CONFIGS = [here(c) for c in (
    K.TileConfig(bm=16, bn=32, bk=64, split=2, lut=1),
    K.TileConfig(bm=32, bn=64, bk=64, split=3, lut=0, swap=True),
    K.TileConfig(bm=16, bn=16, bk=32, split=1, lut=1, swap=True, group_m=2),
    K.TileConfig(bm=64, bn=16, bk=128, split=4, num_warps=8, num_stages=2),
    K.TileConfig(bm=32, bn=32, bk=64, split=2, lut=2, swap=True),
    K.TileConfig(bm=32, bn=32, bk=64, split=2, tc=False),          # FP32 operands: multiply-adds
)]


def every_code_byte(double_quant):
    """A (64, 256) NF4Weight whose 4096 code bytes take every value 16 times, spread over every
    position of a 32-byte block."""
    N, Kin = 64, 256
    w = NF4Weight.quantize(torch.randn(N, Kin) * 0.02, double_quant=double_quant)
    codes = (torch.arange(N * Kin // 2) * 97 + torch.arange(N * Kin // 2) // 256) % 256
    return dataclasses.replace(w, codes=codes.to(torch.uint8))


@pytest.mark.parametrize("lut", [0, 1] if INTERPRET else [0, 1, 2, 3])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "dq"])
def test_decode_is_exact_for_every_code_byte(double_quant, dtype, lut):
    """Every code byte in every position of a 32-byte NF4 block: multiplying by an identity
    reads the decoded weight back (each output is one product by 1 plus exact zeros), which
    must equal NF4Weight.dequantize() rounded to the dtype, bit for bit, both ways round."""
    w = every_code_byte(double_quant)
    (N, Kin), p, want = w.shape, K.DevicePacked.from_weight(w, DEV), w.dequantize().to(DEV, dtype)
    for bk in (64, 128):
        cfg = here(K.TileConfig(bm=16 if INTERPRET else 64, bn=32, bk=bk, lut=lut, num_warps=4, num_stages=2))
        wt = K.nf4_matmul(torch.eye(Kin, device=DEV, dtype=dtype), p, config=cfg)     # (K, N) = W^T
        assert torch.equal(wt.t(), want), f"bk={bk}: {(wt.t() != want).sum().item()} elements differ"
        cfg = dataclasses.replace(cfg, bn=bk, bk=64)
        wn = K.nf4_matmul_t(torch.eye(N, device=DEV, dtype=dtype), p, config=cfg)     # (N, K) = W
        assert torch.equal(wn, want), f"transposed bn={bk}: {(wn != want).sum().item()} elements differ"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "dq"])
@pytest.mark.parametrize("shape", [*SHAPES, "every code byte"],
                         ids=lambda s: s if isinstance(s, str) else f"{s[0]}x{s[1]}")
def test_whole_weight_decode_is_exact(shape, double_quant, dtype):
    """nf4_decode writes NF4Weight.dequantize() rounded to the dtype, bit for bit: the fast
    decode (K % 64 == 0) and the general one, partial tiles and blocks across rows, at two program
    tiles; with columns to spare on either side, the same bits between them, and the spare columns
    untouched."""
    if shape == "every code byte":
        w = every_code_byte(double_quant)
        p = K.DevicePacked.from_weight(w, DEV)
    else:
        w, p, _ = packed(shape, double_quant)
    poison(*w.shape, dtype=dtype)
    got = K.nf4_decode(p, dtype)
    assert got.shape == w.shape and torch.equal(got.cpu(), w.dequantize().to(dtype))
    assert torch.equal(K.nf4_decode(p, dtype, tile=(32, 512, 8)), got)      # another program tile
    N, Kin = w.shape
    poison(N, 24 + Kin + 48, dtype=dtype)
    wide = K.nf4_decode(p, dtype, 24, 48)
    assert wide.shape == (N, 24 + Kin + 48) and torch.equal(wide[:, 24:24 + Kin], got)
    if DEV == "cuda":       # the caching allocator handed back the poisoned block
        assert wide[:, :24].isnan().all() and wide[:, 24 + Kin:].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 100), (130, 192)] if INTERPRET else [(1823, 781), (49152, 576)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_decoded_linear_is_the_dense_product_of_the_decoded_weight(shape, dtype):
    """decoded=True: forward and input gradient are the bits of the same products with the dense
    weight NF4Weight.dequantize() rounded to the dtype."""
    N, Kin = shape
    w, p, _ = packed(shape, True)
    dense = w.dequantize().to(DEV, dtype)
    x = randn(2, 37, Kin, dtype=dtype).requires_grad_(True)
    ref_x = x.detach().clone().requires_grad_(True)
    y, ref = K.fused_nf4_linear(x, p, decoded=True), torch.nn.functional.linear(ref_x, dense)
    assert y.dtype == dtype and torch.equal(y, ref)
    g = randn(2, 37, N, dtype=dtype)
    y.backward(g)
    ref.backward(g)
    assert torch.equal(x.grad, ref_x.grad)


@pytest.mark.parametrize("config", CONFIGS,
                         ids=lambda c: f"{c.bm}x{c.bn}x{c.bk}s{c.split}l{c.lut}w{int(c.swap)}t{int(c.tc)}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(64, 100), (96, 192)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_explicit_configs(config, dtype, shape):
    N, Kin = shape
    _, p, W = packed(shape, True)
    M = 37
    x, g = randn(M, Kin, dtype=dtype), randn(M, N, dtype=dtype)
    check_close(K.nf4_matmul(x, p, config=config), x.double() @ W.t(), x.double().abs() @ W.abs().t(), dtype, x)
    check_close(K.nf4_matmul_t(g, p, config=config), g.double() @ W, g.double().abs() @ W.abs(), dtype, g)


# The faster benchmark variants (256-token tiles and/or the decoded weight as MMA operand A),
# paired as (forward, input gradient), on tiles that are partial along every dimension: the
# token count is not a multiple of bm, N not of bn, K not of bk; split 2 adds a fully masked
# last step where the step count is odd. FP16/BF16 only (FP32 tiles of 256 exceed shared memory);
# default_config() picks the 256-token swap pair from 256 tokens on (the forward at 4 stages, which
# the double-quantized general decode's tiles do not fit in shared memory: 3 here).
FAST_PAIRS = [tuple(map(here, p)) for p in (
    (K.TileConfig(256, 128, 64, num_warps=8, num_stages=3, swap=True),
     K.TileConfig(256, 64, 64, num_warps=4, num_stages=3, swap=True)),
    (K.TileConfig(256, 128, 64, num_warps=8, num_stages=3, swap=True),
     K.TileConfig(256, 64, 128, num_warps=8, num_stages=3, swap=True)),
    (K.TileConfig(256, 128, 64, num_warps=8, num_stages=3),
     K.TileConfig(256, 64, 128, num_warps=8, num_stages=3)),
    (K.TileConfig(128, 128, 64, num_warps=8, num_stages=3, swap=True),
     K.TileConfig(128, 64, 128, num_warps=8, num_stages=3, swap=True)),
    (K.TileConfig(256, 128, 64, split=2, num_warps=8, num_stages=3, swap=True),
     K.TileConfig(256, 64, 64, split=2, num_warps=4, num_stages=3, swap=True)),
)]
if INTERPRET:
    PARTIAL = [((130, 192), 300), ((64, 100), 7)]      # K % 64 == 0 (fast decode) and general
else:
    PARTIAL = [((576, 576), 1000), ((1823, 781), 1000), ((1823, 781), 7), ((3, 130), 1000)]


@pytest.mark.parametrize("pair", FAST_PAIRS, ids=lambda p: "-".join(
    f"{c.bm}x{c.bn}x{c.bk}w{c.num_warps}{'-swap' * c.swap}-split{c.split}" for c in p))
@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "dq"])
@pytest.mark.parametrize("shape_m", PARTIAL, ids=lambda s: f"{s[0][0]}x{s[0][1]}-M{s[1]}")
def test_fast_variants_partial_tiles(shape_m, double_quant, dtype, pair):
    (N, Kin), M = shape_m
    _, p, W = packed((N, Kin), double_quant)
    x, g = randn(M, Kin, dtype=dtype), randn(M, N, dtype=dtype)
    poison(M, N, dtype=dtype)
    check_close(K.nf4_matmul(x, p, config=pair[0]), x.double() @ W.t(), x.double().abs() @ W.abs().t(), dtype, x)
    poison(M, Kin, dtype=dtype)
    check_close(K.nf4_matmul_t(g, p, config=pair[1]), g.double() @ W, g.double().abs() @ W.abs(), dtype, g)


HOPPER = not INTERPRET and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not HOPPER, reason="Hopper GPU only (the warp-specialized kernels)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "dq"])
@pytest.mark.parametrize("shape_m", [((4096, 4096), 2048), ((1000, 1024), 4500), ((2048, 64), 4096),
                                     ((136, 4096), 8192), ((49152, 576), 1000), ((576, 576), 8200)],
                         ids=lambda s: f"{s[0][0]}x{s[0][1]}-M{s[1]}")
def test_warp_specialized_products(shape_m, double_quant, dtype):
    """The default products where the Gluon kernels take them (nf4_rs both ways where the transposed
    copy is made, else nf4_ws): tiles partial along every dimension, one step (K = 64) and an odd
    number of steps (N = 136 and 576 backward), several tiles a program."""
    from aner.kernels import nf4_rs, nf4_ws
    (N, Kin), M = shape_m
    _, p, W = packed((N, Kin), double_quant)
    x, g = randn(M, Kin, dtype=dtype), randn(M, N, dtype=dtype)
    taken = [nf4_ws.supported(x, p, False), nf4_ws.supported(g, p, True)]
    assert (p.codes_t is not None) == (N % 64 == 0 and Kin % 64 == 0)
    assert any(taken)
    for trans, a, want, scale, rows in [(False, x, x.double() @ W.t(), x.double().abs() @ W.abs().t(), N),
                                        (True, g, g.double() @ W, g.double().abs() @ W.abs(), Kin)]:
        assert nf4_rs.supported(a, p, trans) == (taken[trans] and p.codes_t is not None)
        if not taken[trans]:
            continue
        poison(M, rows, dtype=dtype)
        y = K.nf4_matmul_t(a, p) if trans else K.nf4_matmul(a, p)
        check_close(y, want, scale, dtype, a)
        assert torch.equal(y, K.nf4_matmul_t(a, p) if trans else K.nf4_matmul(a, p))
        # the other kernel's persistent grid, and one tile a program: every output summed in the same
        # order, to the same bits
        assert torch.equal(y, nf4_ws.nf4_ws_matmul(a, p, trans, programs=K.MULTIPROCESSORS))
        if nf4_rs.supported(a, p, trans):
            assert torch.equal(y, nf4_rs.nf4_rs_matmul(a, p, trans, programs=None))


@gpu_only
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1823, 781), (2048, 2048)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_many_tokens(shape, dtype):
    N, Kin = shape
    _, p, W = packed(shape, True)
    x, g = randn(4096, Kin, dtype=dtype), randn(4096, N, dtype=dtype)
    check_close(K.nf4_matmul(x, p), x.double() @ W.t(), x.double().abs() @ W.abs().t(), dtype, x)
    check_close(K.nf4_matmul_t(g, p), g.double() @ W, g.double().abs() @ W.abs(), dtype, g)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("M", [7, 40] if INTERPRET else [7, 128, 2048])
def test_deterministic(M, dtype):
    """Two calls give bitwise identical results (M=7 takes the split-K path)."""
    shape = (192, 576) if INTERPRET else (4096, 4096)
    _, p, _ = packed(shape, True)
    x, g = randn(M, shape[1], dtype=dtype), randn(M, shape[0], dtype=dtype)
    assert torch.equal(K.nf4_matmul(x, p), K.nf4_matmul(x, p))
    assert torch.equal(K.nf4_matmul_t(g, p), K.nf4_matmul_t(g, p))


@pytest.mark.parametrize("lut", [0, 1])
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "dq"])
@pytest.mark.parametrize("shape", [(1823, 781), (64, 100), (3, 130), (49152, 576)] if not INTERPRET
                         else [(1823, 781), (64, 100), (3, 130)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_embedding_bit_exact(shape, double_quant, lut):
    w, p, _ = packed(shape, double_quant)
    N = shape[0]
    ids = torch.randint(0, N, (3, 5))
    ids[0, 0], ids[-1, -1] = 0, N - 1
    poison(15, shape[1], dtype=torch.float32)
    rows = K.nf4_embedding(p, ids.to(DEV), lut=lut)
    assert rows.shape == (3, 5, shape[1]) and rows.dtype == torch.float32
    assert torch.equal(rows.cpu(), w.dequantize_rows(ids))


@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "dq"])
def test_transposed_copy(double_quant):
    """The input gradient's transposed copy holds W^T's codes and each element's block absmax, each in
    the order the kernel's threads read them: its values are dequantize()'s transposed, bit for bit;
    the device copy counts its bytes."""
    w = NF4Weight.quantize(torch.randn(192, 128) * 0.02, double_quant=double_quant)
    (N, Kin), n = w.shape, torch.arange(192)
    codes_t, absmax_t = K.transposed_copy(w, w.codes)
    assert codes_t.shape == (N * Kin // 2,) and absmax_t.shape == (Kin // 64, N)
    idx = unpack_nibbles(codes_t, N * Kin).view(Kin, N).long()
    # column n = 64 j + 8 word + 2 t + e of each row of blocks: its code stored at 64 j + 16 t + 2 word + e,
    # its absmax at 64 j + 16 (word // 2) + 4 t + 2 e + word % 2
    word, t = n % 64 // 8, n % 8 // 2
    code_at = n // 64 * 64 + t * 16 + word * 2 + n % 2
    at = n // 64 * 64 + word // 2 * 16 + t * 4 + n % 2 * 2 + word % 2
    values = NF4_CODEBOOK[idx[:, code_at]] * absmax_t[:, at].repeat_interleave(64, dim=0)
    assert torch.equal(values, w.dequantize().t())
    p = K.DevicePacked.from_weight(w, DEV, transposed=True)      # made on a Hopper GPU only
    assert (p.codes_t is not None) == HOPPER
    assert p.nbytes() == w.nbytes() + (16 + 256) * 4 + (codes_t.nbytes + absmax_t.nbytes if HOPPER else 0)
    if HOPPER:
        assert torch.equal(p.codes_t.cpu(), codes_t) and torch.equal(p.absmax_t.cpu(), absmax_t)


def test_packed_and_errors():
    w, p, _ = packed((64, 100), True)
    assert p.shape == (64, 100) and p.double_quant
    assert p.nbytes() == w.nbytes() + (16 + 256) * 4       # + the two codebooks
    plain_w, plain, _ = packed((64, 100), False)
    assert plain.nbytes() == plain_w.nbytes() + (16 + 256) * 4
    with pytest.raises(ConfigError, match="NF4Weight"):
        K.DevicePacked.from_weight(torch.zeros(4, 4), DEV)
    with pytest.raises(ConfigError, match=r"\(M, 100\)"):
        K.nf4_matmul(randn(3, 99, dtype=torch.float32), p)
    with pytest.raises(ConfigError, match="float32, float16 or bfloat16"):
        K.nf4_matmul(torch.zeros(3, 100, dtype=torch.float64, device=DEV), p)
    with pytest.raises(ConfigError, match="contiguous"):
        K.nf4_matmul_t(randn(64, 3, dtype=torch.float32).t(), p)
    with pytest.raises(ConfigError, match="in_features=100"):
        K.fused_nf4_linear(randn(2, 3, 99, dtype=torch.float32), p)
    with pytest.raises(ConfigError, match="outside 0 .. 63"):
        K.nf4_embedding(p, torch.tensor([0, 64], device=DEV))
    with pytest.raises(ConfigError, match="integer"):
        K.nf4_embedding(p, torch.zeros(2, device=DEV))
    with pytest.raises(ConfigError, match="float64 is not one of float32"):
        K.nf4_decode(p, torch.float64)
    with pytest.raises(ConfigError, match="power of two"):
        K.nf4_matmul(randn(3, 100, dtype=torch.float32), p, config=K.TileConfig(bm=16, bn=24, bk=64))


def test_fused_available_matches_device():
    from aner.kernels import fused_available
    assert fused_available() == torch.cuda.is_available()

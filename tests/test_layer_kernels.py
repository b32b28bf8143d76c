"""Fused RoPE, RMSNorm and SwiGLU kernels (aner.kernels.layer) against the model's torch expressions.

Runs on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) with small
shapes; skips otherwise (`make test` runs it under the interpreter).
rope: forward and gradient bit-exact vs torch autograd through `apply_rope(x, cos, sin).to(dtype)`;
gradients of q, k and v from one product laid side by side as the product's output.
rms_norm: vs float64 autograd of RMSNorm's expression. y within 1e-6 (FP32), 1e-3 (FP16), 8e-3
(BF16) of |y| (FP16 also half its smallest subnormal step); dx and dweight within 1e-5 of the
sum of absolute terms, for every dy dtype (dy is the same values for the kernel and the oracle,
so only the FP32 arithmetic differs).
swiglu: vs float64 autograd of silu(gate) * up; each output within 4e-6 (FP32), 1e-3 (FP16),
8e-3 (BF16) of the sum of its terms' magnitudes (FP16 also half its smallest subnormal step).
"""
import pytest
import torch

from kernel_device import INTERPRET, device_or_skip

DEV = device_or_skip()

from aner.errors import ConfigError  # noqa: E402
from aner.kernels.layer import add_rms_norm, rms_norm, rope, swiglu  # noqa: E402
from aner.model.config import LlamaConfig  # noqa: E402
from aner.model.llama import RMSNorm, apply_rope, rope_tables  # noqa: E402

# The interpreter's BF16 is unreliable (numpy has no BF16): BF16 is checked on the GPU only.
bf16_gpu_only = pytest.mark.skipif(INTERPRET, reason="the interpreter's BF16 is unreliable")
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=bf16_gpu_only)]


def tables(n, T, E):
    config = LlamaConfig(n_layer=1, dim=n * E, n_head=n, n_kv_head=n, ffn_dim=1, vocab_size=1,
                         context_length=T, rms_eps=1e-5, rope_base=10000.0, tied_embeddings=True)
    return rope_tables(config, T, DEV)


def grad_like(shape, layout, dtype):
    """A fresh random upstream gradient in one of the layouts autograd may hand over."""
    B, n, T, E = shape
    if layout == "bhte":
        return torch.randn(B, n, T, E, device=DEV).to(dtype)
    if layout == "bthe":                                       # SDPA-like: the transposed view
        return torch.randn(B, T, n, E, device=DEV).to(dtype).transpose(1, 2)
    return torch.randn((), device=DEV).to(dtype).expand(shape)  # all strides 0, as from .sum()


ROPE_SHAPES = [(2, 3, 37, 64), (2, 3, 37, 128), (1, 2, 1, 64), (2, 2, 5, 96)]
if not INTERPRET:
    ROPE_SHAPES += [(4, 9, 1000, 64), (2, 32, 2048, 128)]


@pytest.mark.parametrize("layout", ["bhte", "bthe", "expanded"])
@pytest.mark.parametrize("same_out", [True, False], ids=["out=x", "out=f32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rope_bit_exact(shape, dtype, same_out, layout):
    """q and k from projections of their own, v of the output dtype (passed on as it is)."""
    B, n, T, E = shape
    out_dtype = dtype if same_out else torch.float32
    cos, sin = tables(n, T, E)
    projs = [torch.randn(B, T, n * E, device=DEV).to(dtype) for _ in range(2)]   # the model's q/k projection outputs
    v = torch.randn(B, n, T, E, device=DEV).to(out_dtype)
    gs = [grad_like(shape, layout, out_dtype) for _ in range(2)]

    leaves = [p.clone().requires_grad_(True) for p in projs]
    want = [apply_rope(p.view(B, T, n, E).transpose(1, 2), cos, sin).to(out_dtype) for p in leaves]
    torch.autograd.backward(want, gs)
    ps = [p.clone().requires_grad_(True) for p in projs]
    got_q, got_k, got_v = rope(*(p.view(B, T, n, E).transpose(1, 2) for p in ps), v, cos, sin)   # not contiguous
    torch.autograd.backward([got_q, got_k], gs)

    assert torch.equal(got_v, v) and got_v.data_ptr() == v.data_ptr()

    def strides(t):             # of the dimensions longer than 1
        return [s for s, k in zip(t.stride(), t.shape) if k > 1]

    for got, w, p, leaf in zip((got_q, got_k), want, ps, leaves):
        assert got.dtype == out_dtype and got.shape == (B, n, T, E)
        assert strides(got) == strides(w)
        assert torch.equal(got, w), f"{(got != w).sum().item()} of {got.numel()} outputs differ"
        assert p.grad.dtype == dtype
        assert torch.equal(p.grad, leaf.grad), f"{(p.grad != leaf.grad).sum().item()} gradients differ"


@pytest.mark.parametrize("tile", [(1, 4096), (2, 4096), (4, 2048), (8, 8192), (64, 4096)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_tiles_give_the_same_bits(tile, dtype):
    """Any program tile (heads x elements): partial blocks of heads and positions, heads from
    `rotated` on copied, forward and backward the same bits as torch's."""
    from aner.kernels.layer import _rope_launch
    B, n, T, E, rotated = 2, 7, 37, 64, 5
    cos, sin = tables(n, T, E)
    x = torch.randn(B, T, n, E, device=DEV).to(dtype).transpose(1, 2)
    g = torch.randn(B, T, n, E, device=DEV).to(dtype).transpose(1, 2)
    leaf = x[:, :rotated].clone().requires_grad_(True)
    want = apply_rope(leaf, cos, sin).to(dtype)
    (want_grad,) = torch.autograd.grad(want, leaf, g[:, :rotated])
    got = _rope_launch(x, cos, sin, torch.empty_like(x), False, rotated, tile=tile)
    assert torch.equal(got[:, :rotated], want) and torch.equal(got[:, rotated:], x[:, rotated:])
    assert torch.equal(_rope_launch(g, cos, sin, torch.empty_like(g), True, rotated, tile=tile)[:, :rotated], want_grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (2, 1)], ids=lambda h: f"H{h[0]}K{h[1]}")
@pytest.mark.parametrize("incoming", ["apart", "one"])
def test_rope_of_one_projection_lays_its_gradients_side_by_side(heads, dtype, incoming):
    """q, k and v as the heads of one product's output: the same bits as torch, the outputs the
    heads of one new tensor with v copied there (attention keeps it, not the whole output), and
    the three gradients one buffer in the output's layout, as `Dense`'s joint products want them;
    gradients that come as the heads of one tensor (`attention.grads_like`) rotated there."""
    from aner.model.llama import side_by_side
    H, K = heads
    B, T, E = 2, 9, 64
    cos, sin = tables(H, T, E)
    proj = torch.randn(B, T, (H + 2 * K) * E, device=DEV).to(dtype)

    def heads_of(p):
        return [x.transpose(1, 2) for x in p.view(B, T, H + 2 * K, E).split([H, K, K], dim=2)]
    if incoming == "one":
        gs = heads_of(torch.randn(B, T, (H + 2 * K) * E, device=DEV).to(dtype))
    else:
        gs = [torch.randn(B, n, T, E, device=DEV).to(dtype) for n in (H, K, K)]

    leaf = proj.clone().requires_grad_(True)
    q, k, v = heads_of(leaf)
    want = [apply_rope(q, cos, sin).to(dtype), apply_rope(k, cos, sin).to(dtype), v]
    want_grads = torch.autograd.grad(want, [q, k, v], gs)
    p = proj.clone().requires_grad_(True)
    views = heads_of(p)
    got = rope(*views, cos, sin)
    grads = torch.autograd.grad(got, views, gs)

    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert got[2].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    whole = side_by_side([g.transpose(1, 2) for g in got], 2)
    assert whole is not None and whole.is_contiguous()
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    assert side_by_side([g.transpose(1, 2) for g in grads], 2) is not None
    in_place = grads[0].untyped_storage().data_ptr() == gs[0].untyped_storage().data_ptr()
    assert in_place == (incoming == "one")


RMS_D = [576, 2048, 781] + ([] if INTERPRET else [8192])
RMS_LEAD = [(1,), (37,), (3, 100), (601,)] + ([] if INTERPRET else [(4, 1024)])   # 601: a last program of 1 row


def rms_oracle(x, w, eps, dy, w_grad):
    """y, dx, dw (float64) of RMSNorm's expression, and the scales of dx and dw (sums of |terms|)."""
    x64 = x.double().requires_grad_(True)
    w64 = w.double().requires_grad_(w_grad)
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64
    y.backward(dy.double())
    with torch.no_grad():
        r = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
        gw, xhat = dy.double().abs() * w64.abs(), x64.abs() * r
        dx_scale = r * (gw + xhat * (gw * xhat).mean(-1, keepdim=True))
        dw_scale = (dy.double().abs() * xhat).reshape(-1, x.shape[-1]).sum(0)
    return y.detach(), x64.grad, w64.grad, dx_scale, dw_scale


@pytest.mark.parametrize("w_grad", [True, False], ids=["w_grad", "frozen_w"])
@pytest.mark.parametrize("out_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead", RMS_LEAD, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("D", RMS_D)
def test_rms_norm(D, lead, out_dtype, w_grad):
    eps = 1e-5
    x = torch.randn(*lead, D, device=DEV) * 3
    w = 1 + 0.3 * torch.randn(D, device=DEV)
    dy = torch.randn(*lead, D, device=DEV).to(out_dtype)
    y64, dx64, dw64, dx_scale, dw_scale = rms_oracle(x, w, eps, dy, w_grad)
    # The oracle is the model's expression: RMSNorm in FP32 agrees with it to FP32 accuracy.
    assert ((RMSNorm(w, eps)(x).double() - y64).abs() <= 1e-6 * y64.abs() + 1e-30).all()

    xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(w_grad)
    y = rms_norm(xl, wl, eps, out_dtype)
    y.backward(dy)

    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[out_dtype]
    floor = 2.0 ** -25 if out_dtype == torch.float16 else 0.0
    assert y.dtype == out_dtype and y.shape == x.shape
    err = (y.double() - y64).abs()
    assert (err <= tol * y64.abs() + floor + 1e-30).all(), f"y: max rel err {(err / y64.abs()).max().item():.3g}"
    err = (xl.grad.double() - dx64).abs()
    assert xl.grad.dtype == torch.float32 and (err <= 1e-5 * dx_scale + 1e-30).all(), \
        f"dx: max err/scale {(err / dx_scale).max().item():.3g}"
    if w_grad:
        err = (wl.grad.double() - dw64).abs()
        assert wl.grad.dtype == torch.float32 and (err <= 1e-5 * dw_scale + 1e-30).all(), \
            f"dw: max err/scale {(err / dw_scale).max().item():.3g}"
    else:
        assert wl.grad is None


@pytest.mark.parametrize("w_grad", [True, False], ids=["w_grad", "frozen_w"])
@pytest.mark.parametrize("stream_grad", [True, False], ids=["ds", "no_ds"])
@pytest.mark.parametrize("y_dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lead", [(37,), (3, 100)] + ([] if INTERPRET else [(4, 1024)]),
                         ids=lambda s: "x".join(map(str, s)))
def test_add_rms_norm(lead, y_dtype, stream_grad, w_grad):
    """(norm(x + y), x + y) with the sum in FP32 (torch's promoted add, bit for bit); backward
    adds the gradient reaching the stream from elsewhere (none after the last norm) to the
    norm's, and y's gradient is that sum rounded once to y's dtype; with the weight frozen (as
    LoRA's norms are), the same gradients from one tile of rows a program."""
    D, eps = 2048, 1e-5
    x = torch.randn(*lead, D, device=DEV) * 3
    y = torch.randn(*lead, D, device=DEV).to(y_dtype)
    w = 1 + 0.3 * torch.randn(D, device=DEV)
    dout = torch.randn(*lead, D, device=DEV).to(torch.bfloat16 if not INTERPRET else torch.float16)
    ds = torch.randn(*lead, D, device=DEV) if stream_grad else None
    s_want = x + y
    out64, dnorm64, dw64, dx_scale, dw_scale = rms_oracle(s_want, w, eps, dout, w_grad)

    xl, yl, wl = x.clone().requires_grad_(True), y.clone().requires_grad_(True), w.clone().requires_grad_(w_grad)
    out, s = add_rms_norm(xl, yl, wl, eps, dout.dtype)
    torch.autograd.backward([out, s] if stream_grad else [out], [dout, ds] if stream_grad else [dout])

    assert s.dtype == torch.float32 and torch.equal(s, s_want)
    tol, floor = (8e-3, 0.0) if out.dtype == torch.bfloat16 else (1e-3, 2.0 ** -25)   # one rounding, as test_rms_norm
    assert ((out.double() - out64).abs() <= tol * out64.abs() + floor + 1e-30).all()
    want = dnorm64 + (ds.double() if stream_grad else 0)
    bound = 1e-5 * (dx_scale + (ds.double().abs() if stream_grad else 0)) + 1e-30
    assert xl.grad.dtype == torch.float32 and ((xl.grad.double() - want).abs() <= bound).all()
    assert yl.grad.dtype == y_dtype and torch.equal(yl.grad, xl.grad.to(y_dtype))
    if w_grad:
        assert ((wl.grad.double() - dw64).abs() <= 1e-5 * dw_scale + 1e-30).all()
    else:
        assert wl.grad is None


@pytest.mark.parametrize("rows", [300] if INTERPRET else [300, 8192])
def test_rms_norm_deterministic(rows):
    """Two runs give the same bits for y, dx and dw (several rows per dw partial)."""
    x, w = torch.randn(rows, 781, device=DEV), torch.randn(781, device=DEV)
    dy = torch.randn(rows, 781, device=DEV)
    runs = []
    for _ in range(2):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        y = rms_norm(xl, wl, 1e-6, torch.float32)
        y.backward(dy)
        runs.append((y.detach(), xl.grad, wl.grad))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


TOL = {torch.float32: 4e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def within(got, want64, scale64):
    tol = TOL[got.dtype] * scale64 + (2.0 ** -25 if got.dtype == torch.float16 else 0) + 1e-30
    err = (got.double() - want64).abs()
    assert (err <= tol).all(), f"{got.dtype}: worst {(err / tol).max().item():.3g} of the bound"


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.float16,) * 2,
                                    pytest.param((torch.bfloat16,) * 2, marks=bf16_gpu_only),
                                    pytest.param((torch.float32, torch.bfloat16), marks=bf16_gpu_only)],
                         ids=lambda d: "-".join(str(t)[6:] for t in d))
@pytest.mark.parametrize("shape", [(37, 96), (3, 1000), (1,)] + ([] if INTERPRET else [(8192, 1536)]),
                         ids=lambda s: "x".join(map(str, s)))
def test_swiglu(shape, dtypes):
    gate = (3 * torch.randn(shape, device=DEV)).to(dtypes[0]).requires_grad_(True)
    up = torch.randn(shape, device=DEV).to(dtypes[1]).requires_grad_(True)
    y = swiglu(gate, up)
    assert y.dtype == torch.promote_types(*dtypes) and y.shape == gate.shape
    dy = torch.randn(shape, device=DEV).to(y.dtype)
    y.backward(dy)
    a, b, g = (t.detach().double().requires_grad_(True) for t in (gate, up, dy))
    s = torch.sigmoid(a)
    want = torch.nn.functional.silu(a) * b
    want.backward(g)
    within(y.detach(), want.detach(), (a * s * b).abs().detach())
    within(gate.grad, a.grad, (g * b * s).abs().detach() * (1 + (a * (1 - s)).abs().detach()))
    within(up.grad, b.grad, (g * a * s).abs().detach())


@pytest.mark.parametrize("F", [96, 1000, 1536] + ([] if INTERPRET else [8192]))
def test_swiglu_of_one_product_lays_its_gradients_side_by_side(F):
    """gate and up as the two halves of one product's rows: the same bits as from copies of their
    own, and the two gradients one buffer of the product's layout."""
    from aner.model.llama import side_by_side
    proj = (2 * torch.randn(3, 7, 2 * F, device=DEV)).to(torch.float16)
    dy = torch.randn(3, 7, F, device=DEV).to(torch.float16)
    gate, up = (t.contiguous().requires_grad_(True) for t in proj.split(F, dim=-1))
    want = swiglu(gate, up)
    want_grads = torch.autograd.grad(want, [gate, up], dy)
    p = proj.clone().requires_grad_(True)
    halves = p.split(F, dim=-1)
    got = swiglu(*halves)
    grads = torch.autograd.grad(got, halves, dy)
    assert torch.equal(got, want) and all(torch.equal(g, w) for g, w in zip(grads, want_grads))
    assert side_by_side(grads, 2) is not None


HOPPER = not INTERPRET and torch.cuda.get_device_capability()[0] == 9


@pytest.mark.skipif(not HOPPER, reason="Hopper GPU only (the Gluon kernels)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(1024, 560, 1024), (1000, 200, 1352), (64, 64, 128), (4096, 1048, 4096)],
                         ids=lambda s: "M{}-K{}-F{}".format(*s))
def test_swiglu_inside_the_gemms(shape, dtype):
    """`mlp.gated_forward`: gate and up close to the float64 products and, at 1024 x 560 x 1024
    (where cuBLAS splits no sum), cuBLAS's bits; h the SwiGLU kernel's bits of them, every output
    written (outputs start as NaN). `mlp.gated_backward`: the SwiGLU kernel's backward of cuBLAS's
    dh, its bits at that shape and elsewhere within dh's rounding (dgate and dup are dh times
    factors of gate and up alone); tiles partial along every dimension, fewer tiles than programs
    and several a program; with zero blocks where `lora._paired` lays them, the steps that hold
    them alone left out, the same bits; up's rows apart from gate's, the same bits."""
    from aner.kernels import mlp
    from aner.kernels.layer import swiglu_grad
    M, K, F = shape
    x, w = torch.randn(M, K, device=DEV).to(dtype), (torch.randn(2 * F, K, device=DEV) / K ** 0.5).to(dtype)
    g, wd = torch.randn(M, K, device=DEV).to(dtype), (torch.randn(K, F, device=DEV) / K ** 0.5).to(dtype)
    assert mlp.supported(x, w, g, wd)
    exact = shape == (1024, 560, 1024)
    for _ in range(2):
        torch.full((M, 3 * F), float("nan"), device=DEV, dtype=dtype)      # freed: the outputs start as NaN
        gate, up, h = mlp.gated_forward(x, w[:F], w[F:])
        y = torch.cat([gate, up], 1)
        within(y, x.double() @ w.double().t(), x.double().abs() @ w.double().abs().t())
        assert torch.equal(h, swiglu(gate, up)) and torch.isfinite(h).all()
        assert not exact or torch.equal(y, x @ w.t())
        # zero blocks as `lora._paired` lays them (gate's last columns, up's first), their steps left out
        j = K // 4 // 16 * 16
        wz = w.clone()
        wz[:F, K - j:] = 0
        wz[F:, :j] = 0
        skipped = mlp.gated_forward(x, wz[:F], wz[F:], gate_cols=K - j, up_first=j)
        assert all(torch.equal(a, b) for a, b in zip(skipped, mlp.gated_forward(x, wz[:F], wz[F:])))
        dgate, dup = mlp.gated_backward(g, wd, gate, up)
        apart = mlp.gated_backward(g, wd, gate, up.contiguous())     # rows of their own lengths: the same bits
        assert all(torch.equal(a, b) for a, b in zip(apart, (dgate, dup)))
        want = swiglu_grad(gate, up, g @ wd)
        if exact:
            assert torch.equal(dgate, want[0]) and torch.equal(dup, want[1])
        for got, ref in zip((dgate, dup), want):
            assert torch.isfinite(got).all()
            floor = 2.0 ** -23 if dtype == torch.float16 else 0                # FP16's subnormal steps
            assert ((got.double() - ref.double()).abs() <= 2 ** -6 * ref.double().abs() + floor).all()
        assert dup.data_ptr() == dgate.data_ptr() + F * dgate.element_size()      # side by side


def test_errors():
    cos, sin = tables(2, 5, 64)
    x = torch.randn(1, 2, 5, 64, device=DEV)
    with pytest.raises(ConfigError, match="rope q dtype torch.float64; accepted: float32, float16 or bfloat16"):
        rope(x.double(), x, x, cos, sin)
    with pytest.raises(ConfigError, match="rope v dtype torch.float64; accepted: float32, float16 or bfloat16"):
        rope(x, x, x.double(), cos, sin)
    with pytest.raises(ConfigError, match=r"\(B, n, T, E\)"):
        rope(x[0], x, x, cos, sin)
    with pytest.raises(ConfigError, match="E=63 is odd"):
        rope(*[x[..., :63]] * 3, cos[:, :63].contiguous(), sin[:, :63].contiguous())
    with pytest.raises(ConfigError, match="stride 1"):
        rope(x, x.transpose(2, 3).contiguous().transpose(2, 3), x, cos, sin)
    with pytest.raises(ConfigError, match=r"float32 \(5, 64\) contiguous"):
        rope(x, x, x, cos[:4], sin)
    with pytest.raises(ConfigError, match=r"float32 \(5, 64\) contiguous"):
        rope(x, x, x, cos, sin.half())
    with pytest.raises(ConfigError, match="same device"):
        rope(x, x, x, cos, sin.to("meta"))
    with pytest.raises(ConfigError, match=r"accepted: \(B, H, T, E\), \(B, K, T, E\) twice"):
        rope(x, x, x[:, :1], cos, sin)

    x, w = torch.randn(3, 100, device=DEV), torch.randn(100, device=DEV)
    with pytest.raises(ConfigError, match="float32 both"):
        rms_norm(x.half(), w, 1e-5, torch.float16)
    with pytest.raises(ConfigError, match="float32, float16 or bfloat16"):
        rms_norm(x, w, 1e-5, torch.float64)
    with pytest.raises(ConfigError, match=r"\(\.\.\., D\) and \(D,\)"):
        rms_norm(x, w[:99], 1e-5, torch.float32)
    with pytest.raises(ConfigError, match="contiguous"):
        rms_norm(torch.randn(100, 3, device=DEV).t(), w, 1e-5, torch.float32)
    with pytest.raises(ConfigError, match="same device"):
        rms_norm(x, w.to("meta"), 1e-5, torch.float32)
    with pytest.raises(ConfigError, match=r"x's shape \(3, 100\)"):
        add_rms_norm(x, x[:2], w, 1e-5, torch.float32)
    with pytest.raises(ConfigError, match="float32, float16 or bfloat16, contiguous"):
        add_rms_norm(x, x.double(), w, 1e-5, torch.float32)

    with pytest.raises(ConfigError, match="float32, float16 or bfloat16"):
        swiglu(x.double(), x)
    with pytest.raises(ConfigError, match="the same shape"):
        swiglu(x, x[:2])
    with pytest.raises(ConfigError, match="contiguous"):
        swiglu(x.t(), x.t())

"""Fused cross-entropy kernel (aner.kernels.cross_entropy) against float64 torch.

Runs on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) with fewer
shapes; skips otherwise (`make test` runs it under the interpreter). Oracle: F.cross_entropy in
float64, reduction="sum", and scale times its autograd gradient, from the same logit values.
Tolerances: loss relative 1e-6 (FP32 accumulation only); gradient 1e-6 * scale (FP32 error),
plus for FP16/BF16 half an ulp of the dtype (one rounding) down to its subnormal range.
"""
import pytest
import torch
import torch.nn.functional as F

from kernel_device import INTERPRET, device_or_skip

DEV = device_or_skip()

from aner.errors import ConfigError  # noqa: E402
from aner.kernels.cross_entropy import cross_entropy_grad  # noqa: E402

# The interpreter computes in numpy, which has no bf16: BF16 is checked on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
VOCABS = [1001, 49152] + ([] if INTERPRET else [128256])     # one partial block; 12 full; 31.3
SCALES = [1 / 137, 1024.0]                                   # 1 / scored tokens; an FP16 loss scale


def inputs(n, V, dtype, ignore=-100):
    """Fresh logits as a row-slice view (row stride V, offset one row), rising along even rows
    (each block's maximum above the last: the online sum must rescale), and targets with every
    third row (1, 4, ..) unscored, the last column and column 0 among the targets."""
    z = torch.randn(n + 2, V, device=DEV) * 2
    z[::2] += torch.linspace(0, 8, V, device=DEV)
    logits = z.to(dtype)[1:-1]
    targets = torch.randint(0, V, (n,), device=DEV)
    targets[-1] = 0
    targets[0] = V - 1
    targets[1::3] = ignore
    return logits, targets


def reference(logits, targets, scale, ignore=-100):
    """(loss, gradient) in float64: F.cross_entropy's sum and scale times its autograd gradient."""
    z = logits.double().requires_grad_(True)
    loss = F.cross_entropy(z, targets, ignore_index=ignore, reduction="sum")
    (grad,) = torch.autograd.grad(loss, z)
    return loss.detach(), grad * scale


def check(loss, grad, logits, targets, scale, ignore=-100):
    want_loss, want = reference(logits, targets, scale, ignore)
    assert loss.shape == () and loss.dtype == torch.float32 and loss.device == logits.device
    assert abs(loss.item() - want_loss.item()) <= 1e-6 * abs(want_loss.item())
    assert grad.shape == logits.shape and grad.dtype == logits.dtype and torch.isfinite(grad).all()
    fp32_err = 1e-6 * scale
    bound = torch.full_like(want, fp32_err)
    if logits.dtype != torch.float32:                        # + half an ulp of the rounded result
        fi = torch.finfo(logits.dtype)
        bound += fi.eps / 2 * (want.abs() + fp32_err + fi.smallest_normal)
    err = (grad.double() - want).abs()
    assert (err <= bound).all(), f"max err / bound {(err / bound).max().item():.3g}"
    unscored = targets == ignore
    assert (grad[unscored] == 0).all()                       # exactly zero, not merely small


@pytest.mark.parametrize("scale", SCALES, ids=["1/137", "1024"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", VOCABS)
@pytest.mark.parametrize("n", [1, 7, 64])
def test_against_float64(n, V, dtype, scale):
    logits, targets = inputs(n, V, dtype)
    s = torch.tensor(scale, device=DEV)
    out = torch.full_like(logits, float("nan"))              # every element must be written
    loss, grad = cross_entropy_grad(logits, targets, s, out=out)
    assert grad is out
    check(loss, grad, logits, targets, scale)


def test_all_rows_ignored():
    logits, targets = inputs(7, 1001, torch.float32)
    targets[:] = -100
    loss, grad = cross_entropy_grad(logits, targets, torch.tensor(1024.0, device=DEV))
    assert loss.item() == 0.0 and torch.equal(grad, torch.zeros_like(logits))


def test_other_ignore_index():
    """An ignore index inside the vocabulary (3): those rows are unscored, others as usual."""
    logits, targets = inputs(7, 1001, torch.float32, ignore=3)
    loss, grad = cross_entropy_grad(logits, targets, torch.tensor(0.5, device=DEV), ignore_index=3)
    check(loss, grad, logits, targets, 0.5, ignore=3)


def test_out_of_range_target_as_documented():
    """Targets are not range-checked on the device; a target outside 0 .. V-1 reads nothing out
    of bounds: its loss is logsumexp(z) and its gradient scale * softmax(z)."""
    logits, _ = inputs(3, 1001, torch.float32)
    loss, grad = cross_entropy_grad(logits, torch.tensor([1001, -1, -100], device=DEV),
                                    torch.tensor(2.0, device=DEV))
    z = logits[:2].double()
    assert abs(loss.item() - z.logsumexp(1).sum().item()) <= 1e-6 * abs(z.logsumexp(1).sum().item())
    assert torch.allclose(grad[:2].double(), 2 * z.softmax(1), rtol=0, atol=2e-6)
    assert (grad[2] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("V", [1001, 5003] if INTERPRET else VOCABS)
def test_in_place_and_deterministic(V, dtype):
    """out=logits gives the bits of a separate output; two calls give identical bits."""
    logits, targets = inputs(64, V, dtype)
    s = torch.tensor(1 / 137, device=DEV)
    loss, grad = cross_entropy_grad(logits, targets, s)
    loss2, grad2 = cross_entropy_grad(logits, targets, s)
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    buf = logits.clone()
    loss3, grad3 = cross_entropy_grad(buf, targets, s, out=buf)
    assert grad3 is buf and torch.equal(loss3, loss) and torch.equal(grad3, grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rows_shared_by_programs_same_bits(dtype):
    """Programs taking many rows each (every P-th row), and a row in flight past n: the bits of one
    program a row, whatever the number of programs; and the float64 reference."""
    from aner.kernels.cross_entropy import _launch
    n, V = 37, 5003
    logits, targets = inputs(n, V, dtype)
    s = torch.tensor(1 / 137, device=DEV)
    runs = []
    for programs in (n, 4, 3, 1):
        loss, grad = torch.full((n,), float("nan"), device=DEV), torch.full_like(logits, float("nan"))
        _launch(logits, targets, s, loss, grad, -100, programs)
        runs.append((loss, grad))
    for loss, grad in runs[1:]:
        assert torch.equal(loss, runs[0][0]) and torch.equal(grad, runs[0][1])
    check(runs[0][0].sum(), runs[0][1], logits, targets, 1 / 137)


def test_errors():
    logits, targets = inputs(4, 1001, torch.float32)
    s = torch.tensor(1.0, device=DEV)
    cases = [
        ((logits.double(), targets, s), {}, "float32, float16 or bfloat16"),
        ((logits[0], targets, s), {}, r"must be \(n, V\)"),
        ((torch.randn(1001, 4, device=DEV).t(), targets, s), {}, "contiguous"),
        ((logits, targets[:3], s), {}, r"shape \(4,\)"),
        ((logits, targets.int(), s), {}, "int64"),
        ((logits, targets.to("meta"), s), {}, "targets is on meta"),
        ((logits, targets, 1.0), {}, "0-dim float32"),
        ((logits, targets, s.reshape(1)), {}, "0-dim float32"),
        ((logits, targets, s.double()), {}, "0-dim float32"),
        ((logits, targets, s, -100.0), {}, "ignore_index"),
        ((logits, targets, s), {"out": torch.empty_like(logits, dtype=torch.float16)}, "out must be"),
        ((logits[:2], targets[:2], s), {"out": logits[1:3]}, "overlaps"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ConfigError, match=match):
            cross_entropy_grad(*args, **kwargs)


@pytest.mark.skipif(INTERPRET, reason="the FP32-output product of FP16/BF16 operands is CUDA's")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_trained_head_gradient_sums_chunks_in_fp32(dtype):
    """A trained head's weight gradient over five chunks is the float64 sum of the chunks'
    dlogits^T h products up to FP32 accumulation: no chunk's product is rounded to `dtype`
    (which the reference's own rounding, made alongside, shows would be >= 30x further off)."""
    from aner.model.llama import Dense
    from aner.train.loss import _HeadLoss
    n, V, D, step = 320, 4096, 256, 64
    g = torch.Generator(device=DEV).manual_seed(0)
    w = (torch.randn(V, D, device=DEV, generator=g) * 0.05).requires_grad_(True)
    h = torch.randn(n, D, device=DEV, generator=g).to(dtype)
    targets = torch.randint(0, V, (n,), device=DEV, generator=g)
    scale = torch.tensor(1 / n, device=DEV)
    with torch.autocast("cuda", dtype=dtype):
        _, _, got = _HeadLoss.apply(h, targets, Dense(w.detach().to(dtype)), step, scale, True, [w])
        want, rounded, magnitude = 0, 0, 0
        for s in range(0, n, step):                          # the same logits, gradient kernel, chunks
            logits = F.linear(h[s:s + step], w)
            _, dz = cross_entropy_grad(logits, targets[s:s + step], scale)
            want = want + dz.double().T @ h[s:s + step].double()
            rounded = rounded + (dz.T @ h[s:s + step]).double()   # the product rounded to dtype
            magnitude = magnitude + dz.double().abs().T @ h[s:s + step].double().abs()
    err = ((got.double() - want).abs() / magnitude.max()).max().item()
    err_rounded = ((rounded - want).abs() / magnitude.max()).max().item()
    assert got.dtype == torch.float32 and err <= 1e-6, err
    assert err_rounded >= 30 * err, (err, err_rounded)

"""The AdamW kernel (aner.kernels.adamw) against torch's fused AdamW, bit for bit.

On a CUDA device the oracle is `torch._fused_adamw_` itself, which the optimizer used before;
under Triton's interpreter (TRITON_INTERPRET=1, numpy arithmetic, whose fma rounds twice) it is
the same formula written in FP32 numpy. Skips otherwise; `make test` runs it under the interpreter.
"""
import numpy as np
import pytest
import torch

from kernel_device import INTERPRET, device_or_skip

DEV = device_or_skip()

from aner.kernels.adamw import CHUNK, adamw_, squares  # noqa: E402

HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8)
# sizes: under one block, odd, a chunk and one more, several chunks with a tail; on the GPU a
# large tensor too, where a contraction torch's compiler made and ours did not would show
SIZES = [7, 1000, 4096, CHUNK + 1, 3 * CHUNK + 517] + ([] if INTERPRET else [1 << 22])


def _reference(p, g, m, v, t, lr, beta1, beta2, eps, weight_decay, divisor):
    """The fused update in FP32 numpy, with the interpreter's fma (a product and a sum, each
    rounded): what the kernel computes under the interpreter."""
    f32 = np.float32
    p, g, m, v = (x.cpu().numpy().astype(f32) for x in (p, g, m, v))
    b1, b2, lr, eps, t = f32(beta1), f32(beta2), f32(lr), f32(eps), f32(t)
    fma = lambda a, b, c: a * b + c  # noqa: E731
    if divisor is not None:
        g = g / f32(divisor)
    if weight_decay:
        p = fma(-(lr * f32(weight_decay)), p, p)
    m = fma(b1, m, fma(-b1, g, g))
    v = fma(b2, v, fma(-b2, g * g, g * g))
    # the bias corrections by torch's own FP32 pow and square root, as its fused update makes them
    # on its device: on a CPU torch's square root is not always numpy's correctly rounded one (one
    # unit in the last place below it for 1 - 0.999 ** t at t = 4, 8, 9, 10, ...)
    c = 1 - torch.pow(torch.tensor([beta1, beta2]), torch.tensor(float(t)))
    step, root2 = lr / c[0].numpy(), c[1].sqrt().numpy()
    p = p - (step * m) / (np.sqrt(v) / root2 + eps)
    return p, m, v


def _state(seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    made = []
    for n in SIZES:
        scale = 10 ** torch.randn(n, generator=g)                 # magnitudes over decades
        made.append([torch.randn(n, generator=g), torch.randn(n, generator=g) * scale,
                     torch.randn(n, generator=g) * 1e-3, torch.rand(n, generator=g) * 1e-5])
    return [[x.to(DEV) for x in four] for four in made]


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("divided", [False, True])
def test_update_is_torchs_fused_update_bitwise(weight_decay, divided):
    """Five updates of tensors of many sizes in one launch: parameters and moments equal the
    oracle's bit for bit, and the gradients are left as they were."""
    state = _state(0)
    ours = [[x.clone() for x in four] for four in state]
    divisor = torch.tensor(2.7182817, device=DEV) if divided else None
    for t in range(1, 6):
        count = torch.tensor(float(t), device=DEV)
        grads = [g.clone() for _, g, _, _ in ours]
        adamw_(*(list(x) for x in zip(*ours)), count, weight_decay=weight_decay, divisor=divisor, **HYPER)
        assert all(torch.equal(a, b) for a, (_, b, _, _) in zip(grads, ours))
        if INTERPRET:
            for four in state:
                p, m, v = _reference(*four, t, weight_decay=weight_decay,
                                     divisor=None if divisor is None else divisor.item(), **HYPER)
                four[0], four[2], four[3] = (torch.from_numpy(x) for x in (p, m, v))
        else:
            ps, gs, ms, vs = (list(x) for x in zip(*state))
            torch._fused_adamw_(ps, [g.clone() for g in gs], ms, vs, [], [count] * len(ps), amsgrad=False,
                                maximize=False, grad_scale=divisor, weight_decay=weight_decay, **HYPER)
    for (p, _, m, v), (rp, _, rm, rv) in zip(ours, state):
        assert torch.equal(p.cpu(), rp.cpu()) and torch.equal(m.cpu(), rm.cpu()) and torch.equal(v.cpu(), rv.cpu())


def test_slices_and_order_change_no_bit():
    """Updating the tensors in the reverse order, one at a time, or in slices that start at a
    multiple of 4 elements but not of a chunk, gives the same bits as one launch of all."""
    state = _state(1)
    whole, reversed_, sliced = ([[x.clone() for x in four] for four in state] for _ in range(3))
    count = torch.tensor(3.0, device=DEV)
    adamw_(*(list(x) for x in zip(*whole)), count, weight_decay=0.1, **HYPER)
    adamw_(*(list(x) for x in zip(*reversed_[::-1])), count, weight_decay=0.1, **HYPER)
    for four in sliced:
        n = four[0].numel()
        for s in range(0, n, 1028):
            adamw_(*([x[s:s + 1028]] for x in four), count, weight_decay=0.1, **HYPER)
    for a, b, c in zip(whole, reversed_, sliced):
        assert all(torch.equal(x, y) and torch.equal(x, z) for x, y, z in zip(a, b, c))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_casts_are_the_updated_parameters_cast(dtype):
    """A parameter given a cast has it rewritten with its updated value's `to(dtype)` (round to
    nearest even), also when only some parameters have one and when updated in slices; the
    update's own bits do not change."""
    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter rounds FP32 to BF16 by truncation")
    state = _state(2)
    plain, kept = ([[x.clone() for x in four] for four in state] for _ in range(2))
    casts = [torch.full_like(four[0], 7.0, dtype=dtype) if i % 2 == 0 else None for i, four in enumerate(kept)]
    for t in range(1, 4):
        count = torch.tensor(float(t), device=DEV)
        adamw_(*(list(x) for x in zip(*plain)), count, weight_decay=0.1, **HYPER)
        for four, cast in zip(kept, casts):   # in slices of 1028 elements: not chunk-aligned
            for s in range(0, four[0].numel(), 1028):
                adamw_(*([x[s:s + 1028]] for x in four), count, weight_decay=0.1, casts=[
                    None if cast is None else cast[s:s + 1028]], **HYPER)
        for a, b, cast in zip(plain, kept, casts):
            assert all(torch.equal(x, y) for x, y in zip(a, b))
            assert cast is None or torch.equal(cast.cpu(), b[0].cpu().to(dtype))
    whole = [torch.zeros_like(four[0], dtype=dtype) for four in kept]
    adamw_(*(list(x) for x in zip(*kept)), torch.tensor(4.0, device=DEV), casts=whole, weight_decay=0.1, **HYPER)
    assert all(torch.equal(c.cpu(), four[0].cpu().to(dtype)) for c, four in zip(whole, kept))


def test_squares_is_the_float64_sum_of_squares():
    """The clipping norm's pass: over tensors of many sizes, a transposed view (read as it lies), a
    slice with gaps (copied first) and an empty tensor, the float64 sum of every square, to float64
    rounding; the same bits on a second call; and not finite when one element is not."""
    g = torch.Generator(device="cpu").manual_seed(3)
    tensors = [(torch.randn(n, generator=g) * 10 ** torch.randn(n, generator=g)).to(DEV) for n in SIZES]
    tensors += [torch.randn(37, 129, generator=g).to(DEV).t(), torch.randn(40, 64, generator=g).to(DEV)[:, ::3],
                torch.empty(0, device=DEV)]
    assert not tensors[-3].is_contiguous() and not tensors[-2].is_contiguous()
    expected = sum(float(t.double().pow(2).sum()) for t in tensors)
    got = squares(tensors)
    assert got.dtype == torch.float64 and got.device.type == torch.device(DEV).type
    assert float(got) == pytest.approx(expected, rel=1e-12)
    assert torch.equal(got, squares(tensors))
    for bad in (float("inf"), float("nan")):
        spoiled = [t.clone() for t in tensors[:3]]
        spoiled[2][1234] = bad
        assert not torch.isfinite(squares(spoiled))

"""The fused causal attention (aner.kernels.attention) and cuDNN's (aner.kernels.cudnn_attention)
against float64 autograd of softmax(q k^T / sqrt(E)) v, and against PyTorch's own attention in the
same dtype.

Runs on a CUDA device, or on the CPU under Triton's interpreter (TRITON_INTERPRET=1) with small
shapes (ours only); skips otherwise, and cuDNN's where nvidia-cudnn-frontend is not installed.
Output and the three gradients: each within twice the error of PyTorch's
scaled_dot_product_attention in the same dtype plus two units of the dtype's rounding at the
reference's largest magnitude; the same inputs give the same bits on every run.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from kernel_device import INTERPRET, device_or_skip

DEV = device_or_skip()

from aner.errors import ConfigError  # noqa: E402
from aner.kernels import cudnn_attention  # noqa: E402
from aner.kernels.attention import attention  # noqa: E402

bf16_gpu_only = pytest.mark.skipif(INTERPRET, reason="the interpreter's BF16 is unreliable")
DTYPES = [torch.float16, pytest.param(torch.bfloat16, marks=bf16_gpu_only)]
EPS = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}
# (B, H, K, T, E): grouped heads, lengths that are not multiples of the tiles, both head widths
IMPLS = [pytest.param(attention, id="ours"),
         pytest.param(cudnn_attention.attention, id="cudnn", marks=pytest.mark.skipif(
             INTERPRET or not cudnn_attention.available(), reason="needs a CUDA device and nvidia-cudnn-frontend"))]
SHAPES = [(1, 2, 1, 70, 64), (2, 3, 3, 33, 16), (1, 2, 2, 130, 128)]
if not INTERPRET:
    SHAPES += [(1, 9, 3, 300, 64), (2, 32, 8, 1024, 64), (1, 32, 8, 1024, 128), (1, 4, 1, 1, 64), (3, 4, 2, 200, 32)]


def inputs(B, H, K, T, E, dtype, seed=0):
    """q, k, v as the model hands them over (transposed views of (B, T, n, E) projections) and an
    upstream gradient in the layout the model's reshape gives back."""
    g = torch.Generator(device=DEV).manual_seed(seed)

    def heads(n):
        return torch.randn(B, T, n, E, device=DEV, generator=g).to(dtype).transpose(1, 2)
    return heads(H), heads(K), heads(K), heads(H)


def reference(q, k, v, do):
    """float64 output and gradients of causal attention with head h reading key/value head h // (H / K)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    s = q @ k.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    T = q.shape[2]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=DEV).tril(), float("-inf"))
    out = torch.softmax(s, -1) @ v.repeat_interleave(group, 1)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do.double()))


def run(fn, q, k, v, do):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), do))


def torch_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_against_float64(impl, shape, dtype):
    q, k, v, do = inputs(*shape, dtype)
    want = reference(q, k, v, do)
    ours, theirs = run(impl, q, k, v, do), run(torch_attention, q, k, v, do)
    for name, got, base, ref in zip(("out", "dq", "dk", "dv"), ours, theirs, want):
        assert got.shape == ref.shape and got.dtype == dtype
        err = (got.double() - ref).abs().max().item()
        bound = 2 * (base.double() - ref).abs().max().item() + 2 * EPS[dtype] * ref.abs().max().item()
        assert err <= bound, f"{name}: error {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_of_one_tensors_heads_are_one_tensors_heads(impl):
    """q, k and v as the heads of one (B, T, H + 2 K, E) tensor (as rope hands them over): their
    gradients are the heads of one tensor of that layout, with the bits of q, k and v apart."""
    from aner.model.llama import side_by_side
    B, H, K, T, E = 2, 4, 2, 70, 64
    dtype = torch.float16
    q, k, v, do = inputs(B, H, K, T, E, dtype, seed=2)
    whole = torch.cat([x.transpose(1, 2) for x in (q, k, v)], 2)
    heads = [x.transpose(1, 2) for x in whole.split([H, K, K], 2)]
    apart, joint = run(impl, q, k, v, do), run(impl, *heads, do)
    assert all(torch.equal(a, b) for a, b in zip(apart, joint))
    assert all(g.stride() == x.stride() for g, x in zip(joint[1:], heads))
    assert side_by_side([g.transpose(1, 2) for g in joint[1:]], 2) is not None


@pytest.mark.parametrize("impl", IMPLS)
def test_output_layout_and_determinism(impl):
    """The output is (B, H, T, E) over (B, T, H, E) memory (the model's reshape is a view), and five
    runs, and a CUDA graph's replay, give the same bits, gradients included."""
    shape = (2, 8, 2, 1024, 128) if not INTERPRET else (1, 4, 2, 65, 64)
    dtype = torch.bfloat16 if not INTERPRET else torch.float16
    q, k, v, do = inputs(*shape, dtype, seed=1)
    first = run(impl, q, k, v, do)
    for _ in range(4):
        assert all(torch.equal(a, b) for a, b in zip(first, run(impl, q, k, v, do)))
    assert first[0].transpose(1, 2).is_contiguous()
    if not INTERPRET:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = run(impl, q, k, v, do)
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(first, replayed))


def test_errors():
    q, k, v, _ = inputs(1, 4, 2, 16, 64, torch.float16)
    with pytest.raises(ConfigError, match="float32"):
        attention(q.float(), k.float(), v.float())
    with pytest.raises(ConfigError, match="dividing"):
        attention(q, *inputs(1, 3, 3, 16, 64, torch.float16)[1:3])
    with pytest.raises(ConfigError, match="head width 96"):
        attention(*inputs(1, 2, 2, 16, 96, torch.float16)[:3])
    with pytest.raises(ConfigError, match="last dimension"):
        attention(q.transpose(2, 3), k.transpose(2, 3), v.transpose(2, 3))
    with pytest.raises(ConfigError, match="accepted: q"):
        attention(q, k[:, :, :8], v)
    with pytest.raises(ConfigError, match="head width 136; accepted: .* multiple of 8 up to 128"):
        cudnn_attention.attention(*inputs(1, 2, 2, 16, 136, torch.float16)[:3])
    with pytest.raises(ConfigError, match="dividing"):
        cudnn_attention.attention(q, *inputs(1, 3, 3, 16, 64, torch.float16)[1:3])

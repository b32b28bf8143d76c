"""Fused RoPE, RMSNorm and SwiGLU kernels (Triton) for training: each reads its input once and
writes its output once, in the dtype the next matmul wants, forward and backward.

    rope      (B, n, T, E) -> (B, n, T, E)   out = x * cos + swap_pairs(x) * sin
    rms_norm  (..., D) -> (..., D)           y = (x * rsqrt(mean(x^2) + eps)) * weight
    swiglu    (..., F), (..., F) -> (..., F)  y = silu(gate) * up

Written with torch ops, RoPE is a conversion, two products, a flip and a sum, each a kernel
writing an FP32 tensor, and RMSNorm about six; here each direction of each op is one kernel. The
pure-torch references, and the tests' oracles, are `apply_rope` and `RMSNorm` in aner.model.llama.

Numerics. rope: x, cos and sin in FP32; each product rounded, then the sum rounded (every rope
launch passes enable_fp_fusion=False, so no FMA rounds once instead), then one rounding to
out_dtype: the same bits as `apply_rope(x, cos, sin).to(out_dtype)`. Its backward gives the same
bits as torch autograd through that expression: dx[e] = g[e] * cos[e] + g[e^1] * sin[e^1] in FP32
(the gradient reaches x by two paths, x * cos and the flip; their FP32 sum is commutative), one
rounding to x's dtype. rms_norm: per row r = rsqrt(sum(x^2) / D + eps) in FP32 (tl.rsqrt: within
2 ulp on the GPU), y = (x * r) * weight in FP32, one rounding to out_dtype; the sum of squares is
reduced in another order than torch's, so y agrees to FP32 accuracy, not bit for bit. Backward
keeps x and r (FP32), not y: dx = r * (dy*w - xhat * mean(dy*w*xhat)), xhat = x * r, all in FP32. swiglu: gate and up in
FP32, sigmoid = 1 / (1 + exp(-gate)) (IEEE division, the GPU's exp), y = gate * sigmoid * up
rounded once (the torch expression also rounds silu(gate) to the operands' dtype first); its
backward recomputes the sigmoid from the saved gate and up, and rounds each gradient once.

Determinism: no atomics, no autotuning. dweight = sum over rows of dy * xhat: each backward
program sums its fixed block of rows in row order into one partial row, and `sum_splits` adds the
partials in order; the number of partials is a fixed function of the row count. The same inputs
give the same bits on every run.
"""
import torch
import triton
import triton.language as tl
from torch import nn

from ..errors import ConfigError
from . import FLOATS
from .splits import sum_splits

TARGET_PROGRAMS = 264   # rms_norm backward: two programs per multiprocessor on an H200/H100 SXM


@triton.jit
def _rope_kernel(x, cos, sin, out, n, T, E, sxb, sxh, sxt, sob, soh, sot,
                 BACKWARD: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
    """out[t, e] = x[t, e] * cos[t, e] + x[t, e^1] * sin[t, e] for BT positions of one (b, head);
    BACKWARD reads sin[t, e^1] instead (the gradient through the flip). FP32, one final rounding.
    Rows are loaded whole and split into their even and odd elements (vector loads, no gather)."""
    b = tl.program_id(0) // n
    h = tl.program_id(0) % n
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    mask = (t < T)[:, None] & (e < E)[None, :]
    t64 = t.to(tl.int64)[:, None]
    src = x + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + t64 * sxt
    x0, x1 = tl.split(tl.reshape(tl.load(src + e[None, :], mask=mask, other=0.0).to(tl.float32), (BT, BE // 2, 2)))
    c0, c1 = tl.split(tl.reshape(tl.load(cos + t64 * E + e[None, :], mask=mask, other=0.0), (BT, BE // 2, 2)))
    s0, s1 = tl.split(tl.reshape(tl.load(sin + t64 * E + e[None, :], mask=mask, other=0.0), (BT, BE // 2, 2)))
    if BACKWARD:
        s0, s1 = s1, s0
    y0 = x0 * c0 + x1 * s0                          # two roundings of products, one of the sum
    y1 = x1 * c1 + x0 * s1
    y = tl.reshape(tl.join(y0, y1), (BT, BE))
    dst = out + b.to(tl.int64) * sob + h.to(tl.int64) * soh + t64 * sot
    tl.store(dst + e[None, :], y.to(out.dtype.element_ty), mask=mask)


def _rope_launch(x, cos, sin, out, backward: bool) -> torch.Tensor:
    """Rotate x (B, n, T, E), last stride 1, into out (same shape, any strides, last stride 1)."""
    B, n, T, E = x.shape
    be = triton.next_power_of_2(E)
    bt = max(1, 4096 // be)                         # a fixed function of E: one compile per head width
    if out.numel():
        _rope_kernel[(B * n, triton.cdiv(T, bt))](
            x, cos, sin, out, n, T, E, *x.stride()[:3], *out.stride()[:3],
            BACKWARD=backward, BT=bt, BE=be, num_warps=4, enable_fp_fusion=False)
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, out_dtype):
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        # empty_like keeps x's strides: the layout torch's elementwise result would have.
        return _rope_launch(x, cos, sin, torch.empty_like(x, dtype=out_dtype), backward=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        if g.stride(-1) != 1:                       # e.g. an expanded gradient (stride 0)
            g = g.contiguous()
        dx = _rope_launch(g, cos, sin, torch.empty_like(g, dtype=ctx.x_dtype), backward=True)
        return dx, None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """`apply_rope(x, cos, sin).to(out_dtype)`, bit for bit, with its gradient for x.

    x (B, n, T, E) FP32/FP16/BF16 with any strides whose last is 1 (the model's transposed view of
    a projection); cos and sin (T, E) FP32 contiguous, as `rope_tables` makes them. The output has
    x's layout."""
    if x.dtype not in FLOATS or out_dtype not in FLOATS:
        raise ConfigError(f"rope x dtype {x.dtype} -> out_dtype {out_dtype}; accepted: float32, float16 or bfloat16")
    if x.dim() != 4:
        raise ConfigError(f"rope x has shape {tuple(x.shape)}; accepted: (B, n, T, E)")
    T, E = x.shape[2:]
    if E % 2:
        raise ConfigError(f"rope head width E={E} is odd; accepted: an even E (pairs are rotated)")
    if x.stride(-1) != 1:
        raise ConfigError(f"rope x has strides {x.stride()}; accepted: any with the last dimension's stride 1")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, E) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ConfigError(f"rope {name} is {t.dtype} {tuple(t.shape)} with strides {t.stride()}; "
                              f"accepted: float32 ({T}, {E}) contiguous, from rope_tables")
        if t.device != x.device:
            raise ConfigError(f"rope {name} is on {t.device}, x on {x.device}; accepted: the same device")
    return _Rope.apply(x, cos, sin, out_dtype)


@triton.jit
def _rms_forward_kernel(x, w, y, r, D, eps, BD: tl.constexpr):
    """One row: r = rsqrt(sum(x^2) / D + eps), y = (x * r) * w rounded to y's dtype; FP32."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    mask = d < D
    xv = tl.load(x + row * D + d, mask=mask, other=0.0)
    rr = tl.rsqrt(tl.sum(xv * xv, axis=0) / D + eps)
    wv = tl.load(w + d, mask=mask, other=0.0)
    tl.store(y + row * D + d, ((xv * rr) * wv).to(y.dtype.element_ty), mask=mask)
    tl.store(r + row, rr)


@triton.jit
def _rms_backward_kernel(dy, x, w, r, dx, part, M, D, ROWS: tl.constexpr, HAS_DW: tl.constexpr,
                         BD: tl.constexpr):
    """Rows [pid, pid + 1) * ROWS, in order: dx = r * (dy*w - xhat * mean(dy*w*xhat)) and, when
    HAS_DW, part[pid] = the sum of dy * xhat over those rows; FP32."""
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    mask = d < D
    wv = tl.load(w + d, mask=mask, other=0.0)
    acc = tl.zeros((BD,), dtype=tl.float32)
    # A constexpr trip count: the interpreter cannot run a runtime bound.
    for i in range(0, ROWS):
        row = pid * ROWS + i
        if row < M:
            ofs = row.to(tl.int64) * D + d
            rr = tl.load(r + row)
            g = tl.load(dy + ofs, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.load(x + ofs, mask=mask, other=0.0) * rr      # the forward's x * r, same bits
            gw = g * wv
            c = tl.sum(gw * xhat, axis=0) / D
            tl.store(dx + ofs, rr * (gw - xhat * c), mask=mask)
            if HAS_DW:
                acc += g * xhat
    if HAS_DW:
        tl.store(part + pid.to(tl.int64) * D + d, acc, mask=mask)


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, eps, out_dtype):
        M, D = x2d.shape
        bd = triton.next_power_of_2(D)
        y = torch.empty(M, D, device=x2d.device, dtype=out_dtype)
        r = torch.empty(M, device=x2d.device, dtype=torch.float32)
        if M:
            _rms_forward_kernel[(M,)](x2d, weight, y, r, D, eps, BD=bd, num_warps=_warps(bd))
        ctx.save_for_backward(x2d, weight, r)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x2d, weight, r = ctx.saved_tensors
        M, D = x2d.shape
        bd = triton.next_power_of_2(D)
        has_dw = ctx.needs_input_grad[1]
        # Rows per program: a power of two, so a run with many micro-batch shapes compiles a
        # handful of variants (one per ROWS), not one per row count; a fixed function of M.
        per = triton.next_power_of_2(triton.cdiv(M, TARGET_PROGRAMS)) if M else 1
        programs = max(1, triton.cdiv(M, per))
        dx = torch.empty_like(x2d)
        part = torch.empty(programs, D, device=x2d.device, dtype=torch.float32) if has_dw else None
        if M:
            _rms_backward_kernel[(programs,)](
                dy.contiguous(), x2d, weight, r, dx, x2d if part is None else part, M, D, ROWS=per,
                HAS_DW=has_dw, BD=bd, num_warps=_warps(bd))
        dw = None if part is None else sum_splits(part)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm of x (..., D) FP32 contiguous by weight (D,) FP32, in out_dtype (FP32, FP16 or BF16),
    with gradients for x and weight (when it requires one)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        raise ConfigError(f"rms_norm x is {x.dtype}, weight {weight.dtype}; accepted: float32 both")
    if out_dtype not in FLOATS:
        raise ConfigError(f"rms_norm out_dtype {out_dtype}; accepted: float32, float16 or bfloat16")
    if x.dim() < 1 or x.shape[-1] < 1 or weight.shape != x.shape[-1:]:
        raise ConfigError(f"rms_norm x {tuple(x.shape)}, weight {tuple(weight.shape)}; accepted: (..., D) and (D,)")
    if not x.is_contiguous() or not weight.is_contiguous():
        raise ConfigError(f"rms_norm x strides {x.stride()}, weight {weight.stride()}; accepted: contiguous")
    if weight.device != x.device:
        raise ConfigError(f"rms_norm weight is on {weight.device}, x on {x.device}; accepted: the same device")
    D = x.shape[-1]
    return _RMSNorm.apply(x.view(-1, D), weight, float(eps), out_dtype).view(x.shape)


@triton.jit
def _swiglu_kernel(gate, up, g, out, dup, numel, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    """Forward: out = silu(gate) * up. BACKWARD: out = d gate, dup = d up, from g = d out. FP32,
    one rounding per output; the sigmoid is 1 / (1 + exp(-gate)) with an IEEE division."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    a = tl.load(gate + i, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up + i, mask=mask, other=0.0).to(tl.float32)
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-a))
    if BACKWARD:
        dy = tl.load(g + i, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + i, (dy * b * s * (1.0 + a * (1.0 - s))).to(out.dtype.element_ty), mask=mask)
        tl.store(dup + i, (dy * a * s).to(dup.dtype.element_ty), mask=mask)
    else:
        tl.store(out + i, (a * s * b).to(out.dtype.element_ty), mask=mask)


_SWIGLU_BLOCK = 4096


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        out = torch.empty(gate.shape, device=gate.device, dtype=torch.promote_types(gate.dtype, up.dtype))
        grid = (triton.cdiv(gate.numel(), _SWIGLU_BLOCK),)
        if gate.numel():
            _swiglu_kernel[grid](gate, up, gate, out, out, gate.numel(), BACKWARD=False, BLOCK=_SWIGLU_BLOCK,
                                 num_warps=8)
        ctx.save_for_backward(gate, up)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        gate, up = ctx.saved_tensors
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        grid = (triton.cdiv(gate.numel(), _SWIGLU_BLOCK),)
        if gate.numel():
            _swiglu_kernel[grid](gate, up, g.contiguous(), dgate, dup, gate.numel(), BACKWARD=True,
                                 BLOCK=_SWIGLU_BLOCK, num_warps=8)
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up computed in FP32 and rounded once to their promoted dtype (the torch
    expression rounds silu(gate) first), with gradients for both; same-shaped contiguous tensors."""
    if gate.dtype not in FLOATS or up.dtype not in FLOATS:
        raise ConfigError(f"swiglu gate {gate.dtype}, up {up.dtype}; accepted: float32, float16 or bfloat16")
    if gate.shape != up.shape or gate.device != up.device:
        raise ConfigError(f"swiglu gate {tuple(gate.shape)} on {gate.device}, up {tuple(up.shape)} on "
                          f"{up.device}; accepted: the same shape on the same device")
    if not gate.is_contiguous() or not up.is_contiguous():
        raise ConfigError(f"swiglu gate strides {gate.stride()}, up {up.stride()}; accepted: contiguous")
    return _SwiGLU.apply(gate, up)


class FusedRMSNorm(nn.Module):
    """`RMSNorm` through `rms_norm`: its output in the autocast dtype while autocast is on (the
    operand dtype of the projections that read it), else FP32."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x):
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.float32
        return rms_norm(x.float(), self.weight.float(), self.eps, dtype)

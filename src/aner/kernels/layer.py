"""Fused RoPE, RMSNorm and SwiGLU kernels (Triton) for training: each reads its input once and
writes its output once, in the dtype the next matmul wants, forward and backward.

    rope      q, k, v -> (q', k', v)         x' = x * cos + swap_pairs(x) * sin, (B, n, T, E) each
    rms_norm  (..., D) -> (..., D)           y = (x * rsqrt(mean(x^2) + eps)) * weight
    add_rms_norm  x, y -> (rms_norm(x + y), x + y)   the residual add in the norm's own pass
    swiglu    (..., F), (..., F) -> (..., F)  y = silu(gate) * up

Written with torch ops, RoPE is a conversion, two products, a flip and a sum, each a kernel
writing an FP32 tensor, and RMSNorm about six; here each direction of each op is one kernel. The
pure-torch references, and the tests' oracles, are `apply_rope` and `RMSNorm` in aner.model.llama.

Numerics. rope: x, cos and sin in FP32; each product rounded, then the sum rounded (every rope
launch passes enable_fp_fusion=False, so no FMA rounds once instead), then one rounding to
out_dtype: the same bits as `apply_rope(x, cos, sin).to(out_dtype)`. Its backward gives the same
bits as torch autograd through that expression: dx[e] = g[e] * cos[e] + g[e^1] * sin[e^1] in FP32
(the gradient reaches x by two paths, x * cos and the flip; their FP32 sum is commutative), one
rounding to x's dtype. rms_norm: per row r = rsqrt(sum(x^2) / D + eps) in FP32 (tl.rsqrt: within 2
ulp on the GPU), y = (x * r) * weight in FP32, one rounding to out_dtype; the sum of squares is
reduced in another order than torch's, so y agrees to FP32 accuracy, not bit for bit. Backward
keeps x and r (FP32), not y: dx = r * (dy*w - xhat * mean(dy*w*xhat)), xhat = x * r, all in FP32.
add_rms_norm: s = x + y in FP32 (y converted exactly: torch's promoted sum, the same bits), then
rms_norm of s; its backward adds the gradient reaching s from the rest of the stream to dx in FP32
and gives y that sum rounded once to y's dtype. swiglu: gate and up in FP32, sigmoid = 1 / (1 +
exp(-gate)) (IEEE division, the GPU's exp), y = gate * sigmoid * up rounded once (the torch
expression also rounds silu(gate) to the operands' dtype first); its backward recomputes the
sigmoid from the saved gate and up, and rounds each gradient once.

Determinism: no atomics, no autotuning. dweight = sum over rows of dy * xhat: each backward
program sums its fixed block of rows into one partial row, a tile of rows at a time in row order
(the tile's rows summed first), and `sum_splits` adds the partials in order; the number of
partials and the tile are fixed functions of the row count and the width. The same inputs
give the same bits on every run.
"""
import torch
import triton
import triton.language as tl
from torch import nn

from ..errors import ConfigError
from ..model.llama import side_by_side
from . import FLOATS, TARGET_PROGRAMS
from .attention import heads, heads_of_one
from .launch import after_prior, launch_options
from .splits import sum_splits


@triton.jit
def _rope_kernel(x, cos, sin, out, n, rotated, T, E, sxb, sxh, sxt, sob, soh, sot,
                 BACKWARD: tl.constexpr, BH: tl.constexpr, BT: tl.constexpr, BE: tl.constexpr):
    """out[t, e] = x[t, e] * cos[t, e] + x[t, e^1] * sin[t, e] for BT positions of BH heads of one
    b (cos and sin read once for all of them); BACKWARD reads sin[t, e^1] instead (the gradient
    through the flip). FP32, one final rounding. Heads from `rotated` on are copied as they are.
    Rows are loaded whole and split into their even and odd elements (vector loads, no gather)."""
    after_prior()
    blocks = tl.cdiv(n, BH)
    b = tl.program_id(0) // blocks
    h = (tl.program_id(0) % blocks) * BH + tl.arange(0, BH)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    e = tl.arange(0, BE)
    rows = (t < T)[:, None] & (e < E)[None, :]
    mask = (h < n)[:, None, None] & rows[None, :, :]
    t64 = t.to(tl.int64)[:, None]
    at = h.to(tl.int64)[:, None, None] * sxh + (t64 * sxt + e[None, :])[None, :, :]
    x0, x1 = tl.split(tl.reshape(tl.load(x + b.to(tl.int64) * sxb + at, mask=mask, other=0.0).to(tl.float32),
                                 (BH, BT, BE // 2, 2)))
    c0, c1 = tl.split(tl.reshape(tl.load(cos + t64 * E + e[None, :], mask=rows, other=0.0), (1, BT, BE // 2, 2)))
    s0, s1 = tl.split(tl.reshape(tl.load(sin + t64 * E + e[None, :], mask=rows, other=0.0), (1, BT, BE // 2, 2)))
    if BACKWARD:
        s0, s1 = s1, s0
    rotate = (h < rotated)[:, None, None]
    y0 = tl.where(rotate, x0 * c0 + x1 * s0, x0)    # two roundings of products, one of the sum
    y1 = tl.where(rotate, x1 * c1 + x0 * s1, x1)
    y = tl.reshape(tl.join(y0, y1), (BH, BT, BE))
    at = h.to(tl.int64)[:, None, None] * soh + (t64 * sot + e[None, :])[None, :, :]
    tl.store(out + b.to(tl.int64) * sob + at, y.to(out.dtype.element_ty), mask=mask)


# (heads, elements) a program: 16 heads share their positions' cos and sin (at Llama-3.2-1B's attention on an
# H100 2.75 TB/s against one head's 1.92, `benchmarks/rope_tiles.py`)
ROPE_TILE = (16, 4096)


def _rope_launch(x, cos, sin, out, backward: bool, rotated: int | None = None, tile=ROPE_TILE) -> torch.Tensor:
    """Rotate x (B, n, T, E), last stride 1, into out (same shape, any strides, last stride 1; x
    itself too): its first `rotated` heads (all by default), the rest copied. `tile`: (heads,
    elements) a program, powers of two (the positions a program follow from E; the same bits at
    any tile)."""
    B, n, T, E = x.shape
    be = triton.next_power_of_2(E)
    bh = min(tile[0], triton.next_power_of_2(n))
    bt = max(1, tile[1] // (be * bh))               # a fixed function of E and n
    if out.numel():
        _rope_kernel[(B * triton.cdiv(n, bh), triton.cdiv(T, bt))](
            x, cos, sin, out, n, n if rotated is None else rotated, T, E, *x.stride()[:3], *out.stride()[:3],
            BACKWARD=backward, BH=bh, BT=bt, BE=be, num_warps=4, enable_fp_fusion=False, **launch_options(x.device))
    return out


class _Rope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtypes = q.dtype, k.dtype
        whole = heads_of_one(q, k, v)
        ctx.joint = whole is not None
        if ctx.joint:     # one launch; v copied: attention keeps it, not the projections' whole output
            H, K = q.shape[1], k.shape[1]
            out = torch.empty(whole.shape, device=v.device, dtype=v.dtype)
            _rope_launch(whole.transpose(1, 2), cos, sin, out.transpose(1, 2), backward=False, rotated=H + K)
            return heads(out, H, K)
        # empty_like keeps a dense input's strides: the layout torch's elementwise result would have.
        qr, kr = (torch.empty_like(x, dtype=v.dtype) for x in (q, k))
        return _rope_launch(q, cos, sin, qr, backward=False), _rope_launch(k, cos, sin, kr, backward=False), v

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gq, gk, gv):
        cos, sin = ctx.saved_tensors
        gq, gk = (g if g.stride(-1) == 1 else g.contiguous() for g in (gq, gk))   # e.g. expanded (stride 0)
        if not ctx.joint:
            dq, dk = torch.empty_like(gq, dtype=ctx.dtypes[0]), torch.empty_like(gk, dtype=ctx.dtypes[1])
            return (_rope_launch(gq, cos, sin, dq, backward=True), _rope_launch(gk, cos, sin, dk, backward=True), gv,
                    None, None)
        # laid out as the projections' outputs were: one product makes their input's
        (B, H, T, E), K = gq.shape, gk.shape[1]
        whole = heads_of_one(gq, gk, gv)
        if whole is not None and whole.dtype == ctx.dtypes[0]:    # attention's gradients in one tensor
            rotated = whole.transpose(1, 2)[:, :H + K]              # (`attention.grads_like`): rotated there
            _rope_launch(rotated, cos, sin, rotated, backward=True)
        else:
            whole = torch.empty(B, T, H + 2 * K, E, device=gq.device, dtype=ctx.dtypes[0])
            dq, dk, dv = heads(whole, H, K)
            dv.copy_(gv)
            _rope_launch(gq, cos, sin, dq, backward=True)
            _rope_launch(gk, cos, sin, dk, backward=True)
        return *heads(whole, H, K), None, None


def _check_rope(name, x, cos, sin):
    if x.dtype not in FLOATS:
        raise ConfigError(f"rope {name} dtype {x.dtype}; accepted: float32, float16 or bfloat16")
    if x.dim() != 4:
        raise ConfigError(f"rope {name} has shape {tuple(x.shape)}; accepted: (B, n, T, E)")
    T, E = x.shape[2:]
    if E % 2:
        raise ConfigError(f"rope head width E={E} is odd; accepted: an even E (pairs are rotated)")
    if x.stride(-1) != 1:
        raise ConfigError(f"rope {name} has strides {x.stride()}; accepted: any with the last dimension's stride 1")
    for table, t in (("cos", cos), ("sin", sin)):
        if t.shape != (T, E) or t.dtype != torch.float32 or not t.is_contiguous():
            raise ConfigError(f"rope {table} is {t.dtype} {tuple(t.shape)} with strides {t.stride()}; "
                              f"accepted: float32 ({T}, {E}) contiguous, from rope_tables")
        if t.device != x.device:
            raise ConfigError(f"rope {table} is on {t.device}, {name} on {x.device}; accepted: the same device")


def rope(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's `rope` (q and k by `apply_rope` rounded to v's dtype, v as it is), bit for bit,
    with gradients for q, k and v.

    q (B, H, T, E), k and v (B, K, T, E) FP32/FP16/BF16 with any strides whose last is 1 (the
    model's transposed views of its projections); cos and sin (T, E) FP32 contiguous, as
    `rope_tables` makes them. The outputs have q's and k's layout. When q, k and v are the heads of
    one tensor (one GEMM's output: `llama.Dense`'s products of a group), the outputs are the heads
    of one new tensor, made by one launch that copies v, so that the projections' output is not
    kept for attention's backward; the three gradients are heads of one tensor in that layout
    again, rotated in place where attention gives them so (`attention.grads_like`)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_rope(name, x, cos, sin)
    B, _, T, E = q.shape
    if k.shape != v.shape or (k.shape[0], *k.shape[2:]) != (B, T, E) or not q.device == k.device == v.device:
        raise ConfigError(f"rope q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} on {q.device}, {k.device}, "
                          f"{v.device}; accepted: (B, H, T, E), (B, K, T, E) twice, on one device")
    return _Rope.apply(q, k, v, cos, sin)


@triton.jit
def _rms_forward_kernel(x, y, s, w, out, r, D, eps, HAS_Y: tl.constexpr, BD: tl.constexpr):
    """One row: HAS_Y: s = x + y in FP32, stored; r = rsqrt(sum(s^2) / D + eps), out = (s * r) * w
    rounded to out's dtype; FP32."""
    after_prior()
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BD)
    mask = d < D
    sv = tl.load(x + row * D + d, mask=mask, other=0.0)
    if HAS_Y:
        sv += tl.load(y + row * D + d, mask=mask, other=0.0).to(tl.float32)
        tl.store(s + row * D + d, sv, mask=mask)
    rr = tl.rsqrt(tl.sum(sv * sv, axis=0) / D + eps)
    wv = tl.load(w + d, mask=mask, other=0.0)
    tl.store(out + row * D + d, ((sv * rr) * wv).to(out.dtype.element_ty), mask=mask)
    tl.store(r + row, rr)


@triton.jit
def _rms_backward_kernel(dout, s, w, r, ds, dx, dy, part, M, D, ROWS: tl.constexpr, STEP: tl.constexpr,
                         HAS_DS: tl.constexpr, HAS_DY: tl.constexpr, HAS_DW: tl.constexpr, BD: tl.constexpr):
    """Rows [pid, pid + 1) * ROWS, STEP rows at a time (one (STEP, BD) tile, in order): dx = r *
    (dout*w - shat * mean(dout*w*shat)) (+ ds, the gradient reaching s from elsewhere, when
    HAS_DS), and dy = dx in y's dtype when HAS_DY; when HAS_DW, part[pid] = the sum of dout * shat
    over those rows; FP32."""
    after_prior()
    pid = tl.program_id(0)
    d = tl.arange(0, BD)
    mask = d < D
    wv = tl.load(w + d, mask=mask, other=0.0)
    acc = tl.zeros((BD,), dtype=tl.float32)
    # A constexpr trip count: the interpreter cannot run a runtime bound.
    for i in range(0, ROWS, STEP):
        rows = pid * ROWS + i + tl.arange(0, STEP)
        live = rows < M
        inside = live[:, None] & mask[None, :]
        ofs = rows.to(tl.int64)[:, None] * D + d[None, :]
        rr = tl.load(r + rows, mask=live, other=0.0)
        g = tl.load(dout + ofs, mask=inside, other=0.0).to(tl.float32)
        shat = tl.load(s + ofs, mask=inside, other=0.0) * rr[:, None]      # the forward's s * r, same bits
        gw = g * wv[None, :]
        c = tl.sum(gw * shat, axis=1) / D
        grad = rr[:, None] * (gw - shat * c[:, None])
        if HAS_DS:
            grad += tl.load(ds + ofs, mask=inside, other=0.0)
        tl.store(dx + ofs, grad, mask=inside)
        if HAS_DY:
            tl.store(dy + ofs, grad.to(dy.dtype.element_ty), mask=inside)
        if HAS_DW:
            acc += tl.sum(g * shat, axis=0)
    if HAS_DW:
        tl.store(part + pid.to(tl.int64) * D + d, acc, mask=mask)


def _warps(block: int) -> int:
    return 16 if block >= 8192 else 8 if block >= 2048 else 4


def _backward_rows(M: int, step: int, has_dw: bool) -> tuple[int, int]:
    """(rows per program, programs) of a norm backward over M rows loaded `step` at a time. With
    the weight's gradient, each program sums its rows into one part: a power of two rows each for
    about TARGET_PROGRAMS parts, so a run with many micro-batch shapes compiles a handful of
    variants (one per ROWS), not one per row count. Without it (a frozen weight: LoRA, QLoRA), one
    step a program: as many programs as tiles (8192 rows of 2048: 65 against 85 us, of 576: 21
    against 28, of 4096: 127 against 140; `benchmarks/norm_kernels.py`). A fixed function of the
    shape and of whether the weight trains."""
    if not has_dw:
        return step, max(1, triton.cdiv(M, step))
    per = triton.next_power_of_2(triton.cdiv(M, TARGET_PROGRAMS)) if M else 1
    return per, max(1, triton.cdiv(M, per))


def _step_rows(block: int) -> int:
    """Rows a norm backward program loads at once: a tile of 4096 elements (8192 rows of 576: 28
    against 53 us a row at a time; of 2048: 75 against 91; of 4096, one row: 146 against 188 for two)."""
    return max(1, 4096 // block)


class _RMSNorm(torch.autograd.Function):
    """norm(x), or with y: (norm(s), s) for s = x + y."""

    @staticmethod
    def forward(ctx, x2d, y2d, weight, eps, out_dtype):
        M, D = x2d.shape
        bd = triton.next_power_of_2(D)
        out = torch.empty(M, D, device=x2d.device, dtype=out_dtype)
        r = torch.empty(M, device=x2d.device, dtype=torch.float32)
        s = x2d if y2d is None else torch.empty_like(x2d)
        if M:
            _rms_forward_kernel[(M,)](x2d, s if y2d is None else y2d, s, weight, out, r, D, eps,
                                      HAS_Y=y2d is not None, BD=bd, num_warps=_warps(bd), **launch_options(s.device))
        ctx.save_for_backward(s, weight, r)
        ctx.y_dtype = None if y2d is None else y2d.dtype
        ctx.set_materialize_grads(False)     # s unused after the last norm: no zeros to add
        return out if y2d is None else (out, s)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, ds=None):
        s, weight, r = ctx.saved_tensors
        M, D = s.shape
        bd = triton.next_power_of_2(D)
        has_dw = ctx.needs_input_grad[2]
        step = _step_rows(bd)
        per, programs = _backward_rows(M, step, has_dw)
        dx = torch.empty_like(s)
        dy = None if ctx.y_dtype is None else torch.empty(M, D, device=s.device, dtype=ctx.y_dtype)
        part = torch.empty(programs, D, device=s.device, dtype=torch.float32) if has_dw else None
        if M:
            _rms_backward_kernel[(programs,)](
                dout.contiguous(), s, weight, r, s if ds is None else ds.contiguous(), dx, dx if dy is None else dy,
                s if part is None else part, M, D, ROWS=per, STEP=min(per, step),
                HAS_DS=ds is not None, HAS_DY=dy is not None, HAS_DW=has_dw, BD=bd, num_warps=_warps(bd),
                **launch_options(s.device))
        dw = None if part is None else sum_splits(part)
        return dx, dy, dw, None, None


def _check_norm(x, weight, out_dtype):
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype) -> torch.Tensor:
    """RMSNorm of x (..., D) FP32 contiguous by weight (D,) FP32, in out_dtype (FP32, FP16 or BF16),
    with gradients for x and weight (when it requires one)."""
    _check_norm(x, weight, out_dtype)
    D = x.shape[-1]
    return _RMSNorm.apply(x.view(-1, D), None, weight, float(eps), out_dtype).view(x.shape)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(s), s) for the residual stream s = x + y: x FP32, y (a block's output) FP32, FP16
    or BF16 of x's shape, added in FP32 (torch's promoted sum, the same bits) in the norm's own
    pass. Backward takes the gradient reaching s from the rest of the stream into the same pass
    and gives y its gradient in y's dtype."""
    _check_norm(x, weight, out_dtype)
    if y.dtype not in FLOATS or y.shape != x.shape or y.device != x.device or not y.is_contiguous():
        raise ConfigError(f"add_rms_norm y is {y.dtype} {tuple(y.shape)} on {y.device}; accepted: float32, "
                          f"float16 or bfloat16, contiguous, x's shape {tuple(x.shape)} on {x.device}")
    D = x.shape[-1]
    out, s = _RMSNorm.apply(x.view(-1, D), y.view(-1, D), weight, float(eps), out_dtype)
    return out.view(x.shape), s.view(x.shape)


@triton.jit
def _swiglu_kernel(gate, up, g, out, dup, F, s_gate, s_up, s_g, s_out, s_dup,
                   BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    """BLOCK columns of one row (each tensor's rows s_* apart). Forward: out = silu(gate) * up.
    BACKWARD: out = d gate, dup = d up, from g = d out. FP32, one rounding per output; the sigmoid
    is 1 / (1 + exp(-gate)) with an IEEE division."""
    after_prior()
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = col < F
    a = tl.load(gate + row * s_gate + col, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(up + row * s_up + col, mask=mask, other=0.0).to(tl.float32)
    s = tl.math.div_rn(1.0, 1.0 + tl.exp(-a))
    if BACKWARD:
        dy = tl.load(g + row * s_g + col, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + row * s_out + col, (dy * b * s * (1.0 + a * (1.0 - s))).to(out.dtype.element_ty), mask=mask)
        tl.store(dup + row * s_dup + col, (dy * a * s).to(dup.dtype.element_ty), mask=mask)
    else:
        tl.store(out + row * s_out + col, (a * s * b).to(out.dtype.element_ty), mask=mask)


def _swiglu_launch(gate, up, g, out, dup, backward: bool):
    """Rows (M, F) of each operand, any row stride."""
    M, F = gate.shape
    block = min(4096, triton.next_power_of_2(F))
    while block > 512 and F % block:     # a row in whole blocks where it can be
        block //= 2
    if gate.numel():
        _swiglu_kernel[(M, triton.cdiv(F, block))](
            gate, up, g, out, dup, F, gate.stride(0), up.stride(0), g.stride(0), out.stride(0), dup.stride(0),
            BACKWARD=backward, BLOCK=block, num_warps=8 if block >= 2048 else 4, **launch_options(out.device))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        rows = gate.reshape(-1, gate.shape[-1]), up.reshape(-1, up.shape[-1])
        out = torch.empty(rows[0].shape, device=gate.device, dtype=torch.promote_types(gate.dtype, up.dtype))
        _swiglu_launch(*rows, out, out, out, backward=False)
        ctx.save_for_backward(*rows)
        ctx.shape = gate.shape
        return out.view(gate.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        dgate, dup = swiglu_grad(*ctx.saved_tensors, g)
        return dgate.view(ctx.shape), dup.view(ctx.shape)


def swiglu_grad(gate: torch.Tensor, up: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of silu(gate) * up for g, its output's gradient, for gate and up (M, F) (rows
    at any stride); side by side in one buffer where gate and up are (laid out as the projections'
    outputs were: one product makes their input's gradient)."""
    joint = side_by_side((gate, up), 1)
    if joint is not None:
        dgate, dup = torch.empty(joint.shape, device=gate.device, dtype=gate.dtype).split(gate.shape[1], dim=1)
    else:
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    _swiglu_launch(gate, up, g.reshape(gate.shape).contiguous(), dgate, dup, backward=True)
    return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up computed in FP32 and rounded once to their promoted dtype (the torch
    expression rounds silu(gate) first), with gradients for both; same-shaped tensors whose rows
    are contiguous (any row stride: e.g. columns of one product's output). When gate and up are
    side by side in one tensor, their gradients are too, one buffer."""
    if gate.dtype not in FLOATS or up.dtype not in FLOATS:
        raise ConfigError(f"swiglu gate {gate.dtype}, up {up.dtype}; accepted: float32, float16 or bfloat16")
    if gate.shape != up.shape or gate.device != up.device:
        raise ConfigError(f"swiglu gate {tuple(gate.shape)} on {gate.device}, up {tuple(up.shape)} on "
                          f"{up.device}; accepted: the same shape on the same device")
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ConfigError(f"swiglu gate strides {gate.stride()}, up {up.stride()}; accepted: rows of contiguous "
                          f"elements (the last stride 1)")
    return _SwiGLU.apply(gate, up)


class FusedRMSNorm(nn.Module):
    """`RMSNorm` through `rms_norm`: its output in the autocast dtype while autocast is on (the
    operand dtype of the projections that read it), else FP32."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x):
        return rms_norm(x, self.weight, self.eps, self._out_dtype())

    def add(self, x, y):
        """(norm(x + y), x + y) in one kernel; y None: (norm(x), x)."""
        if y is None:
            return self(x), x
        return add_rms_norm(x, y.contiguous(), self.weight, self.eps, self._out_dtype())

    @staticmethod
    def _out_dtype():
        return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else torch.float32

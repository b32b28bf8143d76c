"""The Llama forward, read top-down: norm, RoPE, attention, MLP, block, model.

Notation: B batch, T time, D model width, H query heads, K key/value heads, E head width (D/H),
F feed-forward width, V vocabulary.

This file knows nothing about files, adapters or quantization. Every matrix is reached through
one interface: a projection module maps (..., in) -> (..., out); the embedding module also has
`lookup(tokens)`. A dense weight (`Dense` below), a packed NF4 weight and an adapter-wrapped
weight all implement it, and are swapped in by replacing the module at its path.

Numerics follow llama.cpp's CPU graph so that FP32 logits agree to ~1e-5: RMSNorm is
x * rsqrt(mean(x^2) + eps) then times its weight; RoPE rotates adjacent pairs (x[2i], x[2i+1])
by pos * base^(-2i/E) (llama.cpp's "normal" mode, the layout GGUF stores Q/K in); attention is
softmax(QK^T / sqrt(E)) V with query head h reading key/value head h // (H/K).
"""
import math
from array import array

import torch
import torch.nn.functional as F
from torch import nn

from .config import LlamaConfig


class Dense(nn.Module):
    """A floating weight used as a projection (x @ W^T) or as an embedding table (rows of W).

    Weights are held as the very tensors the caller passes (no `nn.Parameter` copy of the
    handle), so whoever owns them decides what is trainable and where gradients land.
    """

    keeps_operand = True   # its operand is a cast: kept for backward, as autocast's product keeps it

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = weight
        self.cast = None   # the weight's cast, kept for a training run (`train.loop.kept_casts`)
        self.room = None   # (buffer, left): the cast at the buffer's first rows from column left, with
        #                    columns beside it and rows under it to spare for an adapter's joins

    @property
    def spare_room(self) -> bool:
        """Whether its kept cast has columns or rows to spare (`kernels.lora`'s joins)."""
        return self.room is not None

    def forward(self, x):
        if not torch.is_autocast_enabled(x.device.type):
            return F.linear(x, self.weight.to(x.dtype))
        if self.weight.requires_grad:
            return self.joint(x, (self,))[0]
        return F.linear(x, self.cast_to(torch.get_autocast_dtype(x.device.type)))  # autocast casts x

    @staticmethod
    def joint(x, modules):
        """The outputs of `modules` for one input x: trained weights under a low-precision policy
        together (one product of their casts laid one under another), otherwise each on its own."""
        dev = x.device.type
        if torch.is_autocast_enabled(dev) and all(m.weight.requires_grad for m in modules):
            dtype = torch.get_autocast_dtype(dev)
            casts = [m.cast_to(dtype) for m in modules]    # a group's kept casts lie so (`train.loop.kept_casts`)
            return _TrainedProjections.apply(x, dtype, one_under_another(casts), [c.shape[0] for c in casts], None,
                                             *(m.weight for m in modules))
        return tuple(m(x) for m in modules)

    @staticmethod
    def gated_mlp(x, gate, up, down):
        """The feed-forward down(silu(gate(x)) * up(x)) of trained weights under a FP16/BF16 policy
        with the SwiGLU inside the GEMMs (`kernels.mlp`): gate's and up's product (their casts one
        under another) makes h in the same kernel, and down's input gradient gives theirs in place
        of dh. None where the kernels do not take it (not a Hopper GPU; gate and up of other widths,
        or of one not a multiple of 8), for the caller to make the projections and the SwiGLU apart."""
        dev = x.device.type
        modules = (gate, up, down)
        if not torch.is_autocast_enabled(dev) or not all(m.weight.requires_grad for m in modules):
            return None
        from ..kernels import mlp      # Gluon: imported where it may run
        dtype = torch.get_autocast_dtype(dev)
        casts = [m.cast_to(dtype) for m in modules]
        x2d = x.reshape(-1, x.shape[-1]).to(dtype).contiguous()
        F_ = casts[0].shape[0]
        if casts[1].shape != casts[0].shape or F_ % 8 or not mlp.supported(x2d, *casts):
            return None
        g, u, h = _TrainedProjections.apply(x2d, dtype, one_under_another(casts[:2]), [F_, F_], "gate", gate.weight,
                                            up.weight)
        (out,) = _TrainedProjections.apply(h, dtype, casts[2], [casts[2].shape[0]], "down", g, u, down.weight)
        return out.view(*x.shape[:-1], out.shape[-1])

    def cast_to(self, dtype):
        """The weight in `dtype`, detached: its kept cast when it has one in that dtype."""
        if self.cast is not None and self.cast.dtype == dtype:
            return self.cast
        return self.weight.detach().to(dtype)

    def operand(self, dtype, left: int = 0, right: int = 0, below: int = 0, out: torch.Tensor | None = None):
        """A frozen weight as a product's operand in `dtype` (the weight itself when stored in it,
        its kept cast during a run); None for a trained one. With `left` and `right` columns
        beside it and `below` rows under it (an adapter's joins, `kernels.lora`), the view of
        the kept cast's room that holds them, as the joins last wrote them; copied into `out`
        when given."""
        if self.weight.requires_grad:
            return None
        if left or right or below:
            buffer, at = self.room
            N, K = self.weight.shape
            assert left <= at and at + K + right <= buffer.shape[1] and N + below <= buffer.shape[0]
            w = buffer[:N + below, at - left:at + K + right]
        else:
            w = self.cast_to(dtype)
        return w if out is None else out.copy_(w)

    def lookup(self, tokens):
        return F.embedding(tokens, self.weight)


class _TrainedProjections(torch.autograd.Function):
    """x @ W_i^T for trained FP32 weights that read one x, under a low-precision policy, as one
    product: x in `dtype` times their casts to it laid one under another (`stacked`, `rows` each)
    with FP32 accumulation, as autocast makes a product; the outputs are its columns, side by side.
    Each weight's gradient g_i^T x is accumulated in FP32 and written in FP32 by its GEMM (CUDA).
    Through autocast it came out of the GEMM rounded to `dtype`, transposed, and was then converted
    and made contiguous: two more passes over every weight an update, and a rounding.

    The input gradient: when the outputs' gradients come back side by side as the outputs were
    (the fused RoPE and SwiGLU lay them out so), one GEMM over all the rows, and the weights'
    gradients one GEMM, each weight's its rows; otherwise one chain of products into one buffer
    (dx = g_0 @ W_0, then dx += g_i @ W_i inside each next GEMM, rounding dx to `dtype` each time),
    so no pass adds them.

    `swiglu` (`Dense.gated_mlp`, x 2-D): "gate" for gate and up, whose product also makes h =
    silu(gate) * up (a third output, not differentiable) in one kernel (`kernels.mlp`); "down"
    for down reading that h, with gate and up the first tensors: their gradients, not h's, the
    SwiGLU's backward inside down's input gradient's GEMM."""

    @staticmethod
    def forward(ctx, x, dtype, stacked, rows, swiglu, *tensors):
        x = x.to(dtype)
        ctx.gated = tensors[:2] if swiglu == "down" else ()
        ctx.save_for_backward(x, stacked, *ctx.gated)
        ctx.rows = rows
        if swiglu == "gate":
            from ..kernels import mlp      # Gluon: imported where it may run
            outs = mlp.gated_forward(x, *stacked.split(rows))
            ctx.mark_non_differentiable(outs[2])
            ctx.set_materialize_grads(False)
            return outs
        return F.linear(x, stacked).split(rows, -1)

    @staticmethod
    def backward(ctx, *gs):
        x, stacked, *gated = ctx.saved_tensors
        x2d = x.flatten(0, -2)
        g2d = [g.flatten(0, -2) for g in gs[:len(ctx.rows)]]                # not h's ("gate")
        needs = ctx.needs_input_grad[5 + len(gated):]
        g_all = side_by_side(g2d, 1)
        pairs = [(g_all, stacked)] if g_all is not None else list(zip(g2d, stacked.split(ctx.rows)))
        dx = None
        if gated:                                                           # "down": gate's and up's
            if any(ctx.needs_input_grad[5:7]):
                from ..kernels import layer, mlp      # Gluon: imported where it may run
                g = g2d[0].contiguous()
                dx = mlp.gated_backward(g, stacked, *gated) if mlp.supported(g, stacked, *gated) else \
                    layer.swiglu_grad(*gated, g @ stacked)
        elif ctx.needs_input_grad[0]:
            for g, w in pairs:
                dx = g @ w if dx is None else dx.addmm_(g, w)
            dx = dx.view(x.shape)
        if g_all is not None and all(needs):
            dws = torch.mm(g_all.t(), x2d, out_dtype=torch.float32).split(ctx.rows)
        else:
            dws = [torch.mm(g.t(), x2d, out_dtype=torch.float32) if need else None for g, need in zip(g2d, needs)]
        if gated:
            return None, None, None, None, None, *(dx or (None, None)), *dws
        return dx, None, None, None, None, *dws


def side_by_side(tensors, dim: int):
    """The one tensor that `tensors` are consecutive slices of along `dim` (one storage, one dtype,
    the same strides and other sizes, each starting where the one before ends), as a view; else None."""
    def rest(t):
        return t.dtype, t.stride(), t.untyped_storage().data_ptr(), t.shape[:dim] + t.shape[dim + 1:]
    size = list(tensors[0].shape)
    for a, b in zip(tensors, tensors[1:]):
        if rest(b) != rest(a) or b.storage_offset() != a.storage_offset() + a.shape[dim] * a.stride(dim):
            return None
        size[dim] += b.shape[dim]
    return tensors[0].as_strided(size, tensors[0].stride(), tensors[0].storage_offset())


def one_under_another(tensors):
    """`tensors` (of one width) as one matrix, one under another: the view of them where they lie
    so (`side_by_side`), else a copy."""
    stacked = side_by_side(tensors, 0)
    return torch.cat(tensors) if stacked is None else stacked


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = weight
        self.eps = eps

    def forward(self, x):
        x = x.float()  # norms run in FP32 under every precision policy
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def add(self, x, y):
        """(norm(x + y), x + y): the residual stream x after adding a block's output y (None:
        nothing to add), and its norm (a fused norm makes both in one pass)."""
        x = x if y is None else x + y
        return self(x), x


def rope_tables(config: LlamaConfig, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin of pos * base^(-2i/E), computed in float64 and rounded once to FP32, laid
    out per element of a head: cos (c0, c0, c1, c1, ...), sin (-s0, s0, -s1, s1, ...). (T, E) each.

    The C library's scalar pow, cos and sin, one element at a time (7 ms for 1024 positions of 64):
    PyTorch's threaded CPU cos made a table of other bits in about one training process of 25 on a
    16-core host (float64 values ~1e-8 off past its first thread's share, its next call in the same
    process exact: MKL's vector math picking its kernel on a function's first call, racing across
    threads, PyTorch issue 188792), and every bit a run trains follows these tables."""
    E = config.head_dim
    inv = [config.rope_base ** (-i / E) for i in range(0, E, 2)]

    def table(f) -> torch.Tensor:                                            # (T, E/2)
        values = array("d", (f(p * w) for p in range(T) for w in inv))
        return torch.frombuffer(values, dtype=torch.float64).float().view(T, E // 2)
    cos, sin = table(math.cos), table(math.sin)
    cos = cos.repeat_interleave(2, dim=-1)                                   # (T, E)
    sin = torch.stack((-sin, sin), dim=-1).flatten(-2)                       # (T, E)
    return cos.to(device), sin.to(device)


def apply_rope(x, cos, sin):
    """Rotate adjacent pairs of the last dimension. x: (B, n, T, E); cos/sin: (T, E) from rope_tables.

    out[2i] = x[2i] c - x[2i+1] s and out[2i+1] = x[2i+1] c + x[2i] s, written as
    x * cos + swap_pairs(x) * sin: the same two products and one sum per element (a + (-b) is
    a - b exactly), so the bits equal the pairwise form, in three elementwise kernels and a flip.
    """
    x = x.float()
    swapped = x.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)                 # (x1, x0, x3, x2, ...)
    return x * cos + swapped * sin


def rope(q, k, v, cos, sin):
    """What attention takes: q and k by apply_rope rounded to v's dtype, v as it is (a fused kernel
    may stand in)."""
    return apply_rope(q, cos, sin).to(v.dtype), apply_rope(k, cos, sin).to(v.dtype), v


def swiglu(gate, up):
    """The feed-forward's gate: silu(gate) * up (a fused kernel may stand in)."""
    return F.silu(gate) * up


def attend(q, k, v):
    """Causal attention, query head h reading key/value head h // (H / K) as llama.cpp does (a
    fused kernel may stand in)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


def shared_input(x, modules):
    """The outputs of projections that read the same x. A module type with `joint(x, modules)`
    (the fused adapters, trained dense weights) takes a group of its own kind together; otherwise
    each module runs on its own."""
    kind = type(modules[0])
    if hasattr(kind, "joint") and all(type(m) is kind for m in modules):
        return kind.joint(x, modules)
    return tuple(m(x) for m in modules)


class Block(nn.Module):
    GROUPS = ("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up")   # projections that read one input

    def __init__(self, config: LlamaConfig, modules: dict[str, nn.Module], rope=rope, swiglu=swiglu, attend=attend):
        super().__init__()
        self.config = config
        self.rope, self.swiglu, self.attend = rope, swiglu, attend
        for name, module in modules.items():  # attn_norm, attn_q ... ffn_down (names.PER_LAYER)
            self.add_module(name, module)

    def attention(self, x, cos, sin):
        c = self.config
        B, T, _ = x.shape
        q, k, v = shared_input(x, self.groups()[0])
        q = q.view(B, T, c.n_head, c.head_dim).transpose(1, 2)       # (B, H, T, E)
        k = k.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)    # (B, K, T, E)
        v = v.view(B, T, c.n_kv_head, c.head_dim).transpose(1, 2)    # (B, K, T, E)
        q, k, v = self.rope(q, k, v, cos, sin)
        y = self.attend(q, k, v).transpose(1, 2).reshape(B, T, c.dim)              # (B, T, D)
        return self.attn_output(y)

    def mlp(self, x):
        """down(swiglu(gate(x), up(x))); one module kind's `gated_mlp(x, gate, up, down)` makes it
        whole where it can (the fused adapters, trained dense weights: the SwiGLU inside the GEMMs)
        when the fused SwiGLU is chosen, the same arithmetic."""
        group = self.groups()[1]
        kind = type(self.ffn_down)
        if self.swiglu is not swiglu and hasattr(kind, "gated_mlp") and all(type(m) is kind for m in group):
            out = kind.gated_mlp(x, *group, self.ffn_down)
            if out is not None:
                return out
        return self.ffn_down(self.swiglu(*shared_input(x, group)))

    def groups(self) -> list[tuple]:
        return [tuple(getattr(self, name) for name in names) for names in self.GROUPS]

    def forward(self, x, y, cos, sin):
        """x: the FP32 residual stream before the previous block's output y (None before the
        first block) is added. Each norm adds the output before it (a FP16/BF16 output is
        promoted exactly inside the add); this block's own output is returned for the next."""
        h, x = self.attn_norm.add(x, y)
        h, x = self.ffn_norm.add(x, self.attention(h, cos, sin))
        return x, self.mlp(h)


class Llama(nn.Module):
    """tokens (B, T) -> logits (B, T, V) in FP32; the residual stream stays FP32."""

    def __init__(self, config: LlamaConfig, tok_embd: nn.Module, layers: list[Block],
                 output_norm: nn.Module, output: nn.Module | None):
        super().__init__()
        self.config = config
        self.tok_embd = tok_embd
        self.layers = nn.ModuleList(layers)
        self.output_norm = output_norm
        self.output = output  # None when the head is tied to tok_embd
        self.rope = {}        # (T, device) -> rope_tables: made once, outside any CUDA graph recording

    def head(self) -> nn.Module:
        return self.tok_embd if self.output is None else self.output

    def hidden(self, tokens, x=None):
        """The final norm's output (B, T, D) for `tokens`; `x`: their embedding rows in FP32, when
        the caller has looked them up itself (to take their gradient instead of the table's)."""
        T = tokens.shape[1]
        if T > self.config.context_length:
            raise ValueError(f"sequence of {T} tokens exceeds the context of {self.config.context_length}")
        if (T, tokens.device) not in self.rope:
            self.rope[T, tokens.device] = rope_tables(self.config, T, tokens.device)
        cos, sin = self.rope[T, tokens.device]
        x, y = (self.tok_embd.lookup(tokens).float() if x is None else x), None   # (B, T, D)
        for layer in self.layers:
            x, y = layer(x, y, cos, sin)
        return self.output_norm.add(x, y)[0]                 # (B, T, D)

    def forward(self, tokens):
        return self.head()(self.hidden(tokens)).float()  # (B, T, V)

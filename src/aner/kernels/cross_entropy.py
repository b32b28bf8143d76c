"""Fused cross-entropy for the training head (Triton): a chunk's summed loss and the gradient of
`scale` x that loss with respect to its logits, in one kernel.

Written with torch ops (`aner.train.loss._cross_entropy` and its autograd backward), a chunk of
(n, V) logits becomes an FP32 copy, a log-softmax buffer and a separate softmax-gradient pass:
three more (n, V) FP32 matrices (8192 x 128,256 positions: 4.2 GB each). Here one program per row
reads the logits in their own dtype (FP32, FP16 or BF16) twice and writes the gradient once:

    pass 1  online over blocks of BLOCK columns, in FP32:  m' = max(m, max z),
            s = s * exp(m - m') + sum exp(z - m');  lse = m + log(s);  loss = lse - z[target]
    pass 2  read each block again: g = scale * (exp(z - lse) - [column == target]), computed in
            FP32 and rounded once to the logits' dtype

`out=logits` writes the gradient over the logits: each block is read before it is written, and
z[target] is taken in pass 1. Rows whose target is `ignore_index` are not read; their loss and
gradient are exactly zero. `scale` is read on the device (it may change between replays of a
recorded CUDA graph); nothing synchronises with the host and no shape depends on the data.

Targets are not range-checked (that would read them back to the host): they come from the
model's own tokenizer. A target outside 0 .. V-1 other than `ignore_index` reads nothing out of
bounds: its row's loss is lse alone and its gradient scale * softmax(z), without the -1.

Determinism: no atomics; each program writes its row's loss to an (n,) FP32 buffer, summed by
one torch `.sum()` over that fixed shape; block sizes depend on V only. Same inputs, same bits.
The reference is `F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")`
and `scale` times its autograd gradient.
"""
import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from . import FLOATS

BLOCK = 4096        # columns per step of a row; smaller when V is


@triton.jit
def _cross_entropy_kernel(logits, targets, scale, loss, dlogits, stride_t, ignore_index,
                          V: tl.constexpr, BLOCK: tl.constexpr):
    """Program r: row r of (n, V) logits -> loss[r] (FP32) and dlogits[r, :] (logits' dtype).
    V is a constant: one compile per vocabulary, and a trip count known to the compiler."""
    row = tl.program_id(0).to(tl.int64)
    src = logits + row * V
    dst = dlogits + row * V
    t = tl.load(targets + row * stride_t)
    scored = t != ignore_index
    cols = tl.arange(0, BLOCK)
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    zt = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        inside = start + cols < V
        # Unscored rows load nothing (masked) and see zeros: finite values, discarded below.
        z = tl.load(src + start + cols, mask=inside & scored, other=0.0).to(tl.float32)
        zt += tl.sum(tl.where(start + cols == t, z, 0.0), 0)       # z[target]; 0 past column V-1
        z = tl.where(inside, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0)
        m = m_new
    lse = m + tl.log(s)
    tl.store(loss + row, tl.where(scored, lse - zt, 0.0))
    w = tl.load(scale)
    for start in range(0, V, BLOCK):
        inside = start + cols < V
        z = tl.load(src + start + cols, mask=inside & scored, other=0.0).to(tl.float32)
        g = tl.exp(z - lse)
        g = tl.where(start + cols == t, g - 1.0, g) * w
        tl.store(dst + start + cols, tl.where(scored, g, 0.0).to(dst.dtype.element_ty), mask=inside)


def _describe(t) -> str:
    if not isinstance(t, torch.Tensor):
        return repr(t)[:80]
    return f"{t.dtype} of shape {tuple(t.shape)} on {t.device}{'' if t.is_contiguous() else ' (strided)'}"


def _check(logits, targets, scale, ignore_index, out) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dtype not in FLOATS:
        raise ConfigError(f"logits must be a float32, float16 or bfloat16 tensor, got {_describe(logits)}")
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ConfigError(f"logits of shape {tuple(logits.shape)} must be (n, V) with V >= 1")
    if not logits.is_contiguous():
        raise ConfigError(f"logits must be contiguous (strides {logits.stride()} for shape {tuple(logits.shape)})")
    n, dev = logits.shape[0], logits.device
    if not isinstance(targets, torch.Tensor) or targets.dtype != torch.int64 or targets.shape != (n,):
        raise ConfigError(f"targets must be an int64 tensor of shape ({n},) for logits of shape "
                          f"{tuple(logits.shape)}, got {_describe(targets)}")
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.dim() != 0:
        raise ConfigError(f"scale must be a 0-dim float32 tensor, got {_describe(scale)}")
    if not isinstance(ignore_index, int):
        raise ConfigError(f"ignore_index must be an int, got {ignore_index!r}")
    for name, t in (("targets", targets), ("scale", scale)):
        if t.device != dev:
            raise ConfigError(f"{name} is on {t.device} but logits are on {dev}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != logits.dtype or out.shape != logits.shape \
                or out.device != dev or not out.is_contiguous():
            raise ConfigError(f"out must be a contiguous {logits.dtype} tensor of shape {tuple(logits.shape)} "
                              f"on {dev}, got {_describe(out)}")
        a, b = logits.data_ptr(), out.data_ptr()
        size = logits.numel() * logits.element_size()
        if a != b and a < b + size and b < a + size:
            raise ConfigError("out overlaps logits without being logits itself: pass out=logits or a separate buffer")


def cross_entropy_grad(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor,
                       ignore_index: int = -100, out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, dlogits): the FP32 sum over scored rows of logsumexp(z) - z[target] (z: logits
    in FP32), and scale * (softmax(z) - onehot(target)) in logits' dtype, zero on rows whose
    target is ignore_index. logits (n, V) contiguous; targets (n,) int64; scale a 0-dim FP32
    tensor, all on one device. out: where dlogits goes (default: a new tensor); may be logits."""
    _check(logits, targets, scale, ignore_index, out)
    n, V = logits.shape
    out = torch.empty_like(logits) if out is None else out
    loss = torch.empty(n, device=logits.device, dtype=torch.float32)      # every row written
    if n:
        block = min(BLOCK, triton.next_power_of_2(V))
        _cross_entropy_kernel[(n,)](logits, targets, scale, loss, out, targets.stride(0), ignore_index,
                                    V=V, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return loss.sum(), out

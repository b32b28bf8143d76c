"""Fused cross-entropy for the training head (Triton): a chunk's summed loss and the gradient of
`scale` x that loss with respect to its logits, in one kernel.

Written with torch ops (`aner.train.loss._cross_entropy` and its autograd backward), a chunk of
(n, V) logits becomes an FP32 copy, a log-softmax buffer and a separate softmax-gradient pass:
three more (n, V) FP32 matrices (8192 x 128,256 positions: 4.2 GB each). Here each row's logits
are read from device memory once, in their own dtype (FP32, FP16 or BF16), and the gradient is
written once:

    pass 1  online over blocks of BLOCK columns, in FP32, each lane (LANE columns of every
            block) on its own, with l = log2(e) (each exponent one multiply-add):
            m' = max(m, max z),  s = s * 2^(m l - m' l) + sum 2^(z l - m' l);
            then the lanes together, M the largest m:  L = M l + log2(sum s * 2^(m l - M l)),
            lse = L ln(2),  loss = lse - z[target]
    pass 2  the blocks again, last to first: g = scale * (2^(z l - L) - [column == target]),
            computed in FP32 and rounded once to the logits' dtype

Pass 2 reads the row from L2: the grid is one program a multiprocessor, each taking its rows one
after another, so the rows in flight (132 x 256 KB at the Llama vocabulary on an H200) fit in the
cache, and walking the blocks last to first reads the latest first. A lane's own maximum and sum
need no exchange between threads inside the loop (one block-wide reduction a row, not two a
block), and each pass keeps the next block's load in flight, the last block's the next row's
first: at 8192 x 128,256 BF16 on the H200, 1.39 ms against the 1.90 of one program a row reading
it twice (`benchmarks/cross_entropy.py`). `out=logits` writes the gradient over the logits: each
block is read before it is written. Rows whose target is `ignore_index` are not read; their loss
and gradient are exactly zero. `scale` is read on the device (it may change between replays of a
recorded CUDA graph); nothing synchronises with the host and no shape depends on the data.

Targets are not range-checked (that would read them back to the host): they come from the
model's own tokenizer. A target outside 0 .. V-1 other than `ignore_index` reads nothing out of
bounds: its row's loss is lse alone and its gradient scale * softmax(z), without the -1.

Determinism: no atomics; each row is one program's, in an order fixed by V alone, whatever the
grid; each program writes its rows' losses to an (n,) FP32 buffer, summed by one torch `.sum()`
over that fixed shape. Same inputs, same bits, on any number of multiprocessors. The reference
is `F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")` and `scale`
times its autograd gradient.
"""
import torch
import triton
import triton.language as tl

from ..errors import ConfigError
from . import FLOATS
from .launch import after_prior, launch_options

BLOCK = 16384       # columns per step of a row; smaller when V is
LANE = 8            # a lane's columns of a block: one 16-byte load of BF16


@triton.jit
def _cross_entropy_kernel(logits, targets, scale, loss, dlogits, n, stride_t, ignore_index,
                          V: tl.constexpr, BLOCK: tl.constexpr, LANE: tl.constexpr, ROWS: tl.constexpr):
    """Program p of P (P <= n): rows p, p + P, p + 2P, .. below n (at most ROWS) of (n, V)
    logits -> loss[row] (FP32) and dlogits[row, :] (logits' dtype). V is a constant: one compile
    per vocabulary, and trip counts known to the compiler; ROWS a power of two. Each row's first
    block is loaded while the row before it finishes."""
    after_prior()
    cols = tl.arange(0, BLOCK // LANE)[:, None] * LANE + tl.arange(0, LANE)[None, :]   # (lanes, LANE)
    w = tl.load(scale)
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(targets + row * stride_t)
    # Unscored rows and columns past V load nothing (masked) and see -inf.
    ahead = tl.load(logits + row * V + cols, mask=(cols < V) & (t != ignore_index), other=float("-inf"))
    for i in range(ROWS):
        if row < n:
            after = row + tl.num_programs(0)
            t_after = tl.load(targets + after * stride_t, mask=after < n, other=ignore_index)
            ahead = _row(logits, dlogits, loss, row, t, ahead, after * V, t_after != ignore_index,
                         ignore_index, w, cols, V, BLOCK)
            row, t = after, t_after


@triton.jit
def _row(logits, dlogits, loss, row, t, ahead, after, after_scored, ignore_index, w, cols,
         V: tl.constexpr, BLOCK: tl.constexpr):
    """One row's two passes, given its first block (ahead): its loss to loss[row], its gradient
    to dlogits[row, :]. Returns the first block of the row at offset `after`. Each lane keeps its
    own running maximum m of z and sum s of 2^((z - m) log2(e)), exchanged only at the row's end;
    a lane that has seen only -inf keeps m = -inf and s = 0."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    src = logits + row * V
    dst = dlogits + row * V
    scored = t != ignore_index
    zt = tl.load(src + t, mask=scored & (t >= 0) & (t < V), other=0.0).to(tl.float32)   # 0 out of range
    m = tl.full((cols.shape[0],), float("-inf"), tl.float32)
    s = tl.zeros((cols.shape[0],), tl.float32)
    for start in range(0, V, BLOCK):
        z = ahead.to(tl.float32)
        ahead = tl.load(src + start + BLOCK + cols, mask=(cols < V - start - BLOCK) & scored, other=float("-inf"))
        m_new = tl.maximum(m, tl.max(z, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new * LOG2E)
        s = s * tl.exp2(m * LOG2E - base) + tl.sum(tl.exp2(z * LOG2E - base[:, None]), 1)
        m = m_new
    top = tl.max(m, 0)
    total = tl.sum(s * tl.exp2(m * LOG2E - tl.where(top == float("-inf"), 0.0, top * LOG2E)), 0)
    lse2 = top * LOG2E + tl.log2(tl.where(scored, total, 1.0))   # L; an unscored row's total is 0
    tl.store(loss + row, tl.where(scored, lse2 * LN2 - zt, 0.0))
    lse2 = tl.where(scored, lse2, float("inf"))                  # unscored: exp2(-inf - inf) = 0
    last = (V - 1) // BLOCK * BLOCK                              # the first column of the last block
    ahead = tl.load(src + last + cols, mask=(cols < V - last) & scored, other=float("-inf"))
    for back in range(0, V, BLOCK):
        start = last - back
        z = ahead.to(tl.float32)
        inner = start >= BLOCK                                   # else the next row's first block
        ahead = tl.load(logits + tl.where(inner, row * V + start - BLOCK, after) + cols,
                        mask=tl.where(inner, scored, after_scored & (cols < V)), other=float("-inf"))
        g = tl.exp2(z * LOG2E - lse2)
        hit = tl.where(scored & (t >= start) & (t < start + BLOCK), t - start, -1).to(tl.int32)
        g = tl.where(cols == hit, g - 1.0, g) * w
        tl.store(dst + start + cols, g.to(dst.dtype.element_ty), mask=cols < V - start)
    return ahead


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
        _launch(logits, targets, scale, loss, out, ignore_index, _programs(logits.device))
    return loss.sum(), out


def _programs(device) -> int:
    """One program a multiprocessor (four under the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _launch(logits, targets, scale, loss, out, ignore_index, programs, block=None, warps=None):
    """The kernel over n >= 1 rows in at most `programs` programs; block and warps: defaults from V."""
    n, V = logits.shape
    block = block or min(BLOCK, max(LANE, triton.next_power_of_2(V)))
    rows = triton.next_power_of_2(triton.cdiv(n, programs))     # a handful of compiles, whatever n
    _cross_entropy_kernel[(min(n, programs),)](
        logits, targets, scale, loss, out, n, targets.stride(0), ignore_index, V=V, BLOCK=block, LANE=LANE, ROWS=rows,
        num_warps=warps or max(4, min(32, block // 512)), **launch_options(logits.device))

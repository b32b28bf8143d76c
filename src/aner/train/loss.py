"""Cross-entropy over the vocabulary, a chunk of positions at a time.

Logits for a whole micro-batch cost positions x V x 4 bytes in FP32, and backward keeps several
such copies (8 x 1024 positions of a 128,256-token vocabulary: 4.2 GB each). Here at most one
chunk of logits is alive. Training computes, in its forward, each chunk's logits, its summed
cross-entropy and the gradient of `scale` x that sum with respect to the chunk's hidden
states and the head's trainable weight, and keeps only those gradients; backward hands them on
times the incoming gradient (exactly 1.0 in `gradients`, so they pass unchanged).

`scale` (a 0-dim FP32 tensor on the device) is what the loop backpropagates from: 1 / (the
window's scored tokens), or the FP16 loss scale, which therefore reaches the head's
low-precision backward as before. As a tensor it can change between replays of a recorded CUDA
graph (`graphs.py`).

The head reads only the positions that are scored: the host knows them (it makes the targets),
so `batch` hands over their rows of the flattened hidden states, with no synchronisation; a
question/answer example scores its answer alone, and its prompt's logits are never made. On a
GPU the rows are padded with unscored positions (their terms and gradients exactly zero) to a
multiple of CHUNK_ROWS, so that a recorded graph serves every batch of its shape and padded
count; where that is every position, the hidden states are read in place. Chunk boundaries
depend only on the model's shape, whether its head is trained and the profile, so results are a
pure function of the inputs.

With layer_kernel="fused" one kernel makes a chunk's loss and its logits' gradient, which
overwrites the logits in their own dtype: no FP32 copy exists, and a chunk holds twice the
positions under FP16/BF16 (and a trained head's chunk as many bytes as each later chunk's
product reads and writes of its FP32 weight gradient).
"""
from array import array

import torch
import torch.nn.functional as F

from ..model.llama import Dense
from ..quant.module import NF4Module

IGNORE = -100                  # target index of unscored positions
CHUNK_BYTES = 256 << 20        # logits of one chunk: at most 256 MiB (at least one position)
CHUNK_ROWS = 128               # positions a chunk holds a multiple of, from this many on


def chunk_positions(vocab: int, itemsize: int = 4, trained_dim: int = 0) -> int:
    """Positions per chunk: FP32 logits (itemsize 4), or with the fused cross-entropy the
    logits in the operand dtype, which its gradient then overwrites. There a trained head's
    FP32 weight gradient (vocab x `trained_dim`) is read and written by every chunk's product but
    the first, so a chunk may hold as many bytes of logits as that read and write move: the
    accumulation then moves no more bytes than the logits it sums. Rounded down to a multiple of
    CHUNK_ROWS, which the GEMMs' tiles of rows divide: at a 128,256-token vocabulary in BF16, 1024
    positions rather than 1046, whose head products ran 4%-7% slower on an H100
    (`benchmarks/head_chunks.py`)."""
    fit = max(1, CHUNK_BYTES // (itemsize * vocab), 8 * trained_dim // itemsize)
    return fit - fit % CHUNK_ROWS if fit >= CHUNK_ROWS else fit


def _chunk_head(head, profile):
    """The head as every chunk calls it. A dense head is cast to the operand dtype here, once (a
    trained head's kept cast is taken as it is), where no chunk differentiates through it:
    frozen, or trained with the fused cross-entropy, which makes the weight's gradient itself
    (`_fused_chunk`) and asks autograd for the hidden states' only. A packed head of the decoded
    NF4 kernels is decoded here, once, likewise: the bits each chunk's product would decode."""
    if isinstance(head, NF4Module) and head.decoded:
        return Dense(head.operand(profile.compute_dtype))
    w = getattr(head, "weight", None)
    fused = profile.layer_kernel == "fused"
    if type(head) is Dense and profile.precision != "float32" and (fused or not w.requires_grad):
        return Dense(head.cast_to(profile.compute_dtype))
    return head


def batch(examples, device):
    """Right-padded tokens and next-token targets (unscored: IGNORE), each (B, T-1), and the rows
    of their flattened positions that the head reads (`scored_rows`), or None for all of them."""
    T = max(len(e.tokens) for e in examples)
    tokens = torch.zeros(len(examples), T, dtype=torch.long)
    targets = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        tokens[i, :len(e.tokens)] = torch.frombuffer(array("q", e.tokens), dtype=torch.long)  # 4x torch.tensor's speed
        targets[i, e.prompt_len:len(e.tokens)] = tokens[i, e.prompt_len:len(e.tokens)]
    # position t predicts token t+1; causal attention keeps padding (at the end) out of real positions
    targets = targets[:, 1:]
    rows = scored_rows(targets.flatten(), CHUNK_ROWS if torch.device(device).type == "cuda" else 1)
    return _to(tokens[:, :-1], device), _to(targets, device), None if rows is None else _to(rows, device)


def scored_rows(targets: torch.Tensor, multiple: int) -> torch.Tensor | None:
    """The positions of `targets` (flat, on the host) that are scored and, to make their count a
    multiple of `multiple`, the first unscored ones, in ascending order; None where that is every
    position."""
    scored = targets != IGNORE
    n = int(scored.sum())
    keep = -(-n // multiple) * multiple
    if keep >= targets.numel():
        return None
    scored[(~scored).nonzero()[:keep - n, 0]] = True
    return scored.nonzero()[:, 0]


def _to(t, device):
    """t on `device`; to a GPU from pinned memory, so the host does not wait for the work already
    queued there (the copy takes its place in the stream behind it)."""
    if torch.device(device).type == "cuda":
        return t.contiguous().pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _cross_entropy(head, h, targets) -> torch.Tensor:
    """Summed FP32 cross-entropy of one chunk: h (chunk, D) -> logits (chunk, V) -> a scalar."""
    return F.cross_entropy(head(h).float(), targets, ignore_index=IGNORE, reduction="sum")


def _trainable(head) -> list[torch.Tensor]:
    """The head's weight when it is being trained (full fine-tuning), else nothing."""
    w = getattr(head, "weight", None)
    return [w] if isinstance(w, torch.Tensor) and w.requires_grad else []


@torch.no_grad()
def summed_loss(model, examples, device, profile) -> torch.Tensor:
    """Sum of FP32 cross-entropy over the scored tokens of `examples` (no gradients)."""
    inputs, targets, rows = batch(examples, device)
    with profile.autocast(device):
        h, targets = _scored(model.hidden(inputs).flatten(0, 1), targets.flatten(), rows)   # FP32 rows
        head = _chunk_head(model.head(), profile)
        step = chunk_positions(model.config.vocab_size)
        total = torch.zeros((), device=h.device)
        for s in range(0, h.shape[0], step):
            total += _cross_entropy(head, h[s:s + step], targets[s:s + step])
    return total


def _scored(h, targets, rows):
    """The hidden states and targets of the positions the head reads: `rows` of them (a gather,
    whose gradient scatters back by `index_put_`, as a tied head's rows do, the other positions'
    exactly zero), or all."""
    return (h, targets) if rows is None else (h[rows], targets[rows])


def gradients(model, leaves: list, profile, inputs, targets, rows, scale: torch.Tensor):
    """One micro-batch (inputs, targets, rows) from `batch`: (loss, grads), the FP32 summed
    cross-entropy (detached) and the gradients of scale x loss with respect to `leaves`, in their
    order."""
    head, fused = model.head(), profile.layer_kernel == "fused"
    weights = _trainable(head)
    # A trained head tied to the embedding: the rows looked up are a leaf of their own, and their
    # gradient is added into the head's below, row by row, instead of a dense (V, D) gradient of
    # the table that is then added to the head's whole.
    tied = bool(weights) and head is model.tok_embd
    looked_up = model.tok_embd.lookup(inputs).float().detach().requires_grad_(True) if tied else None
    with profile.autocast(inputs.device.type):
        h = model.hidden(inputs, looked_up).flatten(0, 1)     # (N, D), FP32 (the operand dtype: fused norm)
        h, targets = _scored(h, targets.flatten(), rows)
        itemsize = profile.compute_dtype.itemsize if fused else 4
        step = chunk_positions(model.config.vocab_size, itemsize, model.config.dim if fused and weights else 0)
        objective, loss, *head_grads = _HeadLoss.apply(h, targets, _chunk_head(head, profile), step, scale, fused,
                                                       weights)
    # The head's gradients join their leaves here: unused elsewhere, or a tied embedding's.
    grads = list(torch.autograd.grad(objective, leaves + ([looked_up] if tied else []),
                                     allow_unused=bool(weights)))
    if tied:
        head_grads[0].index_put_((inputs.flatten(),), grads.pop().flatten(0, 1), accumulate=True)
    for w, gw in zip(weights, head_grads):
        i = next(i for i, leaf in enumerate(leaves) if leaf is w)
        grads[i] = gw if grads[i] is None else grads[i].add_(gw)
    return loss, grads


def _fused_chunk(head, hc, targets, scale, grad_w, first):
    """The chunk's summed loss and the gradient of scale x it with respect to hc; the logits'
    gradient is made by one kernel (`kernels/cross_entropy.py`) in the logits' dtype, as the
    cast's backward gave it, and overwrites the logits: no head's backward reads its own output.
    A trained head's weight gradient, dlogits^T hc, is written by the first chunk's GEMM (FP32
    output) and accumulates into that FP32 sum in `grad_w` inside each later one's (beta 1): no
    per-chunk low-precision copy, cast or add, and no zeros read."""
    from ..kernels.cross_entropy import cross_entropy_grad
    logits = head(hc)                                         # (chunk, V), the operand dtype
    loss, dlogits = cross_entropy_grad(logits.detach(), targets, scale, IGNORE, out=logits.detach())
    (grad_h,) = torch.autograd.grad(logits, [hc], dlogits)
    for acc in grad_w:
        x = hc.detach().to(dlogits.dtype)
        if first:
            torch.mm(dlogits.T, x, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, dlogits.T, x, out_dtype=torch.float32, out=acc)
    return loss, grad_h


class _HeadLoss(torch.autograd.Function):
    """(scale x the summed loss, the summed loss, the trained head weights' gradients of the
    former): a chunk at a time, each chunk's gradients made in the forward. The head's weight
    gradients leave as outputs, not through autograd, which would multiply all V x D of them by
    the incoming gradient; `gradients` backpropagates exactly 1 and adds them itself."""

    @staticmethod
    def forward(ctx, h, targets, head, step, scale, fused, weights):
        grad_h = torch.empty_like(h)
        grad_w = [(torch.empty_like if fused else torch.zeros_like)(w) for w in weights]
        total = torch.zeros((), device=h.device)
        for s in range(0, h.shape[0], step):
            with torch.enable_grad():
                hc = h[s:s + step].detach().requires_grad_(True)
                if fused:
                    loss, g = _fused_chunk(head, hc, targets[s:s + step], scale, grad_w, s == 0)
                    grad_h[s:s + step] = g
                else:
                    loss = _cross_entropy(head, hc, targets[s:s + step])
                    grads = torch.autograd.grad(loss * scale, [hc, *weights])
                    grad_h[s:s + step] = grads[0]
                    for acc, g in zip(grad_w, grads[1:]):
                        acc += g                              # FP32, chunk order
            total += loss.detach()
        ctx.save_for_backward(grad_h)
        ctx.mark_non_differentiable(total, *grad_w)
        return total * scale, total, *grad_w

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, *_):
        (grad_h,) = ctx.saved_tensors
        return grad_h * g, None, None, None, None, None, None

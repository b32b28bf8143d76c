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
graph (`graphs.py`). Unscored positions carry the ignore index: their terms and gradients are
exactly zero, with no host synchronisation and no gather. Chunk boundaries depend only on the
vocabulary size, so results are a pure function of the inputs.
"""
import torch
import torch.nn.functional as F

IGNORE = -100                  # target index of unscored positions
CHUNK_BYTES = 256 << 20        # FP32 logits of one chunk: at most 256 MiB (at least one position)


def chunk_positions(vocab: int) -> int:
    return max(1, CHUNK_BYTES // (4 * vocab))


def batch(examples, device):
    """Right-padded tokens and next-token targets (unscored: IGNORE). Each (B, T-1)."""
    T = max(len(e.tokens) for e in examples)
    tokens = torch.zeros(len(examples), T, dtype=torch.long)
    targets = torch.full((len(examples), T), IGNORE, dtype=torch.long)
    for i, e in enumerate(examples):
        tokens[i, :len(e.tokens)] = torch.tensor(e.tokens)
        targets[i, e.prompt_len:len(e.tokens)] = tokens[i, e.prompt_len:len(e.tokens)]
    # position t predicts token t+1; causal attention keeps padding (at the end) out of real positions
    return tokens[:, :-1].to(device), targets[:, 1:].to(device)


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
    inputs, targets = batch(examples, device)
    with profile.autocast(device):
        h = model.hidden(inputs).flatten(0, 1)                # (N, D), FP32
        targets, head = targets.flatten(), model.head()
        step = chunk_positions(model.config.vocab_size)
        total = torch.zeros((), device=h.device)
        for s in range(0, h.shape[0], step):
            total += _cross_entropy(head, h[s:s + step], targets[s:s + step])
    return total


def gradients(model, leaves: list, profile, inputs, targets, scale: torch.Tensor):
    """One micro-batch (inputs, targets) from `batch`: (loss, grads), the FP32 summed cross-entropy
    (detached) and the gradients of scale x loss with respect to `leaves`, in their order."""
    with profile.autocast(inputs.device.type):
        h = model.hidden(inputs).flatten(0, 1)                # (N, D), FP32
        head, step = model.head(), chunk_positions(model.config.vocab_size)
        objective, loss = _HeadLoss.apply(h, targets.flatten(), head, step, scale, *_trainable(head))
    return loss, torch.autograd.grad(objective, leaves)


class _HeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, targets, head, step, scale, *weights):
        grad_h = torch.empty_like(h)
        grad_w = [torch.zeros_like(w) for w in weights]
        total = torch.zeros((), device=h.device)
        for s in range(0, h.shape[0], step):
            with torch.enable_grad():
                hc = h[s:s + step].detach().requires_grad_(True)
                loss = _cross_entropy(head, hc, targets[s:s + step])
                grads = torch.autograd.grad(loss * scale, [hc, *weights])
            grad_h[s:s + step] = grads[0]
            for acc, g in zip(grad_w, grads[1:]):
                acc += g                                      # FP32, chunk order
            total += loss.detach()
        ctx.save_for_backward(grad_h, *grad_w)
        ctx.mark_non_differentiable(total)
        return total * scale, total

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g, _):
        grad_h, *grad_w = ctx.saved_tensors
        return (grad_h * g, None, None, None, None, *(w * g for w in grad_w))

"""The update loop: seeded sample order, token-weighted loss over an accumulation window, AdamW.

One step is one optimizer update. A window is `micro_batch * accumulation` examples taken in a
seeded per-epoch permutation; a window never crosses an epoch boundary, so the last window of an
epoch may be short (kept, never padded with repeated rows). The loss of a window is the sum of
token cross-entropies over its scored tokens divided by the number of scored tokens in the whole
window, so every scored token weighs the same whatever micro-batch it fell in.

Everything a resumed run needs to replay an uninterrupted one bitwise is in `TrainState`: the
moments, the counters and the cursor into the sample order (the order itself is a pure function of
the seed and the epoch).
"""
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache, partial

import torch

from ..adapters.base import seeded
from ..errors import ConfigError, DataError
from ..kernels import joined_columns, joined_rows
from ..model.llama import Dense
from .loss import batch, gradients, summed_loss
from .optim import AdamW, all_finite, clip_divisor
from .profile import Profile
from .scaler import LossScale

MAX_STEPS = 1_000_000
MAX_MICRO_BATCH = 4096
MAX_ACCUMULATION = 4096
EVAL_TOKENS = 2048      # padded positions per evaluation batch


@dataclass(frozen=True)
class RunConfig:
    micro_batch: int = 1
    accumulation: int = 1
    rate: float = 2e-4
    seed: int = 0
    clip_norm: float = 1.0

    def __post_init__(self):
        for name, hi in (("micro_batch", MAX_MICRO_BATCH), ("accumulation", MAX_ACCUMULATION)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
                raise ConfigError(f"{name}={v!r} is outside the accepted range 1..{hi}")
        if isinstance(self.rate, bool) or not isinstance(self.rate, (int, float)) \
                or not (math.isfinite(self.rate) and 0 < self.rate <= 1):
            raise ConfigError(f"rate={self.rate!r} is outside the accepted range (0, 1]")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ConfigError(f"seed={self.seed!r} is outside the accepted range 0..2^63-1")
        if isinstance(self.clip_norm, bool) or not isinstance(self.clip_norm, (int, float)) \
                or not (math.isfinite(self.clip_norm) and self.clip_norm >= 0):
            raise ConfigError(f"clip_norm={self.clip_norm!r}; accepted: a finite number >= 0 (0 disables)")

    def as_dict(self):
        return {"micro_batch": self.micro_batch, "accumulation": self.accumulation,
                "rate": self.rate, "seed": self.seed, "clip_norm": self.clip_norm}


def check_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= MAX_STEPS:
        raise ConfigError(f"steps={steps!r} is outside the accepted range 1..{MAX_STEPS}")
    return steps


@dataclass(frozen=True)
class TrainState:
    run: RunConfig
    training_sha256: str
    validation_sha256: str
    updates: int = 0
    scored_tokens: int = 0
    cursor: int = 0                     # examples consumed since the run started
    moments: dict = field(default_factory=dict)   # name -> (exp_avg, exp_avg_sq), FP32
    validation_loss: float | None = None
    losses: tuple[float, ...] = ()      # training loss of each committed update
    loss_scale: LossScale = LossScale() # FP16 only; kept (and checkpointed) for every profile


@lru_cache(maxsize=2)
def order(seed: int, epoch: int, n: int) -> tuple[int, ...]:
    """The epoch's sample order, made once per epoch (a permutation of 100k examples costs ~20 ms
    of host time, which every update would otherwise pay)."""
    return tuple(torch.randperm(n, generator=seeded(seed, 0x5A4D, epoch)).tolist())


def window(state: TrainState, n: int) -> tuple[int, ...]:
    """Indices of the examples of the next update's window."""
    epoch, pos = divmod(state.cursor, n)
    size = min(state.run.micro_batch * state.run.accumulation, n - pos)
    return order(state.run.seed, epoch, n)[pos:pos + size]


def eval_batches(items, tokens: int = EVAL_TOKENS):
    """Consecutive runs of examples padded to at most `tokens` positions each (at least one
    example): a pure function of the data, so a validation loss never depends on the run."""
    out, longest = [], 0
    for e in items:
        longest = max(longest, len(e.tokens))
        if out and (len(out[-1]) + 1) * longest <= tokens:
            out[-1].append(e)
        else:
            out.append([e])
            longest = len(e.tokens)
    return out


@torch.no_grad()
def evaluate(model, data, device, profile=Profile()) -> float:
    """Token-weighted loss: total cross-entropy over all scored tokens / their count (float64 sum)."""
    total = 0.0
    for examples in eval_batches(data.items):
        total += float(summed_loss(model, examples, device, profile))
    return total / data.scored_tokens()


def make_optimizer(profile: Profile, rate: float, device: str):
    if profile.optimizer == "paged_adamw":
        from .paged import PagedAdamW
        return PagedAdamW(AdamW(rate), profile.page_bytes, device)
    return AdamW(rate)


def run(model, params: dict, trainable: dict, method, training, validation, state: TrainState,
        steps: int, device, progress: bool | None = None, on_update=None, profile=Profile()) -> TrainState:
    """Apply `steps` updates to `trainable` (leaf tensors inside `model`) in place; return the new state.

    `params` is every tensor the method's preconditioner may read (adapter tensors).
    `on_update(state)` is called after every committed update (jobs use it to stop and checkpoint);
    returning False stops the run at that boundary.
    """
    with kept_casts(model, trainable, profile) as casts:
        return _run(model, params, trainable, method, training, validation, state, steps, device, progress,
                    on_update, profile, casts)


@contextmanager
def kept_casts(model, trainable: dict, profile: Profile):
    """Under a FP16/BF16 policy, each dense matrix's cast to the operand dtype, made once for the
    run (`Dense.cast`), so a forward reads it instead of reading the weight to cast it: a trained
    matrix's the optimizer rewrites as it writes the weight (the same rounding of the same FP32
    value; yielded, name -> tensor); a frozen one's (an adapter's base, a frozen head) stays valid
    for the run. A layer's group of projections that read one input (`Block.GROUPS`; for adapted
    ones, their frozen bases) has its casts laid one under another in one buffer, so that their
    products can be one GEMM. A fused LoRA adapter's base whose products its joins take (`room`)
    has columns beside its cast and rows under it to spare, as a decode has. The admission already
    counts these casts: backward keeps them all at its start. They are dropped when the run ends,
    however it ends."""
    table = None if model.head() is model.tok_embd else model.tok_embd    # looked up in FP32, never cast
    cast = [m for m in model.modules() if type(m) is Dense and m is not table and m.weight.dim() == 2] \
        if profile.precision != "float32" else []
    groups = [[getattr(m, "base", m) for m in group] for layer in model.layers for group in layer.groups()]
    groups = [g for g in groups if all(m in cast for m in g) and len({m.weight.shape[1] for m in g}) == 1]
    grouped = {id(m) for group in groups for m in group}
    spare = room(model, profile.compute_dtype) if cast else {}
    trained = {id(w): n for n, w in trainable.items()}
    try:
        for block in groups + [[m] for m in cast if id(m) not in grouped]:
            lay_out(block, spare, profile.compute_dtype)
        yield {trained[id(m.weight)]: m.cast for m in cast if id(m.weight) in trained}
    finally:
        for m in cast:
            m.cast = m.room = None


def lay_out(block, spare: dict, dtype) -> None:
    """Casts of `block`'s Dense modules (one input width) to `dtype`, one under another in one new
    buffer (`Dense.cast`), with the room that `spare` asks (id -> (left, right, below);
    `Dense.room`): the block's largest left and right columns beside every cast, zeros until a
    join writes them, and its largest below rows under the last."""
    left, right, below = (max(spare.get(id(m), (0, 0, 0))[i] for m in block) for i in range(3))
    rows, K = [m.weight.shape[0] for m in block], block[0].weight.shape[1]
    buffer = (torch.zeros if left or right else torch.empty)(sum(rows) + below, left + K + right, dtype=dtype,
                                                            device=block[0].weight.device)
    for m, part in zip(block, buffer.split(rows[:-1] + [rows[-1] + below])):
        m.cast = part[:m.weight.shape[0], left:left + K].copy_(m.weight.detach())
        m.room = (part, left) if left or right or below else None


def room(model, dtype) -> dict:
    """id(base) -> (left, right, below): the columns beside and rows under a frozen base's cast
    that its fused LoRA adapter's joins write (`kernels.joined_columns`, `kernels.joined_rows`),
    for the bases whose products take them; a layer's group of projections that read one input
    goes through the kernels together when all are such adapters, else each on its own."""
    from ..adapters.lora import LoRALinear
    out = {}
    for layer in model.layers:
        for group in (*layer.groups(), (layer.attn_output,), (layer.ffn_down,)):
            adapted = [m for m in group if type(m) is LoRALinear and m.fused and type(m.base) is Dense]
            for together in [adapted] if len(adapted) == len(group) else [[m] for m in adapted]:
                widths, ranks = [m.base.weight.shape[0] for m in together], [m.lora_a.shape[0] for m in together]
                K = together[0].base.weight.shape[1]
                columns = joined_columns(widths, K, dtype, ranks) or [(0, 0)] * len(together)
                below = joined_rows(widths, K, dtype, ranks)
                out.update({id(m.base): (*c, below) for m, c in zip(together, columns) if c != (0, 0) or below})
    return out


def _run(model, params, trainable, method, training, validation, state, steps, device, progress, on_update,
         profile, casts) -> TrainState:
    optimizer = make_optimizer(profile, state.run.rate, device)
    moments = state.moments or optimizer.init_moments(trainable)
    fp16 = profile.precision == "float16"
    scale = state.loss_scale
    n = training.examples()
    bar = _Progress(steps) if (progress if progress is not None else sys.stderr.isatty()) else None
    losses = list(state.losses)
    step = partial(gradients, model, list(trainable.values()), profile)
    if profile.cuda_graphs:
        from .graphs import Graphed
        step = Graphed(step)

    def prepare(cursor: int):
        """The window at `cursor`: its examples, their scored tokens and its micro-batches on the device."""
        examples = [training.items[i] for i in window(replace(state, cursor=cursor), n)]
        size = state.run.micro_batch
        return examples, sum(e.scored for e in examples), [batch(examples[s:s + size], device)
                                                           for s in range(0, len(examples), size)]

    upcoming = prepare(state.cursor)
    for k in range(steps):
        examples, window_tokens, micro_batches = upcoming
        while True:  # one pass, or FP16 replays of the same window after an overflow
            # FP16: the gradient of the loss-scaled sum; otherwise of the sum / the window's tokens.
            grad_scale = torch.full((), scale.scale if fp16 else 1.0 / window_tokens, device=device)  # no host copy
            # The window's loss sums in float64 on the device; the host reads it once the update
            # is queued (FP16 checks each micro-batch before its overflow test reads the gradients).
            window_loss, total = torch.zeros((), dtype=torch.float64, device=device), None
            for inputs, targets, rows in micro_batches:
                loss, grads = step(inputs, targets, rows, grad_scale)
                window_loss += loss
                if fp16:
                    _check_finite(float(window_loss), state.updates + 1)
                # The first micro-batch's gradients are used as they are when it is the only one
                # (a recorded graph's outputs are consumed before its next replay); later ones add.
                if total is None:
                    total = list(grads) if len(micro_batches) == 1 else [g.clone() for g in grads]
                else:
                    torch._foreach_add_(total, grads)
            grads = dict(zip(trainable, total))
            if not fp16:
                break
            if all_finite(grads):
                # unscale: one division by scale x tokens (a power of two times an integer: exact)
                torch._foreach_div_(list(grads.values()), scale.scale * window_tokens)
                break
            scale = scale.overflowed(state.updates + 1)
        if method is not None:
            method.precondition(grads, params)
        read_loss = _read_later(window_loss)       # copied before the update, read while it runs
        optimizer.step(trainable, grads, moments, state.updates + 1, clip_divisor(grads, state.run.clip_norm),
                       casts)
        if k + 1 < steps:
            # The next window's batches are made (and their copies queued) while this update runs on a
            # GPU, not after its loss is read: otherwise the GPU waits for them once the optimizer is done.
            upcoming = prepare(state.cursor + len(examples))
        window_loss = read_loss()
        _check_finite(window_loss, state.updates + 1)
        if fp16:
            scale = scale.succeeded()
        losses.append(window_loss / window_tokens)
        state = replace(state, updates=state.updates + 1, scored_tokens=state.scored_tokens + window_tokens,
                        cursor=state.cursor + len(examples), moments=moments, losses=tuple(losses),
                        loss_scale=scale)
        if bar:
            bar.update(losses[-1], window_tokens)
        if on_update is not None and on_update(state) is False:
            break
    if bar:
        bar.close()
    return replace(state, validation_loss=evaluate(model, validation, device, profile))


def _read_later(t: torch.Tensor):
    """Start copying a 0-dim tensor to the host; return what waits for that copy alone and gives
    it as a float (on a GPU: into pinned memory, so work queued after it runs on meanwhile)."""
    if t.device.type != "cuda":
        return lambda: float(t)
    host = torch.empty((), dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def read() -> float:
        copied.synchronize()
        return float(host)
    return read


def _check_finite(loss: float, update: int) -> None:
    if not math.isfinite(loss):
        raise DataError(f"the training loss became non-finite ({loss}) at update {update}; lower the rate")


class _Progress:
    """A one-line progress bar with loss and tokens/s, only when attached to a terminal."""

    def __init__(self, total):
        from tqdm import tqdm
        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, leave=True)
        self.tokens, self.start = 0, time.perf_counter()

    def update(self, loss, tokens):
        self.tokens += tokens
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{rate:.0f}")
        self.bar.update(1)

    def close(self):
        self.bar.close()

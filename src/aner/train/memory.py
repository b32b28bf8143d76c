"""Memory accounting and admission: what a handle owns, and whether a piece of work fits a budget.

The numbers count owned tensor buffers and a conservative estimate of workspaces and activations.
They exclude allocator caches, BLAS scratch, other live handles and the Python process itself:
this is admission guidance, not process RSS, and it cannot prevent an allocation failure under
outside memory pressure.
"""
from dataclasses import asdict, dataclass

from ..errors import ConfigError, ResourceError

MIN_BUDGET = 1 << 20        # 1 MiB
MAX_BUDGET = 64 << 30       # 64 GiB
DEFAULT_BUDGET = 4 << 30    # 4 GiB

SCOPE = ("owned tensor buffers and conservative workspace admission; excludes allocator/BLAS and "
         "other retained handles; not process RSS; import/export/SVD use one matrix workspace")


def check_budget(max_memory_bytes) -> int:
    if isinstance(max_memory_bytes, bool) or not isinstance(max_memory_bytes, int) \
            or not MIN_BUDGET <= max_memory_bytes <= MAX_BUDGET:
        raise ConfigError(f"max_memory_bytes={max_memory_bytes!r} is outside the accepted range "
                          f"{MIN_BUDGET} (1 MiB) .. {MAX_BUDGET} (64 GiB)")
    return max_memory_bytes


def admit(what: str, needed: int, budget: int) -> None:
    if needed > budget:
        raise ResourceError(f"{what} needs an estimated {needed} bytes ({needed / 2**20:.1f} MiB), over "
                            f"max_memory_bytes={budget} ({budget / 2**20:.1f} MiB); raise the budget "
                            f"(at most {MAX_BUDGET}) or reduce the work")


@dataclass(frozen=True)
class MemorySummary:
    weight_bytes: int
    floating_base_bytes: int
    packed_base_bytes: int
    adapter_bytes: int
    frozen_adapter_bytes: int
    trainable_bytes: int
    optimizer_bytes: int
    dequant_tile_bytes: int
    estimated_budget_bytes: int
    compute_dtype: str
    storage: str
    paged_optimizer: bool = False
    paged_optimizer_bytes: int = 0     # moments held in pinned host memory (part of optimizer_bytes)
    optimizer_window_bytes: int = 0    # GPU buffers the paged optimizer streams them through
    gpu_packed_base_bytes: int = 0     # the fused kernels' device copy of the packed base
    scope: str = SCOPE

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self):
        mib = lambda n: f"{n:,} B ({n / 2**20:.2f} MiB)"  # noqa: E731
        rows = [(k, mib(v) if isinstance(v, int) and not isinstance(v, bool) else v)
                for k, v in asdict(self).items() if k != "scope"]
        width = max(len(k) for k, _ in rows)
        return "\n".join([f"{k:<{width}}  {v}" for k, v in rows] + [f"scope: {self.scope}"])


def activation_bytes(config, micro_batch: int, tokens: int, device: str = "cpu", itemsize: int = 4,
                     fused_layers: bool = False, trained_head: bool = False, fused_attention: bool = False) -> int:
    """Conservative activations kept for backward over one micro-batch of `tokens` positions, for
    products in a dtype of `itemsize` bytes (4 under the FP32 policy, 2 under FP16/BF16), and the
    loss's transient chunk (`loss_chunk_bytes`); the adapters' own are `adapter_activation_bytes`.

    Per layer, in FP32: the two residual streams the norms read, and two more width-sized tensors
    that the torch norms keep (none with the fused norms, `fused_layers`); each row's log-sum-exp
    per head, or on the CPU the attention probabilities (H x T x T). In the operand dtype: the
    normed inputs (one per group of projections from the fused norms; from the torch norms up to
    one cast per product: 5), q and the attention output (the attention kernels of
    `fused_attention` write it where the output projection reads it; torch's is transposed into a
    copy), k and v at the key/value width (torch's attention may expand them to every query head:
    counted at both), and the feed-forward's gate and up and their product (the torch ops keep
    silu(gate) too). Plus the final norm's FP32 residual stream, its output (FP32 from the torch
    norm) and the hidden states' FP32 gradient that the chunked loss keeps.
    """
    c = config
    kv = c.n_kv_head * c.head_dim
    fp32 = 4 * (2 if fused_layers else 4) * c.dim + 4 * c.n_head * (tokens if device == "cpu" else 1)
    width = (2 if fused_layers else 5) * c.dim + 2 * c.dim + 2 * kv + (0 if fused_attention else 3 * c.dim)
    ffn = (3 if fused_layers else 4) * c.ffn_dim
    per_layer = tokens * (fp32 + itemsize * (width + ffn))
    positions = micro_batch * tokens
    final = tokens * c.dim * (4 + (itemsize if fused_layers else 4) + 4)
    return micro_batch * (c.n_layer * per_layer + final) + \
        loss_chunk_bytes(c, positions, itemsize, fused_layers, trained_head)


def adapter_activation_bytes(method: str, shapes: list, positions: int, itemsize: int, fused: bool) -> int:
    """What the adapters' products keep for backward over `positions` tokens, for targets of
    `shapes` [(out, in, rank)]: each x A^T (FP32, or the fused kernels' three BF16 parts) and each
    scaled B (out x rank, FP32); on the torch path under FP16/BF16, an FP32 copy of the input
    where A is trained (lora, rslora)."""
    total = 0
    for out, inp, r in shapes:
        total += 4 * out * r + positions * (6 * r if fused else 4 * r)
        if not fused and itemsize < 4 and method in ("lora", "rslora"):
            total += 4 * positions * inp
    return total


def loss_chunk_bytes(config, positions: int, itemsize: int = 4, fused_layers: bool = False,
                     trained_head: bool = False) -> int:
    """The loss's transient logits (train/loss.py): one chunk of FP32 logits over the vocabulary
    with its softmax and gradient, or the fused loss's larger chunk for a trained head in the
    operand dtype where that is more; as though every one of `positions` were scored (the head
    reads the scored ones alone: at most as many)."""
    from .loss import chunk_positions
    c = config
    logits = 4 * 3 * min(positions, chunk_positions(c.vocab_size)) * c.vocab_size
    if fused_layers and trained_head:
        logits = max(logits, itemsize * c.vocab_size * min(positions, chunk_positions(c.vocab_size, itemsize, c.dim)))
    return logits

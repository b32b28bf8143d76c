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


def activation_bytes(config, micro_batch: int, tokens: int, device: str = "cpu") -> int:
    """Conservative FP32 activations kept for backward over one micro-batch of `tokens` positions.

    Per layer: ~10 width-sized tensors (norms, q/k/v, attention output, residuals), 4 feed-forward
    sized (gate, up, activation, product) and, on the CPU, the attention probabilities (H x T x T);
    CUDA's fused attention kernels keep one log-sum-exp per row and head instead. Plus one chunk
    of logits over the vocabulary with its softmax and gradient (train/loss.py), and the hidden
    states' gradient the chunked loss keeps.
    """
    from .loss import chunk_positions
    c = config
    attention = c.n_head * tokens if device == "cpu" else c.n_head
    per_layer = tokens * (10 * c.dim + 4 * c.ffn_dim + attention)
    logits = 3 * min(micro_batch * tokens, chunk_positions(c.vocab_size)) * c.vocab_size
    return 4 * (micro_batch * (c.n_layer * per_layer + tokens * c.dim) + logits)

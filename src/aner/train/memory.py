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
                     fused_layers: bool = False, trained_head: bool = False) -> int:
    """Conservative activations kept for backward over one micro-batch of `tokens` positions, for
    products in a dtype of `itemsize` bytes (4 under the FP32 policy, 2 under FP16/BF16).

    Per layer: the two FP32 residual streams the norms read, and two more FP32 width-sized
    tensors that the torch norms keep (none with the fused norms, `fused_layers`); 6 width-sized
    tensors in the operand dtype (the two normed inputs, q, k, v after RoPE, the attention output
    and its copy) and 4 feed-forward sized (gate, up, activation, product); on the CPU, the
    attention probabilities (H x T x T) in FP32, where CUDA's fused attention kernels keep one
    log-sum-exp per row and head instead. Plus one chunk of FP32 logits over the vocabulary with
    its softmax and gradient (train/loss.py), or the fused loss's larger chunk for a trained head
    in the operand dtype where that is more, and the hidden states' gradient the chunked loss
    keeps. With the torch norms under the FP32 policy: 10 width-sized and 4 feed-forward sized FP32
    tensors, as before the operand dtype was counted.
    """
    from .loss import chunk_positions
    c = config
    fp32_width = 2 if fused_layers else 4
    attention = c.n_head * tokens if device == "cpu" else c.n_head
    per_layer = tokens * (4 * (fp32_width * c.dim + attention) + itemsize * (6 * c.dim + 4 * c.ffn_dim))
    positions = micro_batch * tokens
    logits = 4 * 3 * min(positions, chunk_positions(c.vocab_size)) * c.vocab_size
    if fused_layers and trained_head:
        logits = max(logits, itemsize * c.vocab_size * min(positions, chunk_positions(c.vocab_size, itemsize, c.dim)))
    return micro_batch * (c.n_layer * per_layer + 4 * tokens * c.dim) + logits

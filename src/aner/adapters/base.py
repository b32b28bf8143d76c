"""The adapter interface: a method initialises its tensors, wraps a projection, exports LoRA.

An adapter never copies the model: it replaces a projection module with a wrapper whose output is
`base(x) + delta(x)`. All adapter tensors of a model live in one flat dict keyed by
`<target>.<part>` (e.g. `blk.0.attn_q.weight.lora_a`), which is also the checkpoint layout.
Adapter contractions run in FP32 under every precision policy.
"""
import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from ..model import names

MAX_RANK = 256
MAX_TARGETS = 256
DEFAULT_TARGETS = ("attention.q_proj", "attention.v_proj")


@dataclass(frozen=True)
class AdapterConfig:
    method: str                  # lora | rslora | lora_fa | tinylora
    targets: tuple[str, ...]     # exact GGUF tensor names, canonical order
    rank: int
    alpha: float
    seed: int
    parameters: int = 0          # tinylora: trainable vector length
    sharing: str = ""            # tinylora: global | per_target

    def as_dict(self) -> dict:
        return {"method": self.method, "targets": list(self.targets), "rank": self.rank,
                "alpha": self.alpha, "seed": self.seed, "parameters": self.parameters,
                "sharing": self.sharing, "scale": self.scale}

    @property
    def scale(self) -> float:
        if self.method == "rslora":
            return self.alpha / self.rank ** 0.5
        if self.method == "tinylora":
            return 1.0
        return self.alpha / self.rank


def resolve_targets(requested, config, shapes: dict[str, tuple[int, int]], rank: int) -> tuple[str, ...]:
    """Aliases and exact names -> exact projection names in canonical order; validates rank."""
    if requested is None:
        requested = DEFAULT_TARGETS
    if isinstance(requested, str):
        requested = [requested]
    requested = list(requested)
    if not requested or len(requested) > MAX_TARGETS:
        raise ConfigError(f"targets has {len(requested)} entries; accepted: 1..{MAX_TARGETS}")
    if len(set(requested)) != len(requested):
        dup = next(t for t in requested if requested.count(t) > 1)
        raise ConfigError(f"target {dup!r} is listed twice; each target may appear once")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise ConfigError(f"rank={rank!r} is outside the accepted range 1..{MAX_RANK}")
    projections = [n for n, (_, role, _) in names.expected(config).items()
                   if role == "projection" and n != "output.weight"]
    chosen = set()
    for t in requested:
        if t in names.ALIASES:
            suffix = names.ALIASES[t]
            chosen.update(n for n in projections if n.endswith("." + suffix))
        elif t in projections:
            if t in chosen:
                raise ConfigError(f"target {t!r} is already selected by an alias in the same list")
            chosen.add(t)
        else:
            raise ConfigError(
                f"target {t!r} is neither a projection alias ({', '.join(names.ALIASES)}) nor an exact "
                f"projection name from parameter_names() (e.g. 'blk.0.attn_q.weight')")
    out = tuple(n for n in projections if n in chosen)
    for n in out:
        if rank > min(shapes[n]):
            raise ConfigError(f"rank={rank} exceeds target {n!r} of shape {shapes[n]}; "
                              f"accepted: 1..{min(shapes[n])}")
    return out


def full_precision(x: torch.Tensor):
    """Adapter contractions stay FP32 under a mixed-precision policy: autocast is off inside."""
    return torch.autocast(x.device.type, enabled=False)


def add_low_rank(base, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fused: bool, scale: float = 1.0):
    """base(x) + (x @ a^T) @ (scale * b)^T in the base output's dtype, the products in a's dtype
    (FP32 in models; float64 in gradient checks), for a frozen projection module `base`. `fused`:
    the GPU kernels of kernels.lora (FP32, one rounding of each sum, the base inside, the scale
    applied as they read b); else torch ops (the delta is rounded to the output's dtype, then
    added)."""
    if fused:
        from ..kernels.lora import adapted_projection
        return adapted_projection(base, x, a, b, scale)
    y = base(x)
    with full_precision(x):
        delta = (x.to(a.dtype) @ a.t()) @ (scale * b).t()        # (..., r) then (..., out)
    return y + delta.to(y.dtype)


def seeded(seed: int, *salt: int) -> torch.Generator:
    """A CPU generator for one (seed, salt...) stream: initialisation never depends on call order."""
    digest = hashlib.sha256(repr((seed,) + salt).encode()).digest()
    g = torch.Generator(device="cpu")
    g.manual_seed(int.from_bytes(digest[:8], "little") >> 1)
    return g


class Method:
    """What every adapter method implements; subclasses in lora.py and tinylora.py."""

    config: AdapterConfig

    def init(self, weights: dict) -> dict[str, torch.Tensor]:
        """All adapter tensors (trainable and frozen) for the base `weights`, on the CPU, FP32."""
        raise NotImplementedError

    def trainable(self) -> tuple[str, ...]:
        """Which tensor names (suffixes like 'lora_b', or full names) are optimizer leaves."""
        raise NotImplementedError

    def wrap(self, target: str, base: nn.Module, tensors: dict, fused: bool = False) -> nn.Module:
        """`base` plus this method's delta; `fused`: through kernels.lora on a GPU."""
        raise NotImplementedError

    def lora_factors(self, target: str, tensors: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(A (r, in), B (out, r)) with delta W = scale * B @ A, FP32."""
        raise NotImplementedError

    def precondition(self, grads: dict, tensors: dict) -> None:
        """Rewrite gradients in place before the optimizer sees them (LoRA-FA). Default: nothing."""

    def delta(self, target: str, tensors: dict) -> torch.Tensor:
        a, b = self.lora_factors(target, tensors)
        return self.config.scale * (b.double() @ a.double()).float()

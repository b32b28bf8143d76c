"""Adapter method names -> their classes and validated configurations."""
import math

from ..errors import ConfigError
from .base import AdapterConfig, resolve_targets
from .lora import LoRA

METHODS = {
    "lora": LoRA,
    "rslora": LoRA,   # same factors; AdapterConfig.scale gives alpha / sqrt(rank)
}


def config(kind, targets, rank, alpha, seed, model_config, shapes, **extra) -> AdapterConfig:
    targets = resolve_targets(targets, model_config, shapes, rank)
    if kind != "tinylora" and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                               or not math.isfinite(alpha) or alpha <= 0):
        raise ConfigError(f"alpha={alpha!r}; accepted: a finite number > 0")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"seed={seed!r} is outside the accepted range 0..2^63-1")
    return AdapterConfig(kind, targets, rank, float(alpha), seed, **extra)


def restore(saved: dict) -> AdapterConfig:
    """An AdapterConfig from its `as_dict()` form (checkpoint manifests)."""
    return AdapterConfig(saved["method"], tuple(saved["targets"]), saved["rank"], saved["alpha"],
                         saved["seed"], saved.get("parameters", 0), saved.get("sharing", ""))

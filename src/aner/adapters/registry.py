"""Adapter method names -> their classes and validated configurations."""
import math

from ..errors import ConfigError, FormatError
from .base import AdapterConfig, resolve_targets
from .lora import LoRA, LoRAFA
from .tinylora import MAX_PARAMETERS, SHARING, TinyLoRA

METHODS = {
    "lora": LoRA,
    "rslora": LoRA,     # same factors; AdapterConfig.scale gives alpha / sqrt(rank)
    "lora_fa": LoRAFA,  # A frozen, B's gradient preconditioned
    "tinylora": TinyLoRA,
}


def config(kind, targets, rank, alpha, seed, model_config, shapes, **extra) -> AdapterConfig:
    assert kind in METHODS, kind
    targets = resolve_targets(targets, model_config, shapes, rank)
    if kind != "tinylora" and (isinstance(alpha, bool) or not isinstance(alpha, (int, float))
                               or not math.isfinite(alpha) or alpha <= 0):
        raise ConfigError(f"alpha={alpha!r}; accepted: a finite number > 0")
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ConfigError(f"seed={seed!r} is outside the accepted range 0..2^63-1")
    if kind == "tinylora":
        _check_tinylora(**extra)
    else:
        assert not extra, extra
    return AdapterConfig(kind, targets, rank, float(alpha), seed, **extra)


def _check_tinylora(parameters, sharing) -> None:
    if isinstance(parameters, bool) or not isinstance(parameters, int) or not 1 <= parameters <= MAX_PARAMETERS:
        raise ConfigError(f"parameters={parameters!r} is outside the accepted range 1..{MAX_PARAMETERS}")
    if sharing not in SHARING:
        raise ConfigError(f"sharing={sharing!r}; accepted: {', '.join(repr(s) for s in SHARING)}")


def restore(saved: dict) -> AdapterConfig:
    """An AdapterConfig from its `as_dict()` form (checkpoint manifests)."""
    if saved.get("method") not in METHODS:
        raise FormatError(f"adapter method {saved.get('method')!r} is not known to this aner; known: "
                          f"{', '.join(METHODS)}. Load it with the aner release that wrote it")
    return AdapterConfig(saved["method"], tuple(saved["targets"]), saved["rank"], saved["alpha"],
                         saved["seed"], saved.get("parameters", 0), saved.get("sharing", ""))

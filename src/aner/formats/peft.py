"""Adapters as PEFT LoRA directories, for Hugging Face `transformers` + `peft` users.

    adapter/
      adapter_model.safetensors   base_model.model.<hf module>.lora_A.weight (r, in) / .lora_B.weight (out, r)
      adapter_config.json         peft_type LORA, task_type CAUSAL_LM, r, lora_alpha, target_modules, use_rslora

Every method exports through `Method.lora_factors` (delta W = s * B @ A). PEFT scales by
lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, so rsLoRA writes its alpha with
use_rslora = true, LoRA and LoRA-FA write their alpha, and TinyLoRA writes lora_alpha = r (scale 1)
with A = V_r^T and B = U_r diag(S_r) R materialised at rank r.

Hugging Face keeps Q and K rows in the half-split RoPE layout where GGUF uses adjacent pairs, so
B's rows of q/k targets go through `names.to_hf` (the inverse of llama.cpp's conversion permute);
A acts on the input columns and is unchanged. The safetensors metadata carries our format name,
version and the base's identity.
"""
import json

import torch
from safetensors.torch import save_file

from ..errors import ConfigError
from ..model import names
from .publish import staged_dir

FORMAT = "aner.peft-adapter"
VERSION = 1


def peft_tensors(model) -> dict[str, torch.Tensor]:
    """PEFT key -> FP32 CPU tensor, for every target of the model's adapter."""
    method, config = model._method, model._source.config
    adapter = {k: v.detach().cpu() for k, v in model._adapter_tensors.items()}
    out = {}
    for target in method.config.targets:
        a, b = method.lora_factors(target, adapter)
        module = "base_model.model." + names.hf_name(target).removesuffix(".weight")
        out[f"{module}.lora_A.weight"] = a.float().contiguous().clone()
        out[f"{module}.lora_B.weight"] = names.to_hf(target, b.float(), config).contiguous().clone()
    return out


def target_modules(targets, config) -> list[str]:
    """Short module names (`q_proj`) when the targets are every layer of their kinds, else exact paths
    (PEFT matches a name exactly or as the last components of a module path)."""
    paths = [names.hf_name(t).removesuffix(".weight") for t in targets]   # model.layers.{i}.self_attn.q_proj
    kinds = {p.split(".", 3)[3] for p in paths}                             # self_attn.q_proj
    if set(paths) == {f"model.layers.{i}.{k}" for i in range(config.n_layer) for k in kinds}:
        return sorted(k.rsplit(".", 1)[1] for k in kinds)
    return paths


def peft_config(model) -> dict:
    cfg = model._method.config
    rs = cfg.method == "rslora"
    # PEFT's scaling is lora_alpha / r (or / sqrt(r)): the alpha as trained where the method has one,
    # else s * r (TinyLoRA: r, scale 1)
    alpha = cfg.alpha if cfg.method in ("lora", "rslora", "lora_fa") else cfg.scale * cfg.rank
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.rank,
        "lora_alpha": alpha,
        "use_rslora": rs,
        "target_modules": target_modules(cfg.targets, model._source.config),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "base_model_name_or_path": None,
        "revision": None,
    }


def save_peft_adapter(model, directory) -> str:
    if model._method is None:
        raise ConfigError("a full fine-tune has no adapter to save: every weight changed. "
                          "Use save_model(path) to publish the merged GGUF")
    src = model._source
    metadata = {"format": "pt", "aner.format": FORMAT, "aner.version": str(VERSION),
                "aner.method": model.method(), "aner.base.source_sha256": src.sha256,
                "aner.base.canonical_sha256": src.canonical_sha256, "aner.updates": str(model.updates())}
    with staged_dir(directory) as tmp:
        save_file(peft_tensors(model), str(tmp / "adapter_model.safetensors"), metadata=metadata)
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config(model), indent=1, sort_keys=True))
    return str(directory)

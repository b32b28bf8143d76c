"""Deployment artifacts: a merged F32 GGUF, and adapters in llama.cpp's LoRA GGUF format.

llama.cpp applies an adapter tensor pair as  W x + (alpha / r) * B (A x)  with r = rank read from
`lora_b`'s first GGUF dimension. Every method exports factors (A, B) with delta W = s * B @ A and
writes `adapter.lora.alpha = s * r`, so llama.cpp's alpha / r reproduces our scale s exactly
(rsLoRA's alpha / sqrt(r) and TinyLoRA's materialised factors included).
"""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from .gguf import Field, float32_field, string_field, uint32_field, write_gguf
from .publish import sha256_file, staged_dir

ADAPTER_FORMAT = "aner.adapter"
ADAPTER_VERSION = 1


def provenance(model) -> list[Field]:
    src = model._source
    return [
        string_field("aner.base.source_sha256", src.sha256),
        string_field("aner.base.canonical_sha256", src.canonical_sha256),
        string_field("aner.method", model.method()),
        string_field("aner.storage", model.storage()),
        uint32_field("aner.updates", model.updates()),
        string_field("aner.lineage", ",".join(model._lineage)),
    ]


def save_merged(model, path) -> str:
    """Merged F32 GGUF: the source's metadata (tokenizer, template) plus provenance."""
    fields = [f for f in model._source.fields if f.key != "general.file_type" and not f.key.startswith("aner.")]
    fields += [uint32_field("general.file_type", 0), *provenance(model)]
    merged = model.merged_weights()
    write_gguf(path, fields, ((n, w.numpy().astype(np.float32)) for n, w in merged.items()))
    return str(path)


@dataclass(frozen=True)
class AdapterManifest:
    """What `save_adapter` returns and `llm.LLMModel.with_adapter` takes."""
    path: str                 # the adapter folder
    adapter_path: str         # its adapter.gguf
    base_sha256: str          # SHA-256 of the exact GGUF file it applies to
    base_canonical_sha256: str
    base_path: str
    method: str
    rank: int
    effective_scale: float    # the method's s in delta W = s * B @ A (alpha/r, alpha/sqrt(r), 1)
    targets: tuple[str, ...]
    scale: float = 1.0        # the deployment multiplier llama.cpp applies on top (1 = as trained)

    @classmethod
    def load(cls, directory) -> "AdapterManifest":
        data = json.loads((Path(directory) / "adapter.json").read_text())
        return cls(path=str(directory), adapter_path=str(Path(directory) / "adapter.gguf"),
                   base_sha256=data["base"]["sha256"], base_canonical_sha256=data["base"]["canonical_sha256"],
                   base_path=data["base"]["path"], method=data["method"], rank=data["rank"],
                   effective_scale=data["scale"], targets=tuple(data["targets"]))


def adapter_fields(model) -> list[Field]:
    cfg = model._method.config
    return [string_field("general.architecture", "llama"),
            string_field("general.type", "adapter"),
            string_field("adapter.type", "lora"),
            float32_field("adapter.lora.alpha", cfg.scale * cfg.rank),
            *provenance(model)]


def write_adapter_gguf(model, path) -> None:
    method, cfg = model._method, model._method.config
    adapter = {k: v.detach().cpu() for k, v in model._adapter_tensors.items()}

    def tensors():
        for target in cfg.targets:
            a, b = method.lora_factors(target, adapter)
            yield f"{target}.lora_a", a.numpy().astype(np.float32)   # (r, in):  GGUF ne = [in, r]
            yield f"{target}.lora_b", b.numpy().astype(np.float32)   # (out, r): GGUF ne = [r, out]

    write_gguf(path, adapter_fields(model), tensors())


def save_adapter(model, directory) -> AdapterManifest:
    if model._method is None:
        raise ConfigError("a full fine-tune has no adapter to save: every weight changed. "
                          "Use save_model(path) to publish the merged GGUF")
    src, cfg = model._source, model._method.config
    with staged_dir(directory) as tmp:
        write_adapter_gguf(model, tmp / "adapter.gguf")
        training = {"updates": model.updates(), "scored_tokens": model.scored_tokens(),
                    "validation_loss": model._state.validation_loss if model._state else None,
                    "run": model._state.run.as_dict() if model._state else None,
                    "lineage": list(model._lineage)}
        (tmp / "training.json").write_text(json.dumps(training, indent=1, sort_keys=True))
        manifest = {"format": ADAPTER_FORMAT, "version": ADAPTER_VERSION,
                    "base": {"sha256": src.sha256, "canonical_sha256": src.canonical_sha256, "path": src.path},
                    **cfg.as_dict(),
                    "files": {f: sha256_file(tmp / f) for f in ("adapter.gguf", "training.json")}}
        (tmp / "adapter.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return AdapterManifest.load(directory)

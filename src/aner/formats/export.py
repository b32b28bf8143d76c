"""Deployment artifacts: a merged F32 GGUF, and adapters in llama.cpp's LoRA GGUF format.

llama.cpp applies an adapter tensor pair as  W x + (alpha / r) * B (A x)  with r = rank read from
`lora_b`'s first GGUF dimension. Every method exports factors (A, B) with delta W = s * B @ A and
writes `adapter.lora.alpha = s * r`, so llama.cpp's alpha / r reproduces our scale s exactly
(rsLoRA's alpha / sqrt(r) and TinyLoRA's materialised factors included).

A packed NF4 base is decoded for export one matrix at a time. Its adapters are bound to that
decoded base, published beside them as a standalone package (`_save_package`).
"""
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..train.memory import admit
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
    _admit_export(model, "exporting the merged model")
    # One matrix at a time: a packed base is decoded (and merged) per tensor, then written and dropped.
    write_gguf(path, fields, ((n, w.numpy().astype(np.float32)) for n, w in model.iter_merged_weights()))
    return str(path)


def _admit_export(model, what: str) -> None:
    """The model's owned bytes plus one matrix workspace: decoded, merged and written copies (FP32)."""
    m = model.memory_summary()
    largest = max(4 * int(np.prod(s)) for s in model._shapes().values())
    admit(f"{what} (owned weights plus one FP32 matrix workspace)",
          m.weight_bytes + m.adapter_bytes + m.frozen_adapter_bytes + 3 * largest, model._budget)


def base_fields(model) -> list[Field]:
    """Metadata of a decoded NF4 base: the source's (tokenizer, template) plus where it came from."""
    src = model._source
    fields = [f for f in src.fields if f.key != "general.file_type" and not f.key.startswith("aner.")]
    return fields + [uint32_field("general.file_type", 0),
                     string_field("aner.base.source_sha256", src.sha256),
                     string_field("aner.base.canonical_sha256", src.canonical_sha256),
                     string_field("aner.storage", model.storage())]


def write_decoded_base(model, path) -> str:
    """The exact frozen training base (every NF4 matrix decoded, norms as they are) as an F32 GGUF,
    one matrix at a time; returns its canonical SHA-256 (over the decoded FP32 values).

    It depends on the packed base only, not on the adapter or training, so every adapter trained
    on one packed base is published with the same base.gguf bytes.
    """
    from ..model.handle import CanonicalHash
    hasher = CanonicalHash(model.config())

    def tensors():
        for name, w in model.iter_merged_weights(merge=False):
            values = w.numpy().astype(np.float32)
            hasher.update(name, values)
            yield name, values

    write_gguf(path, base_fields(model), tensors())
    return hasher.hexdigest()


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
    if model.storage() != "float32":
        return _save_package(model, directory)
    src = model._source
    with staged_dir(directory) as tmp:
        _write_adapter(model, tmp, {"sha256": src.sha256, "canonical_sha256": src.canonical_sha256,
                                    "path": src.path})
    return AdapterManifest.load(directory)


def _write_adapter(model, folder: Path, base: dict) -> None:
    """adapter.gguf, training.json, then adapter.json (bound to `base`) into `folder`."""
    write_adapter_gguf(model, folder / "adapter.gguf")
    training = {"updates": model.updates(), "scored_tokens": model.scored_tokens(),
                "validation_loss": model._state.validation_loss if model._state else None,
                "run": model._state.run.as_dict() if model._state else None,
                "lineage": list(model._lineage)}
    (folder / "training.json").write_text(json.dumps(training, indent=1, sort_keys=True))
    manifest = {"format": ADAPTER_FORMAT, "version": ADAPTER_VERSION, "base": base,
                **model._method.config.as_dict(),
                "files": {f: sha256_file(folder / f) for f in ("adapter.gguf", "training.json")}}
    (folder / "adapter.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))


DEPLOYMENT_FORMAT = "aner.deployment"
DEPLOYMENT_VERSION = 1
PACKAGE_FILES = ("base.gguf", "adapter/adapter.gguf", "adapter/adapter.json", "adapter/training.json")


def _save_package(model, directory) -> AdapterManifest:
    """An adapter trained on a packed NF4 base, published with that base (standalone package):

        base.gguf               the exact decoded frozen training base, F32
        adapter/adapter.gguf
        adapter/adapter.json    bound to base.gguf's SHA-256 and canonical identity
        adapter/training.json
        deployment.json         written last: the package's publication marker

    The decoded base differs from the original floating GGUF, so the adapter is bound to base.gguf
    and the original fails its identity check: no change to the model hides under an adapter.
    """
    src = model._source
    _admit_export(model, "exporting the decoded NF4 base")
    directory = Path(directory)
    with staged_dir(directory) as tmp:
        canonical = write_decoded_base(model, tmp / "base.gguf")
        base = {"sha256": sha256_file(tmp / "base.gguf"), "canonical_sha256": canonical,
                "path": str(directory / "base.gguf"), "storage": model.storage(),
                "source_sha256": src.sha256, "source_canonical_sha256": src.canonical_sha256}
        (tmp / "adapter").mkdir()
        _write_adapter(model, tmp / "adapter", base)
        deployment = {"format": DEPLOYMENT_FORMAT, "version": DEPLOYMENT_VERSION, "base": "base.gguf",
                      "adapter": "adapter/adapter.json", "storage": model.storage(), "method": model.method(),
                      "source": {"sha256": src.sha256, "canonical_sha256": src.canonical_sha256},
                      "files": {f: sha256_file(tmp / f) for f in PACKAGE_FILES}}
        (tmp / "deployment.json").write_text(json.dumps(deployment, indent=1, sort_keys=True))
    return AdapterManifest.load(directory / "adapter")

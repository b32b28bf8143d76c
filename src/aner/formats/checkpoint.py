"""Checkpoint packages: everything a run needs to continue exactly, checksummed, manifest last.

    checkpoint/
      weights.safetensors     base weights (FP32, or the actual packed NF4 buffers)
      adapter.safetensors     adapter tensors, trainable and fixed (absent for full fine-tuning)
      optimizer.safetensors   Adam moments `<name>.exp_avg` / `<name>.exp_avg_sq`
      metadata.gguf           the source's metadata (tokenizer, template, hyper-parameters), no tensors
      manifest.json           format, version, backend identity, SHA-256 of every file, run state

A folder without `manifest.json` is not a checkpoint. Loading verifies every checksum first and
refuses another format version, another backend identity or mismatched shapes.
"""
import hashlib
import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import ArtifactError, FormatError
from .gguf import read_gguf, write_gguf
from .publish import sha256_file, staged_dir
from ..train.device import execution_profile

FORMAT = "aner.checkpoint"
VERSION = 1


def _save(tensors: dict, path: Path) -> None:
    save_file({k: v.detach().cpu().contiguous() for k, v in sorted(tensors.items())}, str(path))


def write_checkpoint(model, path) -> str:
    from ..gen import training_backend
    from ..model.handle import PretrainedModel
    assert isinstance(model, PretrainedModel)
    state, src = model._state, model._source
    with staged_dir(path) as tmp:
        weights = {}
        for name, w in model._weights.items():
            if isinstance(w, torch.Tensor):
                weights[name] = w
            else:
                weights.update({f"{name}.{k}": v for k, v in w.tensors().items()})
        _save(weights, tmp / "weights.safetensors")
        if model._adapter_tensors:
            _save(model._adapter_tensors, tmp / "adapter.safetensors")
        moments = {}
        for name, (m, v) in (state.moments.items() if state else ()):
            moments[f"{name}.exp_avg"], moments[f"{name}.exp_avg_sq"] = m, v
        _save(moments, tmp / "optimizer.safetensors")
        write_gguf(tmp / "metadata.gguf", src.fields, ())
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "backend": training_backend(),
            "device": model._device,
            "budget_bytes": model._budget,
            "storage": model._storage,
            "tied_embeddings": src.config.tied_embeddings,
            "profile": model._profile.as_dict(),
            "execution": execution_profile(model._device),
            "loss_scale": state.loss_scale.as_dict() if state else None,
            "source": {"path": src.path, "sha256": src.sha256, "canonical_sha256": src.canonical_sha256,
                       "tokenizer_sha256": src.tokenizer_sha256},
            "adapter": model._method.config.as_dict() if model._method else None,
            "run": state.run.as_dict() if state else None,
            "counters": {"updates": model.updates(), "scored_tokens": model.scored_tokens(),
                         "cursor": state.cursor if state else 0},
            "data": {"training_sha256": state.training_sha256, "validation_sha256": state.validation_sha256}
            if state else None,
            "validation_loss": state.validation_loss if state else None,
            "losses": list(state.losses) if state else [],
            "lineage": list(model._lineage),
            "lineage_examples": sorted(model._lineage_examples),
            "files": {f.name: sha256_file(f) for f in sorted(tmp.iterdir())},
        }
        manifest["manifest_sha256"] = _digest(manifest)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return str(path)


def _digest(manifest: dict) -> str:
    """SHA-256 of the manifest's own content (without this field): the manifest is checked too."""
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_manifest(path) -> dict:
    """Verify the manifest and every file's checksum; return the manifest."""
    path = Path(path)
    mf = path / "manifest.json"
    if not path.is_dir():
        raise ArtifactError(f"checkpoint {str(path)!r} does not exist or is not a folder")
    if not mf.is_file():
        raise ArtifactError(f"{str(path)!r} has no manifest.json: it is not a checkpoint (an interrupted "
                            "publication leaves no manifest)")
    try:
        manifest = json.loads(mf.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise FormatError(f"{str(mf)!r} is not valid JSON: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FormatError(f"{str(mf)!r} has format {manifest.get('format') if isinstance(manifest, dict) else None!r}; "
                          f"expected {FORMAT!r}")
    if manifest.get("manifest_sha256") != _digest(manifest):
        raise ArtifactError(f"{str(mf)!r} does not match its own SHA-256: the manifest was changed or corrupted")
    if manifest.get("version") != VERSION:
        raise FormatError(f"checkpoint {str(path)!r} has format version {manifest.get('version')!r}; this aner "
                          f"reads version {VERSION}: load it with the aner release that wrote it")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise FormatError(f"{str(mf)!r} lists no files")
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            raise ArtifactError(f"checkpoint file {str(f)!r} listed in the manifest is missing")
        if sha256_file(f) != digest:
            raise ArtifactError(f"checkpoint file {str(f)!r} does not match its SHA-256 in the manifest: "
                                "it was changed or corrupted")
    return manifest


def read_checkpoint(path, device: str, budget: int):
    from ..adapters import registry
    from ..gen import training_backend
    from ..model import names
    from ..model.config import LlamaConfig
    from ..model.handle import PretrainedModel, Source
    from ..train.loop import RunConfig, TrainState
    from ..errors import ConfigError
    from ..train.memory import admit
    from ..train.profile import Profile
    from ..train.scaler import LossScale

    path = Path(path)
    manifest = read_manifest(path)
    backend = training_backend()
    if manifest["backend"] != backend:
        raise ArtifactError(f"checkpoint {str(path)!r} was written by backend {manifest['backend']!r}; this "
                            f"process is {backend!r}. Exact resume needs the same numerical backend")
    if manifest["device"] != device:
        raise ConfigError(f"checkpoint {str(path)!r} resumes on its recorded device {manifest['device']!r}; "
                          f"got device={device!r}")
    if manifest["execution"] != execution_profile(device):
        raise ArtifactError(f"checkpoint {str(path)!r} was written on {manifest['execution']}; this process runs "
                            f"on {execution_profile(device)}. Exact resume needs the same execution profile")
    profile = Profile.from_dict(manifest["profile"])
    admit("loading this checkpoint", sum((path / f).stat().st_size for f in manifest["files"]), budget)
    meta = read_gguf(path / "metadata.gguf")
    config = LlamaConfig.from_gguf(meta, tied=manifest["tied_embeddings"])
    s = manifest["source"]
    source = Source(path=s["path"], sha256=s["sha256"], canonical_sha256=s["canonical_sha256"],
                    tokenizer_sha256=s["tokenizer_sha256"], config=config, fields=tuple(meta.fields.values()),
                    metadata_path=str(path / "metadata.gguf"))
    raw = load_file(str(path / "weights.safetensors"))
    weights = _unpack_weights(raw, manifest["storage"])
    shapes = {n: tuple(s) for n, (_, _, s) in names.expected(config).items()}
    for name, w in weights.items():
        if tuple(w.shape) != shapes.get(name):
            raise FormatError(f"checkpoint tensor {name!r} has shape {tuple(w.shape)}; expected {shapes.get(name)}")
    if set(weights) != set(shapes):
        raise FormatError(f"checkpoint weights do not match the model's tensors: missing "
                          f"{sorted(set(shapes) - set(weights))[:5]}, extra {sorted(set(weights) - set(shapes))[:5]}")
    method, adapter = None, {}
    if manifest["adapter"] is not None:
        a = manifest["adapter"]
        cfg = registry.restore(a)
        method = registry.METHODS[cfg.method](cfg)
        adapter = load_file(str(path / "adapter.safetensors"))
    state = None
    if manifest["run"] is not None:
        opt = load_file(str(path / "optimizer.safetensors"))
        moments = {k[:-len(".exp_avg")]: (opt[k], opt[k + "_sq"]) for k in sorted(opt) if k.endswith(".exp_avg")}
        c = manifest["counters"]
        # Paged moments live in pinned host memory; resident ones on the training device.
        place = (lambda t: t.pin_memory()) if profile.optimizer == "paged_adamw" else (lambda t: t.to(device))
        state = TrainState(RunConfig(**manifest["run"]), manifest["data"]["training_sha256"],
                           manifest["data"]["validation_sha256"], c["updates"], c["scored_tokens"], c["cursor"],
                           {n: (place(m), place(v)) for n, (m, v) in moments.items()},
                           manifest["validation_loss"], tuple(manifest["losses"]),
                           LossScale(**manifest["loss_scale"]))
    return PretrainedModel(
        source=source, device=device, budget=budget,
        # NF4 weights stay on the host
        weights={n: w.to(device) if isinstance(w, torch.Tensor) else w for n, w in weights.items()},
        storage=manifest["storage"], method=method, adapter_tensors={n: t.to(device) for n, t in adapter.items()},
        state=state, lineage=manifest["lineage"], lineage_examples=manifest["lineage_examples"], profile=profile)


def _unpack_weights(raw: dict, storage: str) -> dict:
    """weights.safetensors -> name -> FP32 tensor or NF4Weight. A packed base stores each matrix as
    its NF4Weight.tensors() under `<name>.<part>` and its norm vectors as plain FP32 `<name>`."""
    from ..quant.nf4 import TENSOR_PARTS, NF4Weight
    from ..quant.storage import STORAGES
    if storage == "float32":
        return raw
    if storage not in STORAGES:
        raise FormatError(f"checkpoint storage {storage!r} is not supported by this aner; accepted: "
                          f"{', '.join(repr(s) for s in STORAGES)}")
    floating, parts = {}, {}
    for key, t in raw.items():
        name, _, part = key.rpartition(".")
        if part in TENSOR_PARTS:
            parts.setdefault(name, {})[part] = t
        else:
            floating[key] = t
    packed = {}
    for name, tensors in parts.items():
        try:
            packed[name] = NF4Weight.from_tensors(tensors)
        except FormatError as e:
            raise FormatError(f"checkpoint tensor {name!r}: {e}") from e
        if packed[name].double_quant != (storage == "nf4_double_quant"):
            raise FormatError(f"checkpoint tensor {name!r} has double_quant={packed[name].double_quant}, "
                              f"but the checkpoint's storage is {storage!r}")
    for name, t in floating.items():
        if t.dim() != 1 or t.dtype != torch.float32:
            raise FormatError(f"checkpoint tensor {name!r} is a {t.dtype} tensor of shape {tuple(t.shape)} in "
                              f"a {storage!r} checkpoint, where only FP32 norm vectors stay floating")
    return {**floating, **packed}

"""The `gen` module: import, data, checkpoints, conversion and capabilities.

Every function validates its arguments and raises an `AnerError` naming the bad value; nothing
falls back silently (no CPU fallback, no precision change, no repair of data).
"""
import functools
import hashlib
from pathlib import Path

import numpy as np
import torch

from .errors import ConfigError, UnsupportedModelError
from .formats.gguf import dequantize_gguf, read_gguf
from .model import names
from .model.config import LlamaConfig
from .model.handle import BACKEND_NAME, CanonicalHash, PretrainedModel, Source, canonical_sha256, check_device
from .train.memory import DEFAULT_BUDGET, admit, check_budget

_NUMERIC_PACKAGES = ("model", "train", "adapters", "quant", "kernels")


def training_available() -> bool:
    """True when the training backend (PyTorch) is importable; this build always has it."""
    return True


@functools.lru_cache(maxsize=None)
def _build_sha256() -> str:
    root = Path(__file__).parent
    h = hashlib.sha256()
    for pkg in _NUMERIC_PACKAGES:
        for f in sorted((root / pkg).glob("*.py")):
            h.update(f"{pkg}/{f.name}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def training_backend() -> str:
    """Identity of the numerical backend: version, torch, dtype, threads, hash of the numeric source."""
    return (f"{BACKEND_NAME};torch={torch.__version__};fp32;threads={torch.get_num_threads()};"
            f"build={_build_sha256()}")


def dequantize_model(src, dst, dtype="f16") -> Path:
    """Convert any GGUF gguf-py can dequantize into an F32 or F16 GGUF (metadata kept, provenance added)."""
    return dequantize_gguf(src, dst, dtype)


def quantize_model(src, dst, format="q4_0") -> Path:
    """Quantize a floating GGUF for deployment with llama.cpp's own quantizer."""
    from .formats.quantize import quantize_gguf
    return quantize_gguf(src, dst, format)


def _open_floating(path):
    """Read and validate a floating dense Llama GGUF: (file, config)."""
    gguf = read_gguf(path)
    config = LlamaConfig.from_gguf(gguf)
    for t in gguf.tensors.values():
        if not t.is_float():
            raise UnsupportedModelError(
                f"tensor {t.name!r} is stored as {t.type.name}; training imports floating F32/F16/BF16 "
                f"weights only. Convert the file first with gen.dequantize_model(src, dst, dtype='f16')")
    names.check_tensors(config, {n: t.shape for n, t in gguf.tensors.items()})
    return gguf, config


def _source(gguf, config, weights, canonical=None) -> Source:
    """The source identity; `canonical` (a streamed import's CanonicalHash digest) replaces hashing `weights`."""
    from .data.tokenizer import identity
    canonical = canonical if canonical is not None else canonical_sha256(config, weights)
    return Source(path=str(gguf.path), sha256=gguf.sha256(), canonical_sha256=canonical,
                  tokenizer_sha256=identity(gguf.fields), config=config, fields=tuple(gguf.fields.values()),
                  metadata_path=str(gguf.path))


def import_model(path, device="cpu", max_memory_bytes=DEFAULT_BUDGET) -> PretrainedModel:
    """Import a floating dense Llama GGUF into FP32 weights for training."""
    budget = check_budget(max_memory_bytes)
    device = check_device(device)
    gguf, config = _open_floating(path)
    sizes = [int(np.prod(t.shape)) * 4 for t in gguf.tensors.values()]
    admit("importing this model (FP32 weights plus one matrix workspace)", sum(sizes) + max(sizes), budget)
    weights = {}
    for name in names.expected(config):
        weights[name] = torch.from_numpy(_finite_values(gguf, name))
    source = _source(gguf, config, weights)
    weights = {n: w.to(device) for n, w in weights.items()}
    return PretrainedModel(source=source, weights=weights, device=device, budget=budget)


def _finite_values(gguf, name) -> np.ndarray:
    values = gguf.tensors[name].float32()
    if not np.isfinite(values).all():
        raise UnsupportedModelError(f"tensor {name!r} holds non-finite values (NaN or infinity)")
    return values


def import_nf4(path, double_quant=True, max_memory_bytes=DEFAULT_BUDGET, device="cpu") -> PretrainedModel:
    """Import a floating dense Llama GGUF straight into a frozen NF4 base, one matrix at a time.

    Each tensor's FP32 values are read, hashed into the source identity, packed (matrices) or kept
    (norm vectors, FP32), and dropped before the next is read: the dense model never exists here.
    The result equals `import_model(path).nf4(double_quant)` (same packed bytes, same identity).
    Packed buffers stay on the CPU; norm vectors go to `device`.
    """
    from .quant.storage import PACK_WORKSPACE_BYTES, check_double_quant, pack_matrix, storage_name, stored_nbytes
    double_quant = check_double_quant(double_quant)
    budget = check_budget(max_memory_bytes)
    device = check_device(device)
    gguf, config = _open_floating(path)
    table = names.expected(config)
    owned = sum(stored_nbytes(shape, double_quant) for _, _, shape in table.values())
    workspace = max(4 * int(np.prod(shape)) for _, _, shape in table.values()) + PACK_WORKSPACE_BYTES
    admit("importing this model as NF4 (packed weights plus one FP32 matrix and packing workspace)",
          owned + workspace, budget)
    hasher, weights = CanonicalHash(config), {}
    for name in table:
        values = _finite_values(gguf, name)
        hasher.update(name, values)
        w = torch.from_numpy(values)
        weights[name] = pack_matrix(w, double_quant) if w.dim() == 2 else w.to(device)
        del values, w   # drop this matrix's FP32 values before the next one is read
    source = _source(gguf, config, None, canonical=hasher.hexdigest())
    return PretrainedModel(source=source, weights=weights, device=device, budget=budget,
                           storage=storage_name(double_quant))


def supervised_csv(model, path, input="question", target="answer", role="training", context=128):
    """Prepare question/answer rows with the model's tokenizer and built-in chat template."""
    from .data.supervised import supervised_csv as prepare
    from .data.tokenizer import Tokenizer
    if not isinstance(model, PretrainedModel):
        raise ConfigError(f"model must be a PretrainedModel from gen.import_model; got {type(model).__name__}")
    source = model._source
    tokenizer = Tokenizer.from_gguf(source.metadata_path)
    return prepare(tokenizer, source.tokenizer_sha256, source.config.context_length, path, input, target,
                   role, context)


def load_pretrained_checkpoint(path, device="cpu", max_memory_bytes=DEFAULT_BUDGET) -> PretrainedModel:
    """Load a checkpoint package, verifying every checksum and the backend identity."""
    from .formats.checkpoint import read_checkpoint
    return read_checkpoint(path, device=check_device(device), budget=check_budget(max_memory_bytes))

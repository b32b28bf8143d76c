"""Tiny random Llama GGUF files, written by the tests themselves.

They borrow the embedded SmolLM2's tokenizer and chat template (metadata only), so llama.cpp loads
them like a real model; everything else — shapes, weights, dtype, tied or untied head — is chosen
here. Weights are random with a realistic scale so that logits are not degenerate.
"""
from dataclasses import dataclass

import numpy as np
from gguf import GGUFValueType

from aner.formats.gguf import Field, bf16_bits, read_gguf, write_gguf
from aner.model.config import LlamaConfig
from aner.model import names


@dataclass(frozen=True)
class Shape:
    n_layer: int = 2
    dim: int = 64
    n_head: int = 4
    n_kv_head: int = 2
    ffn_dim: int = 96
    context_length: int = 256
    tied: bool = True


SMOLLM2 = Shape(n_layer=30, dim=576, n_head=9, n_kv_head=3, ffn_dim=1536, context_length=8192)


def tokenizer_fields(source_gguf) -> list[Field]:
    return [f for k, f in read_gguf(source_gguf).fields.items() if k.startswith("tokenizer.")]


def write_random_llama(path, shape: Shape, tok_fields: list[Field], dtype="f32", seed=0,
                       extra_fields=()):
    """Write a random dense Llama GGUF. dtype: 'f32', 'f16' or 'bf16' for matrices; norms F32."""
    vocab = len(next(f.value for f in tok_fields if f.key == "tokenizer.ggml.tokens"))
    config = LlamaConfig(shape.n_layer, shape.dim, shape.n_head, shape.n_kv_head, shape.ffn_dim, vocab,
                         shape.context_length, 1e-5, 10000.0, shape.tied)
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    fields = [
        Field("general.architecture", "llama", GGUFValueType.STRING),
        Field("general.name", "aner-test-tiny", GGUFValueType.STRING),
        Field("llama.block_count", shape.n_layer, u32),
        Field("llama.context_length", shape.context_length, u32),
        Field("llama.embedding_length", shape.dim, u32),
        Field("llama.feed_forward_length", shape.ffn_dim, u32),
        Field("llama.attention.head_count", shape.n_head, u32),
        Field("llama.attention.head_count_kv", shape.n_kv_head, u32),
        Field("llama.rope.freq_base", 10000.0, f32),
        Field("llama.attention.layer_norm_rms_epsilon", 1e-5, f32),
        Field("llama.rope.dimension_count", shape.dim // shape.n_head, u32),
        Field("general.file_type", {"f32": 0, "f16": 1, "bf16": 32}[dtype], u32),
        *tok_fields, *extra_fields,
    ]
    rng = np.random.default_rng(seed)

    def tensors():
        for name, (_, role, tshape) in names.expected(config).items():
            if role == "norm":
                yield name, (1.0 + 0.1 * rng.standard_normal(tshape)).astype(np.float32)
                continue
            w = (rng.standard_normal(tshape) / np.sqrt(tshape[-1])).astype(np.float32)
            if role == "embedding":
                w *= 4.0  # embeddings are not fan-in scaled in real models
            yield name, _cast(w, dtype)

    write_gguf(path, fields, tensors())
    return path


def _cast(w: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "f32":
        return w
    if dtype == "f16":
        return w.astype(np.float16)
    assert dtype == "bf16"
    return bf16_bits(w)


def rewrite(src, dst, fields=None, drop=(), tensors=None):
    """Copy a floating GGUF with some metadata replaced or dropped and tensors edited.

    fields: {key: Field} to set; drop: keys to remove; tensors: f(name, array) -> array or None
    (None drops the tensor), or a dict of extra tensors to add.
    """
    g = read_gguf(src)
    out = {k: f for k, f in g.fields.items() if k not in drop}
    out.update(fields or {})
    edit = tensors if callable(tensors) else (lambda n, a: a)
    extra = tensors if isinstance(tensors, dict) else {}

    def arrays():
        for name, t in g.tensors.items():
            a = edit(name, t.float32() if t.type.name == "F32" else np.array(t.raw))
            if a is not None:
                yield name, a
        yield from extra.items()

    write_gguf(dst, out.values(), arrays())
    return dst


def assert_same_state(a, b):
    """Bitwise: weights (packed ones by their buffers), adapter tensors, moments, counters, cursor,
    losses and validation loss of two trained models."""
    import torch
    for k, w in a._weights.items():
        pairs = zip(w.tensors().values(), b._weights[k].tensors().values()) if not isinstance(w, torch.Tensor) \
            else [(w, b._weights[k])]
        assert all(torch.equal(x.cpu(), y.cpu()) for x, y in pairs), k
    assert a._adapter_tensors.keys() == b._adapter_tensors.keys()
    for k in a._adapter_tensors:
        assert torch.equal(a._adapter_tensors[k], b._adapter_tensors[k]), k
    assert a._state.moments.keys() == b._state.moments.keys() and a._state.moments
    for k, (m, v) in a._state.moments.items():
        assert torch.equal(m, b._state.moments[k][0]) and torch.equal(v, b._state.moments[k][1]), k
    assert (a.updates(), a.scored_tokens(), a._state.cursor) == (b.updates(), b.scored_tokens(), b._state.cursor)
    assert a._state.losses == b._state.losses
    assert a.validation_loss() == b.validation_loss()


def train_counting_saved(select, data, **kw):
    """(the model `select.fine_tune(*data, steps=1, **kw)` trains, the bytes of every tensor
    autograd saved for backward during it that is not one of the model's weights or adapter
    tensors). Each saved tensor is held until the end, so no storage is counted twice and the
    figure is at least the largest set alive at once."""
    import torch
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        model = select.fine_tune(*data, steps=1, **kw)
    own = {t.untyped_storage().data_ptr() for t in [*model._weights.values(), *model._adapter_tensors.values()]
           if isinstance(t, torch.Tensor)}
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return model, sum(n for ptr, n in storages.items() if ptr not in own)


def tokens(n, vocab=49152, seed=0):
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


# Max abs difference of our FP32 logits from llama.cpp's. The FP32 rounding of both sides depends
# on the CPU's vector width: SmolLM2 (max |logit| 30.5, 32 tokens) measured 1.06e-4 on an AVX-512
# machine, 7.5e-5 there with torch's GEMMs held to AVX2 (MKL_ENABLE_INSTRUCTIONS=AVX2), 6e-5..8e-5
# over other token draws. A wrong norm, rotation or adapter is off by 1e-2 or more.
LLAMA_TOL = 2e-4


def llama_logits(path, toks, adapter=None):
    """llama.cpp's logits of every position of `toks`, optionally with an adapter manifest."""
    from aner import llm
    with llm.load(path, context=max(64, len(toks))) as base:
        if adapter is None:
            return base.logits(toks)
        with base.with_adapter(adapter) as m:
            return m.logits(toks)

"""Import of floating Llama GGUF files: admission, every refusal, identity, the real SmolLM2."""
import hashlib

import numpy as np
import pytest
from gguf import GGUFValueType

from aner import AnerError, gen
from aner.errors import ConfigError, FormatError, ResourceError, UnsupportedModelError
from aner.formats.gguf import Field, read_gguf
from fixtures import Shape, rewrite

U32 = GGUFValueType.UINT32


@pytest.mark.parametrize("dtype", ["f32", "f16", "bf16"])
@pytest.mark.parametrize("tied", [True, False])
def test_tiny_import_reports_shape_and_identity(tiny_factory, dtype, tied):
    path = tiny_factory(Shape(tied=tied), dtype)
    m = gen.import_model(path)
    c = m.config()
    assert (c.n_layer, c.dim, c.n_head, c.n_kv_head, c.tied_embeddings) == (2, 64, 4, 2, tied)
    names = m.parameter_names()
    assert len(names) == 2 * 9 + 2 + (0 if tied else 1)
    assert ("output.weight" in names) is (not tied)
    assert m.storage() == "float32" and m.method() == "full" and m.device() == "cpu"
    assert m.source_sha256() == hashlib.sha256(path.read_bytes()).hexdigest()
    mem = m.memory_summary()
    assert mem.weight_bytes == mem.floating_base_bytes == 4 * m.parameters() == mem.trainable_bytes
    assert mem.packed_base_bytes == mem.optimizer_bytes == 0
    assert "float32" in str(mem)
    logits = m.logits([1, 2, 3, 4])
    assert logits.shape == (4, c.vocab_size) and logits.dtype == np.float32 and np.isfinite(logits).all()


def test_weights_are_exact_fp32_widening(tiny_factory):
    """F16 and BF16 values widen to FP32 exactly: the imported weights equal the stored values."""
    for dtype in ("f16", "bf16"):
        path = tiny_factory(Shape(), dtype)
        m = gen.import_model(path)
        g = read_gguf(path)
        w = m._weights["blk.1.ffn_up.weight"].numpy()
        raw = g.tensors["blk.1.ffn_up.weight"].raw
        if dtype == "f16":
            assert np.array_equal(w, raw.astype(np.float32))
        else:
            assert np.array_equal(w.view(np.uint32) >> 16, raw.view(np.uint16).reshape(w.shape).astype(np.uint32))
            assert not (w.view(np.uint32) & 0xFFFF).any()


def test_canonical_identity_ignores_file_encoding(tiny_factory, tmp_path):
    """The same FP32 values in an F16 file and its F32 conversion: same canonical hash, other file hash."""
    f16 = tiny_factory(Shape(), "f16")
    f32 = gen.dequantize_model(f16, tmp_path / "same.gguf", dtype="f32")
    a, b = gen.import_model(f16), gen.import_model(f32)
    assert a._source.canonical_sha256 == b._source.canonical_sha256
    assert a.source_sha256() != b.source_sha256()
    assert a._source.tokenizer_sha256 == b._source.tokenizer_sha256
    other = gen.import_model(tiny_factory(Shape(), "f16", seed=1))
    assert other._source.canonical_sha256 != a._source.canonical_sha256


def test_dequantize_is_deterministic_and_recorded(smollm2, tmp_path):
    q4 = smollm2.parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
    a = gen.dequantize_model(q4, tmp_path / "a.gguf", dtype="f16")
    b = gen.dequantize_model(q4, tmp_path / "b.gguf", dtype="f16")
    assert a.read_bytes() == b.read_bytes() == smollm2.read_bytes()
    g = read_gguf(a)
    assert g.get("aner.conversion") == "dequantize;dtype=f16"
    assert g.get("aner.conversion.source_sha256") == hashlib.sha256(q4.read_bytes()).hexdigest()
    assert g.get("general.file_type") == 1
    assert g.get("tokenizer.chat_template") == read_gguf(q4).get("tokenizer.chat_template")
    before = a.read_bytes()
    with pytest.raises(AnerError, match="already exists"):
        gen.dequantize_model(q4, a, dtype="f32")
    assert a.read_bytes() == before
    with pytest.raises(UnsupportedModelError, match="'f32', 'f16'"):
        gen.dequantize_model(q4, tmp_path / "c.gguf", dtype="q8")
    assert not (tmp_path / "c.gguf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf"]  # nothing half-written


def test_real_smollm2(smollm2):
    m = gen.import_model(smollm2)
    c = m.config()
    assert (c.n_layer, c.dim, c.n_head, c.n_kv_head, c.vocab_size, c.tied_embeddings) == (30, 576, 9, 3, 49152, True)
    assert len(m.parameter_names()) == 272
    assert m.parameters() == 134_515_008
    mem = m.memory_summary()
    assert mem.weight_bytes == 538_060_032 == mem.floating_base_bytes
    s = m.summary()
    assert "parameters=134515008" in s and "method=full" in s and "storage=float32" in s
    assert f"source_sha256={m.source_sha256()}" in s


def test_backend_identity():
    assert gen.training_available() is True
    b = gen.training_backend()
    assert b.startswith("aner.llama-trainer/1;torch=") and ";fp32;threads=" in b and ";build=" in b


# ---- refusals --------------------------------------------------------------------------------

def _field(key, value, t=U32):
    return {key: Field(key, value, t)}


REFUSALS = [
    ("architecture", dict(fields=_field("general.architecture", "qwen2", GGUFValueType.STRING)),
     "architecture='qwen2'"),
    ("missing key", dict(drop=("llama.block_count",)), "llama.block_count"),
    ("kv divisibility", dict(fields=_field("llama.attention.head_count_kv", 3)), "not divisible by head_count_kv=3"),
    ("rope scaling", dict(fields=_field("llama.rope.scaling.type", "yarn", GGUFValueType.STRING)),
     "scaling.type='yarn'"),
    ("partial rope", dict(fields=_field("llama.rope.dimension_count", 8)), "dimension_count=8"),
    ("unknown tensor", dict(tensors={"rope_freqs.weight": np.ones(8, np.float32)}), "'rope_freqs.weight'"),
    ("missing tensor", dict(tensors=lambda n, a: None if n == "blk.1.ffn_up.weight" else a),
     "'blk.1.ffn_up.weight' is missing"),
    ("shape", dict(tensors=lambda n, a: a[:-1] if n == "blk.0.attn_k.weight" else a),
     "'blk.0.attn_k.weight' has shape (31, 64)"),
    ("non-finite", dict(tensors=lambda n, a: np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a)
                        .astype(a.dtype) if n == "blk.0.attn_q.weight" else a), "non-finite"),
]


@pytest.mark.parametrize("case,edit,message", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_import_refusals(tiny, tmp_path, case, edit, message):
    bad = rewrite(tiny, tmp_path / "bad.gguf", **edit)
    with pytest.raises(UnsupportedModelError) as e:
        gen.import_model(bad)
    assert message in str(e.value)


def test_refusal_count():
    assert len(REFUSALS) == 9


def test_quantized_tensors_point_to_dequantize(smollm2):
    with pytest.raises(UnsupportedModelError, match=r"stored as Q8_0.*gen\.dequantize_model"):
        gen.import_model(smollm2.parent / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("budget", [0, (1 << 20) - 1, (64 << 30) + 1, 2.5e9, True, "4GiB"])
def test_budget_range(tiny, budget):
    with pytest.raises(ConfigError, match="max_memory_bytes=.*1 MiB.*64 GiB"):
        gen.import_model(tiny, max_memory_bytes=budget)


def test_admission_over_budget(smollm2):
    with pytest.raises(ResourceError, match="importing this model.*max_memory_bytes=268435456"):
        gen.import_model(smollm2, max_memory_bytes=256 << 20)


@pytest.mark.parametrize("device", ["gpu", "cuda", "cuda:x", "mps", None])
def test_unsupported_device(tiny, device):
    with pytest.raises(ConfigError, match="device=.*'cpu' or 'cuda:N'"):
        gen.import_model(tiny, device=device)


def test_cuda_without_cuda_is_refused(tiny):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(AnerError, match="cuda:0"):
        gen.import_model(tiny, device="cuda:0")


def test_truncated_and_foreign_files(tiny, tmp_path):
    data = tiny.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(FormatError, match="truncated or not GGUF"):
        gen.import_model(cut)
    text = tmp_path / "notes.gguf"
    text.write_text("question,answer\n")
    with pytest.raises(FormatError):
        gen.import_model(text)
    with pytest.raises(FormatError, match="does not exist"):
        gen.import_model(tmp_path / "absent.gguf")

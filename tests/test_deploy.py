"""Deployment: our logits against llama.cpp, merged and adapter exports, q4_0, the adapter binding."""
import json

import numpy as np
import pytest

from aner import AnerError, gen, llm
from aner.errors import ArtifactError, ConfigError
from aner.formats.gguf import read_gguf
from conftest import EXAMPLES
from fixtures import LLAMA_TOL as TOL, Shape, llama_logits, tokens


@pytest.mark.parametrize("shape,dtype", [(Shape(), "f32"), (Shape(tied=False, n_kv_head=4), "f16"),
                                         (Shape(n_kv_head=1), "bf16")])
def test_tiny_logits_match_llama_cpp(tiny_factory, tmp_path, shape, dtype):
    """F16/BF16 widen exactly to FP32 here; llama.cpp is run on the F32 file of the same values
    (on F16 weights its CPU matmul rounds activations to F16, a ~1e-3 effect of its own)."""
    path = tiny_factory(shape, dtype)
    m = gen.import_model(path)
    f32 = path if dtype == "f32" else gen.dequantize_model(path, tmp_path / "same-f32.gguf", dtype="f32")
    toks = tokens(32, m.config().vocab_size, seed=1)
    ours, ref = m.logits(toks), llama_logits(f32, toks)
    assert ours.shape == ref.shape == (32, 49152)
    assert np.abs(ours - ref).max() <= TOL


def test_smollm2_logits_match_llama_cpp(smollm2_f32):
    """The seed's measurement: 32 tokens x 49,152 logits, llama.cpp FP32 KV cache, no flash attention."""
    m = gen.import_model(smollm2_f32)
    toks = tokens(32, 49152, seed=2)
    err = np.abs(m.logits(toks) - llama_logits(smollm2_f32, toks)).max()
    assert err <= TOL, err


@pytest.fixture(scope="module")
def trained(tiny_factory):
    path = tiny_factory(Shape(tied=False), "f32")
    base = gen.import_model(path)
    tr = gen.supervised_csv(base, EXAMPLES / "data" / "training.csv", role="training", context=64)
    va = gen.supervised_csv(base, EXAMPLES / "data" / "validation.csv", role="validation", context=64)
    return path, base, tr, va


@pytest.mark.parametrize("method", ["full", "lora", "rslora"])
def test_merged_export_matches_trained_model(trained, tmp_path, method):
    path, base, tr, va = trained
    select = {"full": lambda b: b, "lora": lambda b: b.lora(rank=4, alpha=8.0, seed=1),
              "rslora": lambda b: b.rs_lora(rank=4, alpha=8.0, seed=1)}[method]
    tuned = select(base).fine_tune(tr, va, steps=2, rate=5e-3, seed=1)
    out = tuned.save_model(tmp_path / "merged.gguf")
    toks = tokens(32, 49152, seed=3)
    ours = tuned.logits(toks)
    assert np.abs(ours - base.logits(toks)).max() > 1e-3  # training changed the outputs
    assert np.abs(ours - llama_logits(out, toks)).max() <= TOL
    g = read_gguf(out)
    assert g.get("aner.method") == method and g.get("aner.updates") == 2
    assert g.get("aner.base.source_sha256") == base.source_sha256()
    assert g.get("general.file_type") == 0 and all(t.type.name == "F32" for t in g.tensors.values()
                                                   if len(t.shape) == 2)
    if method != "full":
        manifest = tuned.save_adapter(tmp_path / "adapter")
        assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter.gguf", "adapter.json",
                                                                            "training.json"]
        a = read_gguf(manifest.adapter_path)
        assert a.get("general.type") == "adapter" and a.get("adapter.type") == "lora"
        assert a.get("adapter.lora.alpha") == pytest.approx(tuned._method.config.scale * 4)
        assert a.tensors["blk.0.attn_q.weight.lora_a"].shape == (4, 64)
        assert a.tensors["blk.0.attn_q.weight.lora_b"].shape == (64, 4)
        with_adapter = llama_logits(path, toks, manifest)
        assert np.abs(with_adapter - llama_logits(out, toks)).max() <= TOL
        assert np.abs(with_adapter - ours).max() <= TOL


def test_full_fine_tune_has_no_adapter(trained, tmp_path):
    path, base, tr, va = trained
    tuned = base.fine_tune(tr, va, steps=1, rate=1e-5)
    with pytest.raises(ConfigError, match="no adapter.*save_model"):
        tuned.save_adapter(tmp_path / "a")
    assert not (tmp_path / "a").exists()


def test_adapter_is_bound_to_its_exact_base(trained, tiny_factory, tmp_path):
    path, base, tr, va = trained
    manifest = base.lora(rank=2).fine_tune(tr, va, steps=1).save_adapter(tmp_path / "ad")
    data = json.loads((tmp_path / "ad" / "adapter.json").read_text())
    assert data["base"]["sha256"] == base.source_sha256() == manifest.base_sha256
    assert data["base"]["canonical_sha256"] == base._source.canonical_sha256
    assert data["method"] == "lora" and data["rank"] == 2 and len(data["targets"]) == 4
    other = tiny_factory(Shape(tied=False), "f32", seed=7)
    with llm.load(other, context=64) as wrong:
        with pytest.raises(ArtifactError, match="SHA-256"):
            wrong.with_adapter(manifest)
    with pytest.raises(ArtifactError, match="already exists"):
        base.lora(rank=2).fine_tune(tr, va, steps=1).save_adapter(tmp_path / "ad")


def test_quantize_q4_0_loads_in_llama_cpp(trained, tmp_path):
    path, base, tr, va = trained
    merged = base.lora().fine_tune(tr, va, steps=1).save_model(tmp_path / "m.gguf")
    q = gen.quantize_model(merged, tmp_path / "m-q4.gguf", format="q4_0")
    types = {t.type.name for t in read_gguf(q).tensors.values()}
    assert "Q4_0" in types
    with llm.load(q, context=64) as m:
        out = m.logits(tokens(8, 49152))
    assert out.shape == (8, 49152) and np.isfinite(out).all()
    with pytest.raises(ConfigError, match="q4_0"):
        gen.quantize_model(merged, tmp_path / "x.gguf", format="q3_weird")
    with pytest.raises(AnerError, match="already exists"):
        gen.quantize_model(merged, q, format="q4_0")
    assert not (tmp_path / "x.gguf").exists()

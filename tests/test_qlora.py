"""Packed NF4 bases and QLoRA: storage and byte counts, streamed import, refusals, QLoRA = LoRA on
the decoded base, exact resume of packed checkpoints, merged export and the standalone package.

Tiny random Llamas throughout; the real SmolLM2 only for the seed's byte counts, the streamed
import budget and one llama.cpp parity check of its packed forward.
"""
import json
import os
import weakref

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from aner import gen, llm
from aner.errors import ArtifactError, ConfigError, FormatError, ResourceError, UnsupportedModelError
from aner.formats import export
from aner.formats.checkpoint import _digest
from aner.formats.gguf import Tensor, read_gguf
from aner.formats.publish import sha256_file
from aner.model.llama import Dense
from aner.quant.module import NF4Module
from aner.quant.nf4 import NF4Weight
from aner.quant.storage import PACK_CHUNK, pack_matrix, packed_nbytes
from fixtures import LLAMA_TOL as TOL, Shape, llama_logits, tokens

MiB = 1 << 20

# The seed's SmolLM2-135M measurement: owned NF4 base (double quantization, norm vectors in FP32).
SMOL_FP32_BYTES = 538_060_032
SMOL_PACKED = 69_375_100
SMOL_FLOATING = 140_544
SMOL_NF4_BYTES = 69_515_644






def same_packed(a: NF4Weight, b: NF4Weight) -> bool:
    ta, tb = a.tensors(), b.tensors()
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def same_weights(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if not (torch.equal(x, y) if isinstance(x, torch.Tensor) else same_packed(x, y)):
            return False
    return True


def decoded(model):
    """The same handle with every packed matrix replaced by its dequantized FP32 values."""
    dense = {n: w if isinstance(w, torch.Tensor) else w.dequantize() for n, w in model._weights.items()}
    return model._derive(weights=dense, storage="float32")


def expected_bytes(config_shapes, double_quant):
    """Owned bytes of a packed model, counted here from the format (not from packed_nbytes)."""
    packed = floating = 0
    for shape in config_shapes:
        if len(shape) == 1:
            floating += 4 * shape[0]
            continue
        n = shape[0] * shape[1]
        blocks = -(-n // 64)
        packed += (n + 1) // 2 + (blocks + 4 * -(-blocks // 256) + 4 if double_quant else 4 * blocks)
    return packed, floating


@pytest.fixture(scope="module")
def untied(tiny_factory):
    return tiny_factory(Shape(tied=False), "f32")


# ---- storage ---------------------------------------------------------------------------------

@pytest.mark.parametrize("double_quant", [True, False])
def test_chunked_packing_equals_whole_matrix_quantization(double_quant):
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    cases = 0
    for shape in [(1823, 781), (7, 9), (3, 1), (300, 257), (64, 64)]:
        w = torch.randn(shape, generator=g) * 10 ** (torch.rand(shape[0], 1, generator=g) * 4 - 2)
        w.view(-1)[:64] = 0.0                               # an all-zero block
        whole = NF4Weight.quantize(w, double_quant=double_quant)
        # block-sized, odd multiples, partial tails; at most ~2000 chunks per matrix (time)
        for chunk in [c for c in (64, 192, 4096, 65536, PACK_CHUNK) if w.numel() // c <= 2000]:
            assert same_packed(pack_matrix(w, double_quant, chunk), whole), (seed, shape, chunk)
            cases += 1
        assert packed_nbytes(shape, double_quant) == whole.nbytes()
    assert cases == 3 + 5 + 5 + 5 + 5


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("double_quant", [True, False])
def test_tiny_storage_and_byte_counts(tiny_factory, tied, double_quant):
    m = gen.import_nf4(tiny_factory(Shape(tied=tied), "f32"), double_quant=double_quant)
    assert m.storage() == ("nf4_double_quant" if double_quant else "nf4") and m.method() == "full"
    shapes = list(m._shapes().values())
    assert len(shapes) == 2 * 9 + 2 + (0 if tied else 1)
    packed, floating = expected_bytes(shapes, double_quant)
    mem = m.memory_summary()
    assert (mem.packed_base_bytes, mem.floating_base_bytes) == (packed, floating)
    assert mem.weight_bytes == packed + floating == sum(
        w.nbytes() if isinstance(w, NF4Weight) else 4 * w.numel() for w in m._weights.values())
    assert mem.dequant_tile_bytes == 4 * MiB and mem.trainable_bytes == 0 and m.trainable_parameters() == 0
    assert all(isinstance(w, NF4Weight) == (len(s) == 2) for w, s in zip(m._weights.values(), shapes))
    assert all(w.dtype == torch.float32 for w in m._weights.values() if isinstance(w, torch.Tensor))
    assert f"storage={m.storage()}" in m.summary()


@pytest.fixture(scope="module")
def smol_nf4(smollm2):
    """Streamed import under a budget that the FP32 model alone (538 MB) would exceed; it also
    admits a decoded export (owned bytes + three FP32 copies of the largest matrix: 390 MiB)."""
    return gen.import_nf4(smollm2, max_memory_bytes=400 * MiB)


def test_smollm2_byte_counts_and_streaming_budget(smollm2, smol_nf4):
    mem = smol_nf4.memory_summary()
    assert 4 * smol_nf4.parameters() == SMOL_FP32_BYTES > smol_nf4.memory_summary().estimated_budget_bytes
    assert mem.packed_base_bytes == SMOL_PACKED
    assert mem.floating_base_bytes == SMOL_FLOATING
    assert mem.weight_bytes == SMOL_NF4_BYTES
    assert mem.dequant_tile_bytes == 4_194_304 and mem.storage == "nf4_double_quant"
    assert round(100 * (1 - mem.weight_bytes / SMOL_FP32_BYTES), 2) == 87.08
    # Admission is packed bytes + one FP32 matrix (the 49152 x 576 embedding) + packing workspace:
    # about 180 MiB. Below it the import is refused before any tensor is read; the FP32 import
    # does not fit the budget the packed import just used.
    with pytest.raises(ResourceError, match=r"importing this model as NF4 .* needs an estimated 189053308 bytes"):
        gen.import_nf4(smollm2, max_memory_bytes=150 * MiB)
    with pytest.raises(ResourceError, match="importing this model"):
        gen.import_model(smollm2, max_memory_bytes=400 * MiB)


def test_smollm2_packed_forward_matches_llama_cpp_on_the_decoded_base(smol_nf4, tmp_path):
    out = smol_nf4.save_model(tmp_path / "smol-decoded.gguf")
    toks = tokens(16, seed=4)
    err = np.abs(smol_nf4.logits(toks) - llama_logits(out, toks)).max()
    assert err <= TOL, err
    g = read_gguf(out)
    assert g.get("aner.storage") == "nf4_double_quant" and g.get("aner.method") == "full"
    assert np.array_equal(g.tensors["blk.7.ffn_up.weight"].float32(),
                          smol_nf4._weights["blk.7.ffn_up.weight"].dequantize().numpy())


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("double_quant", [True, False])
def test_import_nf4_equals_nf4_conversion(tiny_factory, dtype, double_quant):
    path = tiny_factory(Shape(), dtype)
    floating = gen.import_model(path)
    before = {n: w.clone() for n, w in floating._weights.items()}
    converted = floating.nf4(double_quant=double_quant)
    imported = gen.import_nf4(path, double_quant=double_quant)
    assert imported._source == converted._source == floating._source
    assert imported.storage() == converted.storage() == ("nf4_double_quant" if double_quant else "nf4")
    assert same_weights(imported._weights, converted._weights)
    assert sum(isinstance(w, NF4Weight) for w in imported._weights.values()) == 2 * 7 + 1
    # the caller's floating handle keeps its own FP32 weights, bitwise
    assert floating.storage() == "float32" and same_weights(floating._weights, before)
    assert floating.memory_summary().weight_bytes == 4 * floating.parameters()


def test_import_reads_one_matrix_at_a_time(tiny, monkeypatch):
    """Every source matrix's FP32 values are dropped before the next tensor is read."""
    original = Tensor.float32
    seen, alive_at_read = [], []

    def tracked(self):
        alive_at_read.append(sum(r() is not None for r in seen))
        values = original(self)
        if values.ndim == 2:
            seen.append(weakref.ref(values))
        return values

    monkeypatch.setattr(Tensor, "float32", tracked)
    gen.import_nf4(tiny)
    assert len(alive_at_read) == 2 * 9 + 2 and len(seen) == 2 * 7 + 1
    assert max(alive_at_read) == 0, alive_at_read
    # the same probe sees the FP32 import keep every matrix (so it can tell the difference)
    seen.clear(), alive_at_read.clear()
    gen.import_model(tiny)
    assert max(alive_at_read) == 2 * 7 + 1       # all 15 matrices when output_norm is read


# ---- refusals --------------------------------------------------------------------------------

def test_refusals(tiny, data, smollm2, monkeypatch):
    tr, va = data
    floating = gen.import_model(tiny)
    packed = gen.import_nf4(tiny)
    with pytest.raises(ConfigError, match="full fine-tuning of a nf4_double_quant base is refused.*select an adapter"):
        packed.fine_tune(tr, va, steps=1)
    packed_plain = gen.import_nf4(tiny, double_quant=False)
    with pytest.raises(ConfigError, match="full fine-tuning of a nf4 base is refused"):
        packed_plain.fine_tune(tr, va, steps=1)
    with pytest.raises(ConfigError, match="nf4 conversion is refused: this model already has a lora adapter"):
        floating.lora().nf4()
    with pytest.raises(ConfigError, match="nf4 conversion is refused: this model's full weights were trained"):
        floating.fine_tune(tr, va, steps=1, rate=1e-5).nf4()
    with pytest.raises(ConfigError, match="already nf4_double_quant"):
        packed.nf4()
    with pytest.raises(ConfigError, match="qlora selection is refused: this model already has a lora adapter"):
        packed.lora().qlora()
    for bad in ("yes", 1, None, 0.0):
        with pytest.raises(ConfigError, match=f"double_quant={bad!r} must be True or False"):
            floating.nf4(double_quant=bad)
        with pytest.raises(ConfigError, match="double_quant="):
            gen.import_nf4(tiny, double_quant=bad)
    with pytest.raises(ConfigError, match="max_memory_bytes"):
        gen.import_nf4(tiny, max_memory_bytes=2.5e9)
    with pytest.raises(ConfigError, match="device="):
        gen.import_nf4(tiny, device="tpu")
    with pytest.raises(UnsupportedModelError, match=r"stored as Q8_0.*gen\.dequantize_model"):
        gen.import_nf4(smollm2.parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    # qlora validates its arguments before it packs anything
    import aner.quant.storage as storage
    monkeypatch.setattr(storage, "pack_weights", lambda *a: pytest.fail("packed before validating"))
    with pytest.raises(ConfigError, match="rank=0"):
        floating.qlora(rank=0)


# ---- compute ---------------------------------------------------------------------------------

def test_packed_modules_and_selected_row_lookup(untied):
    packed = gen.import_nf4(untied)
    model = packed.qlora(targets=["attention.q_proj", "mlp.down_proj"], rank=4).module()
    assert not any(isinstance(m, Dense) for m in model.modules())      # no dense copy of any matrix
    assert isinstance(model.tok_embd, NF4Module) and isinstance(model.output, NF4Module)
    assert isinstance(model.layers[0].attn_q.base, NF4Module) and isinstance(model.layers[1].ffn_up, NF4Module)
    assert all(p.numel() < 64 * 64 for p in model.parameters())        # nothing registered as a parameter
    ids = torch.tensor([[0, 49151, 7, 7], [123, 4096, 1, 0]])
    rows = model.tok_embd.lookup(ids)
    assert rows.shape == (2, 4, 64) and torch.equal(rows, packed._weights["token_embd.weight"].dequantize()[ids])
    # projection: FP32 out and an FP32 input gradient through the frozen weight, as the dense matrix gives
    w = packed._weights["blk.0.ffn_down.weight"]
    x = torch.randn(3, 5, 96, requires_grad=True)
    xd = x.detach().clone().requires_grad_(True)
    y = NF4Module(w)(x)
    yd = torch.nn.functional.linear(xd, w.dequantize())
    torch.testing.assert_close(y, yd, rtol=0, atol=1e-5)
    g = torch.randn_like(y)
    y.backward(g), yd.backward(g)
    assert x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, xd.grad, rtol=0, atol=1e-5)


@pytest.mark.parametrize("select", ["lora", "rs_lora", "lora_fa"])
def test_qlora_equals_lora_on_the_dequantized_base(untied, data, select):
    """Same seed, data and updates: the adapters agree within 1e-6 (relative L2 over all adapter
    parameters). Measured: <= 3.4e-7 after 3 updates; the forward is bitwise equal, and the
    difference comes from nf4_linear summing the head's input gradient over row tiles in another
    order than the dense GEMM (about 1e-7 of the gradient), which AdamW carries forward."""
    tr, va = data
    packed = gen.import_nf4(untied)
    kw = dict(targets=["attention.q_proj", "attention.v_proj", "mlp.down_proj"], rank=4, seed=1)
    run = dict(steps=3, rate=1e-3, seed=2, micro_batch=2)
    q = getattr(packed, select)(**kw).fine_tune(tr, va, **run)
    d = getattr(decoded(packed), select)(**kw).fine_tune(tr, va, **run)
    toks = tokens(24, seed=5)
    assert np.abs(packed.logits(toks) - decoded(packed).logits(toks)).max() <= 1e-5

    def rel(a, b):
        num = sum(float((a._adapter_tensors[k] - t).double().pow(2).sum()) for k, t in b._adapter_tensors.items())
        return (num / sum(float(t.double().pow(2).sum()) for t in b._adapter_tensors.values())) ** 0.5

    assert q._adapter_tensors.keys() == d._adapter_tensors.keys()
    assert rel(q, d) <= 1e-6, rel(q, d)
    assert q._state.losses == pytest.approx(d._state.losses, rel=1e-6)
    assert q.validation_loss() == pytest.approx(d.validation_loss(), rel=1e-6)
    assert any(t.abs().max() > 0 for k, t in q._adapter_tensors.items() if k.endswith("lora_b"))
    # ... while LoRA on the original FP32 base differs: the bound can see quantization
    f = getattr(gen.import_model(untied), select)(**kw).fine_tune(tr, va, **run)
    assert rel(q, f) > 1e-4
    # the frozen packed base is shared by the trained handle, bitwise unchanged
    assert all(q._weights[n] is packed._weights[n] for n in packed._weights)


def test_tinylora_on_a_packed_base_uses_the_decoded_matrices(tiny):
    packed = gen.import_nf4(tiny)
    a = packed.tinylora(rank=2, parameters=4, seed=3)._adapter_tensors
    b = decoded(packed).tinylora(rank=2, parameters=4, seed=3)._adapter_tensors
    assert a.keys() == b.keys() and len(a) == 4 * 4 + 1
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_qlora_selection_and_scale_format(tiny):
    floating = gen.import_model(tiny)
    q = floating.qlora()
    assert (q.storage(), q.method()) == ("nf4_double_quant", "lora")
    cfg = q._method.config
    assert (cfg.rank, cfg.alpha, cfg.seed) == (8, 16.0, 0) and len(cfg.targets) == 4
    assert floating.storage() == "float32" and all(isinstance(w, torch.Tensor) for w in floating._weights.values())
    assert gen.import_nf4(tiny, double_quant=False).qlora().storage() == "nf4"
    assert same_weights(q._weights, gen.import_nf4(tiny).qlora()._weights)
    assert q.memory_summary().trainable_bytes == 4 * q.trainable_parameters() > 0


# ---- checkpoints -----------------------------------------------------------------------------

SELECTIONS = {
    "lora": lambda b: b.lora(rank=2, seed=5),
    "rslora": lambda b: b.rs_lora(rank=2, seed=5),
    "lora_fa": lambda b: b.lora_fa(rank=2, seed=5),
    "tinylora": lambda b: b.tinylora(rank=2, parameters=4, seed=5),
}


@pytest.mark.parametrize("double_quant,method", [(True, "lora"), (True, "rslora"), (True, "lora_fa"),
                                                 (True, "tinylora"), (False, "lora")])
def test_exact_resume_of_a_packed_base(tiny, data, tmp_path, double_quant, method):
    tr, va = data
    src = SELECTIONS[method](gen.import_nf4(tiny, double_quant=double_quant))
    kw = dict(micro_batch=2, accumulation=2, rate=1e-3, seed=9)
    two = src.fine_tune(tr, va, steps=2, **kw)
    one = src.fine_tune(tr, va, steps=1, **kw)
    one.checkpoint(tmp_path / "ck")
    stored = load_file(str(tmp_path / "ck" / "weights.safetensors"))
    assert "blk.0.attn_q.weight.codes" in stored and "blk.0.attn_q.weight" not in stored
    assert ("blk.0.attn_q.weight.absmax_codes" in stored) is double_quant
    assert all(t.dim() < 2 for t in stored.values() if t.dtype == torch.float32)   # no floating matrix
    restored = gen.load_pretrained_checkpoint(tmp_path / "ck")
    assert restored.summary() == one.summary() and restored.storage() == src.storage()
    assert same_weights(restored._weights, src._weights)
    resumed = restored.resume(tr, va, steps=1)
    assert same_weights(resumed._weights, two._weights)
    assert resumed._adapter_tensors.keys() == two._adapter_tensors.keys()
    assert all(torch.equal(resumed._adapter_tensors[k], two._adapter_tensors[k]) for k in two._adapter_tensors)
    assert resumed._state.moments.keys() == two._state.moments.keys() and two._state.moments
    for k, (m, v) in two._state.moments.items():
        assert torch.equal(m, resumed._state.moments[k][0]) and torch.equal(v, resumed._state.moments[k][1]), k
    assert (resumed.updates(), resumed._state.losses, resumed.validation_loss()) == \
        (two.updates(), two._state.losses, two.validation_loss())
    trainable = set(two._trainable_names())
    assert any(not torch.equal(two._adapter_tensors[k], src._adapter_tensors[k]) for k in trainable)


def _resign(path, weights=None, manifest_edit=None):
    if weights is not None:
        save_file(weights, str(path / "weights.safetensors"))
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["weights.safetensors"] = sha256_file(path / "weights.safetensors")
    if manifest_edit:
        manifest_edit(m)
    m["manifest_sha256"] = _digest(m)
    (path / "manifest.json").write_text(json.dumps(m))


def test_checkpoint_refuses_malformed_packed_buffers(tiny, data, tmp_path):
    import shutil
    tr, va = data
    ck = tmp_path / "ck"
    gen.import_nf4(tiny).lora(rank=2).fine_tune(tr, va, steps=1).checkpoint(ck)

    def variant(name):
        shutil.copytree(ck, tmp_path / name)
        return tmp_path / name, load_file(str(tmp_path / name / "weights.safetensors"))

    p, w = variant("short")
    w["blk.1.ffn_up.weight.codes"] = w["blk.1.ffn_up.weight.codes"][:-1].clone()
    _resign(p, w)
    with pytest.raises(FormatError, match="'blk.1.ffn_up.weight': malformed NF4 tensors: codes"):
        gen.load_pretrained_checkpoint(p)
    p, w = variant("version")
    w["blk.0.attn_k.weight.nf4_version"] = torch.tensor(2)
    _resign(p, w)
    with pytest.raises(FormatError, match="NF4 tensor format version \\[?2\\]? is not 1"):
        gen.load_pretrained_checkpoint(p)
    p, _ = variant("storage")
    _resign(p, manifest_edit=lambda m: m.update(storage="nf4"))
    with pytest.raises(FormatError, match="double_quant=True, but the checkpoint's storage is 'nf4'"):
        gen.load_pretrained_checkpoint(p)
    p, w = variant("dense")
    w["blk.0.ffn_gate.weight"] = torch.zeros(96, 64)
    for part in ("nf4_version", "shape", "codes", "absmax_codes", "absmax_scales", "absmax_offset"):
        del w[f"blk.0.ffn_gate.weight.{part}"]
    _resign(p, w)
    with pytest.raises(FormatError, match="only FP32 norm vectors stay floating"):
        gen.load_pretrained_checkpoint(p)
    p, _ = variant("unknown")
    _resign(p, manifest_edit=lambda m: m.update(storage="nf3"))
    with pytest.raises(FormatError, match="storage 'nf3' is not supported"):
        gen.load_pretrained_checkpoint(p)


# ---- deployment ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tuned(untied, data):
    tr, va = data
    packed = gen.import_nf4(untied)
    return packed, packed.qlora(rank=4, alpha=8.0, seed=1).fine_tune(tr, va, steps=2, rate=5e-3, seed=1)


def test_merged_export_decodes_the_packed_base(tuned, tmp_path):
    packed, model = tuned
    out = model.save_model(tmp_path / "merged.gguf")
    toks = tokens(32, seed=3)
    ours = model.logits(toks)
    assert np.abs(ours - packed.logits(toks)).max() > 1e-3            # training changed the outputs
    assert np.abs(ours - llama_logits(out, toks)).max() <= TOL
    g = read_gguf(out)
    assert g.get("aner.storage") == "nf4_double_quant" and g.get("aner.method") == "lora"
    assert g.get("aner.base.source_sha256") == packed.source_sha256() and g.get("general.file_type") == 0
    assert all(t.type.name == "F32" for t in g.tensors.values())
    for name in ("blk.0.ffn_up.weight", "output.weight", "token_embd.weight"):     # not adapter targets
        assert np.array_equal(g.tensors[name].float32(), packed._weights[name].dequantize().numpy()), name


def test_standalone_adapter_package(tuned, untied, data, tmp_path, monkeypatch):
    packed, model = tuned
    pkg = tmp_path / "pkg"
    manifest = model.save_adapter(pkg)
    files = sorted(str(p.relative_to(pkg)) for p in pkg.rglob("*") if p.is_file())
    assert files == ["adapter/adapter.gguf", "adapter/adapter.json", "adapter/training.json", "base.gguf",
                     "deployment.json"]
    deployment = json.loads((pkg / "deployment.json").read_text())
    assert (deployment["format"], deployment["version"], deployment["storage"]) == \
        ("aner.deployment", 1, "nf4_double_quant")
    assert deployment["files"] == {f: sha256_file(pkg / f) for f in files if f != "deployment.json"}
    assert all((pkg / "deployment.json").stat().st_mtime_ns >= (pkg / f).stat().st_mtime_ns for f in files)
    # the manifest points at the package's adapter and binds it to base.gguf, not to the source
    assert manifest.adapter_path == str(pkg / "adapter" / "adapter.gguf")
    assert manifest.base_sha256 == sha256_file(pkg / "base.gguf") != packed.source_sha256()
    adapter_json = json.loads((pkg / "adapter" / "adapter.json").read_text())
    assert adapter_json["base"]["source_sha256"] == packed.source_sha256()
    # base.gguf is exactly the decoded frozen training base, with the source's metadata
    base = gen.import_model(pkg / "base.gguf")
    assert manifest.base_canonical_sha256 == base._source.canonical_sha256 == adapter_json["base"]["canonical_sha256"]
    assert all(torch.equal(base._weights[n], w if isinstance(w, torch.Tensor) else w.dequantize())
               for n, w in packed._weights.items())
    assert base._source.tokenizer_sha256 == packed._source.tokenizer_sha256
    assert read_gguf(pkg / "base.gguf").get("aner.base.source_sha256") == packed.source_sha256()
    # the original floating GGUF fails the identity check; the package's base agrees with the merge
    with llm.load(untied, context=64) as original:
        with pytest.raises(ArtifactError, match="SHA-256"):
            original.with_adapter(manifest)
    toks = tokens(32, seed=6)
    with_adapter = llama_logits(pkg / "base.gguf", toks, manifest)
    merged = llama_logits(model.save_model(tmp_path / "merged.gguf"), toks)
    assert np.abs(with_adapter - merged).max() <= TOL
    assert np.abs(with_adapter - model.logits(toks)).max() <= TOL
    # another adapter on the same packed base publishes the same base bytes
    tr, va = data
    other = packed.lora(rank=2, seed=7).fine_tune(tr, va, steps=1).save_adapter(tmp_path / "pkg2")
    assert other.base_sha256 == manifest.base_sha256
    # a failed publication leaves nothing behind
    monkeypatch.setattr(export, "write_adapter_gguf", lambda *a: (_ for _ in ()).throw(RuntimeError("disk full")))
    with pytest.raises(RuntimeError, match="disk full"):
        model.save_adapter(tmp_path / "pkg3")
    assert not (tmp_path / "pkg3").exists() and not list(tmp_path.glob(".pkg3*"))
    with pytest.raises(ArtifactError, match="already exists"):
        model.save_adapter(pkg)

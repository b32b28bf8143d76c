"""Training, exact resume and checkpoints on a tiny random Llama with real chat-formatted data."""
import json
import shutil
from decimal import Decimal, localcontext

import numpy as np
import pytest
import torch

from aner import AnerError, gen
from aner.errors import ArtifactError, ConfigError, DataError, FormatError, ResourceError
from aner.formats.checkpoint import _digest
from aner.model.config import LlamaConfig
from aner.model.llama import rope_tables
from aner.model.names import ALIASES
from aner.train.loop import TrainState, RunConfig, window
from fixtures import assert_same_state, rewrite, train_counting_saved


def snapshot(model):
    return ({k: v.clone() for k, v in model._weights.items()},
            {k: v.clone() for k, v in model._adapter_tensors.items()})




@pytest.mark.parametrize("select", ["full", "lora"])
def test_exact_resume_and_source_unchanged(base, data, tmp_path, select):
    tr, va = data
    src = base if select == "full" else base.lora(rank=4, seed=5)
    before = snapshot(src)
    kw = dict(micro_batch=2, accumulation=2, rate=1e-3, seed=9)
    two = src.fine_tune(tr, va, steps=2, **kw)
    one = src.fine_tune(tr, va, steps=1, **kw)
    one.checkpoint(tmp_path / "ck")
    restored = gen.load_pretrained_checkpoint(tmp_path / "ck")
    assert restored.summary() == one.summary()
    resumed = restored.resume(tr, va, steps=1)
    assert_same_state(two, resumed)
    assert two.updates() == 2
    # the source is bitwise unchanged and still usable; training really changed something
    after = snapshot(src)
    assert all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert all(torch.equal(before[1][k], after[1][k]) for k in before[1])
    assert src.updates() == 0
    changed = two._weights if select == "full" else two._adapter_tensors
    reference = before[0] if select == "full" else before[1]
    assert any(not torch.equal(changed[k], reference[k]) for k in reference)
    if select == "lora":
        assert all(two._weights[k] is src._weights[k] for k in src._weights)  # frozen base shared, not copied


def test_scored_tokens_and_windows(base, data):
    tr, va = data
    n = tr.examples()
    state = TrainState(RunConfig(micro_batch=2, accumulation=3, seed=4), "", "")
    seen, sizes = [], []
    from dataclasses import replace
    for _ in range(10):
        w = window(state, n)
        sizes.append(len(w))
        seen.extend(w)
        state = replace(state, cursor=state.cursor + len(w))
        if state.cursor % n == 0:
            break
    assert sorted(seen) == list(range(n))            # one epoch covers every example exactly once
    assert sizes == [6] * (n // 6) + ([n % 6] if n % 6 else [])  # a short final window, nothing duplicated
    tuned = base.lora().fine_tune(tr, va, steps=1, micro_batch=2, accumulation=3, seed=4)
    first = window(TrainState(RunConfig(2, 3, seed=4), "", ""), n)
    assert tuned.scored_tokens() == sum(tr.items[i].scored for i in first)


def test_loss_is_weighted_by_scored_tokens_across_the_window(base, data):
    """micro_batch 4 x accumulation 1 and micro_batch 1 x accumulation 4 make the same update."""
    tr, va = data
    a = base.lora(seed=1).fine_tune(tr, va, steps=1, micro_batch=4, accumulation=1, rate=1e-3, seed=2)
    b = base.lora(seed=1).fine_tune(tr, va, steps=1, micro_batch=1, accumulation=4, rate=1e-3, seed=2)
    assert a._state.losses[0] == pytest.approx(b._state.losses[0], rel=1e-6)
    for k in a._state.moments:
        torch.testing.assert_close(a._state.moments[k][0], b._state.moments[k][0], rtol=1e-4, atol=1e-9)
    assert a.scored_tokens() == b.scored_tokens()


def test_validation_loss_is_token_weighted(base, data):
    tr, va = data
    tuned = base.lora().fine_tune(tr, va, steps=1)
    total = 0.0
    for e in va.items:
        lp = torch.log_softmax(torch.from_numpy(tuned.logits(e.tokens[:-1])).double(), -1)
        total -= sum(float(lp[t - 1, e.tokens[t]]) for t in range(e.prompt_len, len(e.tokens)))
    assert tuned.validation_loss() == pytest.approx(total / va.scored_tokens(), rel=1e-5)
    assert tuned.evaluate(va) == tuned.validation_loss()
    assert base.evaluate(va) != tuned.evaluate(va)


def test_same_inputs_give_identical_bits(base, data):
    tr, va = data
    a = base.lora(seed=3).fine_tune(tr, va, steps=2, seed=8)
    b = base.lora(seed=3).fine_tune(tr, va, steps=2, seed=8)
    assert_same_state(a, b)


PI = Decimal("3.14159265358979323846264338327950288419716939937510582097494459230781640628620899863")


def cos_sin(x: float) -> tuple[float, float]:
    """cos and sin of the float x by 60-digit decimal arithmetic (Taylor series after taking out
    multiples of 2 pi), each rounded to the nearest float64."""
    with localcontext() as ctx:
        ctx.prec = 60
        r = Decimal(x) % (2 * PI)
        sums, term, n = [Decimal(0), Decimal(0)], Decimal(1), 0     # term = r^n / n!
        while abs(term) > Decimal(10) ** -55:
            sums[n % 2] += term * (-1 if n % 4 >= 2 else 1)
            n += 1
            term = term * r / n
        return float(sums[0]), float(sums[1])


def test_rope_tables_are_their_exact_values_rounded_once():
    """Every entry of the RoPE tables is cos or sin of its float64 angle rounded once to FP32 (the
    reference: decimal arithmetic), in the layout the rope kernel reads. Every trained bit follows
    these tables; PyTorch's threaded CPU cos, which made them before, was ~1e-8 off in rare processes."""
    config = LlamaConfig(n_layer=1, dim=2048, n_head=32, n_kv_head=8, ffn_dim=1, vocab_size=1,
                         context_length=1024, rms_eps=1e-5, rope_base=500000.0, tied_embeddings=True)
    cos, sin = rope_tables(config, 1024, "cpu")
    assert cos.shape == sin.shape == (1024, 64) and cos.dtype == sin.dtype == torch.float32
    assert torch.equal(cos[:, 0::2], cos[:, 1::2]) and torch.equal(sin[:, 0::2], -sin[:, 1::2])
    inv = [500000.0 ** (-i / 64) for i in range(0, 64, 2)]
    for t in [*range(0, 1024, 9), 1023]:
        want = np.array([cos_sin(t * w) for w in inv], dtype=np.float32)      # (32, 2)
        assert np.array_equal(cos[t, 0::2].numpy(), want[:, 0]), t
        assert np.array_equal(sin[t, 1::2].numpy(), want[:, 1]), t


# ---- refusals --------------------------------------------------------------------------------

def test_data_refusals(base, data, tiny, tmp_path):
    tr, va = data
    with pytest.raises(ConfigError, match="training data has role='validation'"):
        base.fine_tune(va, va, steps=1)
    with pytest.raises(ConfigError, match="validation data has role='training'"):
        base.fine_tune(tr, tr, steps=1)
    overlap = tmp_path / "overlap.csv"
    overlap.write_text("question,answer\nWhat is the capital of Tolvara?,The capital of Tolvara is Brisk Harbor.\n")
    bad_va = gen.supervised_csv(base, overlap, role="validation", context=64)
    with pytest.raises(ConfigError, match=r"validation example\(s\) \[1\].*lineage"):
        base.fine_tune(tr, bad_va, steps=1)
    # lineage: a model trained on `tr` refuses validation rows from `tr` in a later run on other data
    other = tmp_path / "other.csv"
    other.write_text("question,answer\nWhat is two plus two?,Four.\nWhat is three plus three?,Six.\n")
    tr2 = gen.supervised_csv(base, other, role="training", context=64)
    tuned = base.fine_tune(tr, va, steps=1, rate=1e-5)
    with pytest.raises(ConfigError, match="lineage"):
        tuned.fine_tune(tr2, bad_va, steps=1)
    # data prepared with another tokenizer
    from aner.formats.gguf import Field
    from gguf import GGUFValueType
    other_tok = rewrite(tiny, tmp_path / "other-tok.gguf", fields={"tokenizer.ggml.add_space_prefix": Field(
        "tokenizer.ggml.add_space_prefix", True, GGUFValueType.BOOL)})
    foreign = gen.supervised_csv(gen.import_model(other_tok), other, role="training", context=64)
    with pytest.raises(ConfigError, match="prepared with tokenizer"):
        base.fine_tune(foreign, va, steps=1)


def test_non_finite_loss_stops_the_run(data, tiny, tmp_path):
    """A head whose logits overflow FP32 makes the first update's loss NaN: the run stops
    with the update's number, and the model it was called on is unchanged."""
    tr, va = data
    huge = gen.import_model(rewrite(tiny, tmp_path / "huge.gguf",
                                    tensors=lambda n, a: a * 1e38 if n == "output_norm.weight" else a))
    before = snapshot(huge)
    with pytest.raises(DataError, match=r"non-finite \(nan\) at update 1; lower the rate"):
        huge.fine_tune(tr, va, steps=2, micro_batch=2, accumulation=2)
    assert all(torch.equal(before[0][k], huge._weights[k]) for k in before[0])


@pytest.mark.parametrize("kw,message", [
    (dict(steps=0), "steps=0"), (dict(steps=1.5), "steps=1.5"), (dict(micro_batch=0), "micro_batch=0"),
    (dict(accumulation=5000), "accumulation=5000"), (dict(rate=0.0), "rate=0.0"),
    (dict(rate=float("nan")), "rate=nan"), (dict(rate=2.0), "rate=2.0"), (dict(seed=-1), "seed=-1"),
    (dict(clip_norm=-1.0), "clip_norm=-1.0"),
])
def test_argument_refusals(base, data, kw, message):
    tr, va = data
    args = dict(steps=1) | kw
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        base.fine_tune(tr, va, **args)


def test_admission_refuses_training_over_budget(tiny, data):
    tr, va = data
    small = gen.import_model(tiny, max_memory_bytes=30 << 20)
    with pytest.raises(ResourceError, match="training needs an estimated"):
        small.fine_tune(tr, va, steps=1)


@pytest.mark.parametrize("select", ["full", "lora"])
def test_activation_estimate_covers_what_backward_keeps(base, data, select):
    """The admission's estimate of what backward keeps is at least what autograd really saves, and
    within 4x of it once its loss chunk, made for every position, is taken at the scored ones the
    head reads."""
    from aner.train.memory import loss_chunk_bytes
    src = base if select == "full" else base.lora(targets=list(ALIASES), rank=4)
    _, kept = train_counting_saved(src, data, micro_batch=4)
    items, config = data[0].items, base.config()
    tokens = max(len(e.tokens) for e in items)
    estimate = src._kept_bytes(4, tokens)
    scored = sorted(e.scored for e in items)[-4:]
    read = estimate - loss_chunk_bytes(config, 4 * tokens) + loss_chunk_bytes(config, sum(scored))
    assert kept <= estimate and read < 4 * kept


def test_resume_refusals(base, data, tmp_path):
    tr, va = data
    with pytest.raises(ConfigError, match="resume needs a trained model"):
        base.resume(tr, va, steps=1)
    tuned = base.lora().fine_tune(tr, va, steps=1)
    other = tmp_path / "other.csv"
    other.write_text("question,answer\nWhat is two plus two?,Four.\n")
    tr2 = gen.supervised_csv(base, other, role="training", context=64)
    with pytest.raises(ConfigError, match="exact data"):
        tuned.resume(tr2, va, steps=1)


def test_adapter_selection_refusals(base, data):
    tr, va = data
    with pytest.raises(ConfigError, match="already has a lora adapter"):
        base.lora().lora()
    with pytest.raises(ConfigError, match="full weights were trained"):
        base.fine_tune(tr, va, steps=1, rate=1e-5).lora()
    for bad, msg in [(dict(rank=0), "rank=0"), (dict(rank=257), "rank=257"), (dict(rank=65), "exceeds target"),
                     (dict(targets=["attention.q_proj", "attention.q_proj"]), "listed twice"),
                     (dict(targets=["blk.0.attn_norm.weight"]), "neither a projection alias"),
                     (dict(targets=[]), "0 entries"), (dict(alpha=0), "alpha=0")]:
        with pytest.raises(ConfigError, match=msg):
            base.lora(**bad)


def test_lora_defaults(base):
    m = base.lora()
    cfg = m._method.config
    assert (cfg.rank, cfg.alpha, cfg.seed, cfg.scale) == (8, 16.0, 0, 2.0)
    assert cfg.targets == tuple(f"blk.{i}.attn_{p}.weight" for i in range(2) for p in ("q", "v"))
    a = m._adapter_tensors["blk.0.attn_q.weight.lora_a"]
    bound = 1 / np.sqrt(64)
    assert a.shape == (8, 64) and float(a.abs().max()) <= bound and float(a.abs().max()) > 0.9 * bound
    assert not m._adapter_tensors["blk.0.attn_q.weight.lora_b"].any()
    assert m.trainable_parameters() == 2 * 2 * 8 * (64 + 64) - 2 * 8 * (64 - 32)  # q: 64x64, v: 32x64
    assert m.method() == "lora" and base.method() == "full"


# ---- checkpoints -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(base, data, tmp_path_factory):
    tr, va = data
    path = tmp_path_factory.mktemp("ck") / "checkpoint-1"
    base.lora(rank=2).fine_tune(tr, va, steps=1).checkpoint(path)
    return path


def test_checkpoint_package(checkpoint):
    files = sorted(p.name for p in checkpoint.iterdir())
    assert files == ["adapter.safetensors", "manifest.json", "metadata.gguf", "optimizer.safetensors",
                     "weights.safetensors"]
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert manifest["format"] == "aner.checkpoint" and manifest["version"] == 1
    assert manifest["backend"] == gen.training_backend()
    assert set(manifest["files"]) == set(files) - {"manifest.json"}
    assert manifest["counters"]["updates"] == 1 and manifest["adapter"]["rank"] == 2


def test_checkpoint_refuses_existing_destination(base, checkpoint):
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    with pytest.raises(ArtifactError, match="already exists"):
        base.checkpoint(checkpoint)
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before


def test_every_flipped_byte_is_refused(checkpoint, tmp_path):
    """Flip bytes at several places of every file of the package: each load must be refused."""
    flips = 0
    rng = np.random.default_rng()
    for f in sorted(checkpoint.iterdir()):
        size = f.stat().st_size
        for offset in {0, size // 2, size - 1, int(rng.integers(size))}:
            copy = tmp_path / f"c{flips}"
            shutil.copytree(checkpoint, copy)
            data = bytearray((copy / f.name).read_bytes())
            data[offset] ^= 0x20
            (copy / f.name).write_bytes(bytes(data))
            with pytest.raises(AnerError):
                gen.load_pretrained_checkpoint(copy)
            flips += 1
    assert flips >= 5 * 3


def test_checkpoint_structural_refusals(checkpoint, tmp_path):
    def variant(name, edit):
        copy = tmp_path / name
        shutil.copytree(checkpoint, copy)
        edit(copy)
        return copy

    no_manifest = variant("nomanifest", lambda p: (p / "manifest.json").unlink())
    with pytest.raises(ArtifactError, match="not a checkpoint"):
        gen.load_pretrained_checkpoint(no_manifest)
    missing = variant("missing", lambda p: (p / "optimizer.safetensors").unlink())
    with pytest.raises(ArtifactError, match="missing"):
        gen.load_pretrained_checkpoint(missing)

    def edit_manifest(key, value):
        def go(p):
            m = json.loads((p / "manifest.json").read_text())
            m[key] = value
            m["manifest_sha256"] = _digest(m)
            (p / "manifest.json").write_text(json.dumps(m))
        return go

    with pytest.raises(FormatError, match="format version 99.*release that wrote it"):
        gen.load_pretrained_checkpoint(variant("v99", edit_manifest("version", 99)))
    with pytest.raises(ArtifactError, match="backend"):
        gen.load_pretrained_checkpoint(variant("backend", edit_manifest("backend", "aner.llama-trainer/0")))
    with pytest.raises(ConfigError, match="recorded device 'cuda:0'; got device='cpu'"):
        gen.load_pretrained_checkpoint(variant("dev", edit_manifest("device", "cuda:0")))
    with pytest.raises(AnerError, match="does not exist"):
        gen.load_pretrained_checkpoint(tmp_path / "absent")


def test_checkpoint_refuses_mismatched_shapes(base, data, tmp_path):
    from safetensors.torch import load_file, save_file
    from aner.formats.publish import sha256_file
    tr, va = data
    path = tmp_path / "ck"
    base.lora(rank=2).fine_tune(tr, va, steps=1).checkpoint(path)
    w = load_file(str(path / "weights.safetensors"))
    w["blk.0.attn_q.weight"] = w["blk.0.attn_q.weight"][:-1]
    save_file(w, str(path / "weights.safetensors"))
    m = json.loads((path / "manifest.json").read_text())
    m["files"]["weights.safetensors"] = sha256_file(path / "weights.safetensors")
    m["manifest_sha256"] = _digest(m)
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatError, match="'blk.0.attn_q.weight' has shape"):
        gen.load_pretrained_checkpoint(path)


def test_progress_is_silent_without_a_terminal(base, data, capsys):
    tr, va = data
    base.lora().fine_tune(tr, va, steps=1)
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""


def test_adamw_is_torch_fused_adamw_bitwise_and_pages_change_no_bit():
    """Our AdamW is torch.optim.AdamW(fused=True)'s update bit for bit, also for a transposed
    gradient (as an adapter factor's often is); updating a tensor in slices of 1024 elements
    (the paged optimizer's pages), or on one thread, changes no bit."""
    from aner.train.optim import AdamW, step_count
    shapes = {"a": (7, 5), "b": (300000,), "c": (64, 33)}
    params = {k: torch.randn(s) for k, s in shapes.items()}
    paged, one_thread = ({k: v.clone() for k, v in params.items()} for _ in range(2))
    ref = {k: v.clone().requires_grad_(True) for k, v in params.items()}
    torch_opt = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1, fused=True)
    ours = AdamW(1e-2, weight_decay=0.1)
    moments, moments_paged, moments_one = (ours.init_moments(p) for p in (params, paged, one_thread))
    for t in range(1, 6):
        grads = {k: torch.randn(s) * 10 ** torch.randn(s) for k, s in shapes.items()}
        grads["c"] = torch.randn(33, 64).t()                          # not contiguous
        for k, p in ref.items():
            p.grad = grads[k].clone(memory_format=torch.contiguous_format)   # its CPU kernel needs it
        torch_opt.step()
        ours.step(params, grads, moments, t)
        for k in shapes:
            flat = [x.view(-1) if x.is_contiguous() else x.contiguous().view(-1)
                    for x in (paged[k], grads[k], *moments_paged[k])]
            for s in range(0, flat[0].numel(), 1024):
                ours.update(*([x[s:s + 1024]] for x in flat), step_count(t, "cpu"))
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            ours.step(one_thread, grads, moments_one, t)
        finally:
            torch.set_num_threads(threads)
    for k in shapes:
        assert torch.equal(params[k], ref[k].detach())
        for other, other_moments in ((paged, moments_paged), (one_thread, moments_one)):
            assert torch.equal(params[k], other[k])
            assert all(torch.equal(a, b) for a, b in zip(moments[k], other_moments[k]))


def test_clipping_divides_by_the_float64_global_norm_inside_adamw():
    """The divisor is (norm + 1e-6) / clip_norm over the float64 global norm, exactly 1 at or
    below it, none for clip_norm 0; AdamW given it updates as on the gradients divided first
    (IEEE FP32 division), bit for bit."""
    from aner.train.optim import AdamW, clip_divisor
    grads = {"x": torch.randn(10, 3) * 5, "y": torch.randn(17) * 5}
    norm = float(torch.cat([g.double().flatten() for g in grads.values()]).norm())
    assert clip_divisor(grads, 0.0) is None
    assert clip_divisor(grads, norm * 1.5).item() == 1.0
    divisor = clip_divisor(grads, 1.0)
    assert divisor.dtype == torch.float32 and divisor.item() == np.float32((norm + 1e-6) / 1.0)
    divided = {k: g / divisor for k, g in grads.items()}
    assert float(torch.cat([g.double().flatten() for g in divided.values()]).norm()) == pytest.approx(1.0, rel=1e-5)
    adamw = AdamW(1e-2, weight_decay=0.1)
    params = {k: torch.randn(g.shape) for k, g in grads.items()}
    ref = {k: p.clone() for k, p in params.items()}
    moments, ref_moments = adamw.init_moments(params), adamw.init_moments(ref)
    adamw.step(params, grads, moments, 1, divisor)
    adamw.step(ref, divided, ref_moments, 1)
    for k in grads:
        assert torch.equal(params[k], ref[k])
        assert all(torch.equal(a, b) for a, b in zip(moments[k], ref_moments[k]))


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_head_loss_equals_whole_logits(tiny_factory, data, monkeypatch, tied):
    """The loss and every gradient (the head's, tied to the embedding or its own) agree with
    autograd over the whole micro-batch's logits, where the head reads the scored positions
    alone, in chunks of 7."""
    import torch.nn.functional as F
    from aner.model.build import build
    from aner.train import loss as L
    from aner.train.profile import Profile
    from fixtures import Shape
    base = gen.import_model(tiny_factory(Shape(tied=tied)))
    assert ("output.weight" in base._weights) != tied
    tr, _ = data
    weights = {n: w.detach().clone().requires_grad_(True) for n, w in base._weights.items()}
    model = build(base.config(), weights)
    examples = list(tr.items[:3])
    monkeypatch.setattr(L, "CHUNK_BYTES", 4 * base.config().vocab_size * 7)
    assert L.chunk_positions(base.config().vocab_size) == 7
    inputs, targets, rows = L.batch(examples, "cpu")
    assert rows is not None and len(rows) == int((targets != L.IGNORE).sum()) < targets.numel()
    loss, grads = L.gradients(model, list(weights.values()), Profile(), inputs, targets, rows, torch.tensor(0.125))
    got = dict(zip(weights, grads))
    whole = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=L.IGNORE, reduction="sum")
    (whole * 0.125).backward()
    whole = float(whole.detach())
    assert float(loss) == pytest.approx(whole, rel=1e-6)
    assert float(L.summed_loss(model, examples, "cpu", Profile())) == pytest.approx(whole, rel=1e-6)
    assert len(rows) > 4 * 7                                    # several chunks
    for n, w in weights.items():
        # the head's weight gradient sums over positions chunk by chunk: another FP32 order
        torch.testing.assert_close(got[n], w.grad, rtol=1e-5, atol=1e-5 * float(w.grad.abs().max()), msg=n)
        assert got[n].abs().max() > 0, n


def test_scored_rows_pad_to_a_multiple_with_the_first_unscored():
    """The head's rows: the scored positions, then (to a multiple) the first unscored ones, in
    ascending order; None where that is every position (the hidden states are read in place)."""
    from aner.train.loss import IGNORE, scored_rows
    t = torch.tensor([IGNORE, IGNORE, 5, IGNORE, 7, 8, IGNORE, IGNORE])
    assert scored_rows(t, 1).tolist() == [2, 4, 5]
    assert scored_rows(t, 4).tolist() == [0, 2, 4, 5]
    assert scored_rows(t, 5).tolist() == [0, 1, 2, 4, 5]
    assert scored_rows(t, 8) is None and scored_rows(t, 128) is None
    assert scored_rows(torch.tensor([1, 2, 3]), 1) is None
    assert scored_rows(torch.full((4,), IGNORE), 1).tolist() == []


def test_chunk_positions_are_whole_tiles_within_the_bytes():
    """A chunk holds the most positions that fit CHUNK_BYTES, rounded down to whole tiles of
    CHUNK_ROWS; a trained head's chunk as many as its weight gradient's read and write move."""
    from aner.train import loss as L
    for vocab, itemsize in [(128256, 2), (128256, 4), (49152, 2), (49152, 4), (32000, 4)]:
        n = L.chunk_positions(vocab, itemsize)
        assert n % L.CHUNK_ROWS == 0 and n * itemsize * vocab <= L.CHUNK_BYTES
        assert (n + L.CHUNK_ROWS) * itemsize * vocab > L.CHUNK_BYTES, (vocab, itemsize)
    assert L.chunk_positions(128256, 2) == 1024
    assert L.chunk_positions(128256, 2, trained_dim=2048) == 8 * 2048 // 2
    assert L.chunk_positions(10 ** 9) == 1                      # at least one position


def test_all_finite_finds_any_non_finite_element():
    from aner.train.optim import all_finite
    grads = {"a": torch.randn(5), "b": torch.randn(30, 7) * 3e37}   # huge but finite: no false alarm
    assert all_finite(grads)
    for bad in (float("inf"), float("-inf"), float("nan")):
        g = {k: v.clone() for k, v in grads.items()}
        g["b"][np.random.default_rng().integers(30), 3] = bad
        assert not all_finite(g)


def test_kept_casts_leave_room_for_the_fused_adapters_joins(tiny_factory):
    """Under a BF16 policy a fused LoRA adapter's frozen base is cast with the room its joins
    write (`kernels.lora`): each layer's gate and up in one buffer, [3 r | W | 3 r] a row (zeros
    where no join writes: `_paired`'s matrix as it lies), down with 3 r rows under it; q, k, v and
    o with none (their products take no join), nor any base under a rank that is not a multiple of
    8, FP16 or the torch adapters. The casts hold the weights' values, and every cast and room is
    dropped when the run ends."""
    from aner.model.build import build
    from aner.model.llama import Dense, side_by_side
    from aner.train.loop import kept_casts
    from aner.train.profile import Profile
    from fixtures import Shape
    path = tiny_factory(Shape(tied=False, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128))

    def model(rank, kernel="fused"):
        src = gen.import_model(path).lora(rank=rank, seed=1, targets=list(ALIASES))
        return build(src._source.config, src._weights, src._method, src._adapter_tensors, adapter_kernel=kernel)
    m = model(8)
    with kept_casts(m, {}, Profile(precision="bfloat16")):
        for layer in m.layers:
            gate, up, down = layer.ffn_gate.base, layer.ffn_up.base, layer.ffn_down.base
            (g, left), (u, left_up) = gate.room, up.room
            assert left == left_up == 24 and g.shape == u.shape == (128, 24 + 64 + 24)
            assert side_by_side([g, u], 0) is not None
            for base, part in ((gate, g), (up, u)):
                assert torch.equal(part[:, 24:88], base.weight.bfloat16())
                assert part[:, 24:88].data_ptr() == base.cast.data_ptr()
            assert not g[:, 88:].any() and not u[:, :24].any() and not g[:, :24].any() and not u[:, 88:].any()
            d, at = down.room
            assert at == 0 and d.shape == (64 + 24, 128) and torch.equal(d[:64], down.weight.bfloat16())
            assert d[:64].data_ptr() == down.cast.data_ptr()
            assert all(p.base.room is None and p.base.cast is not None
                       for p in (layer.attn_q, layer.attn_k, layer.attn_v, layer.attn_output))
    assert all(d.room is None and d.cast is None for d in m.modules() if type(d) is Dense)
    for rank, precision, kernel in ((4, "bfloat16", "fused"), (8, "float16", "fused"), (8, "bfloat16", "torch")):
        m = model(rank, kernel)
        with kept_casts(m, {}, Profile(precision=precision)):
            assert all(d.room is None and d.cast is not None for d in m.modules() if type(d) is Dense
                       and d.weight.dim() == 2 and d is not m.tok_embd)

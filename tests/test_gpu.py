"""CUDA placement, precision profiles, paged AdamW and exact resume on the GPU.

Skipped where no CUDA device exists (development machines and CI); run on the GPU machine with
CUBLAS_WORKSPACE_CONFIG=:4096:8 (see benchmarks/gpu_profiles.py for the matrix over real shapes).
"""
import contextlib
import importlib.util
import json
import shutil

import numpy as np
import pytest
import torch

from aner import gen
from aner.errors import ConfigError, ResourceError
from aner.model.names import ALIASES
from aner.train.memory import loss_chunk_bytes
from conftest import EXAMPLES
from fixtures import Shape, train_counting_saved

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DEV = "cuda:0"
PAGE = 4096  # the smallest page: many chunks even on a tiny model


@pytest.fixture(scope="module")
def tiny_path(tiny_factory):
    return tiny_factory(Shape(tied=False, n_layer=2, dim=64, n_head=4, n_kv_head=2))


@pytest.fixture(scope="module")
def data(tiny_path):
    base = gen.import_model(tiny_path)
    tr = gen.supervised_csv(base, EXAMPLES / "data" / "training.csv", role="training", context=64)
    va = gen.supervised_csv(base, EXAMPLES / "data" / "validation.csv", role="validation", context=64)
    return tr, va


def selections():
    """(storage, method, nf4_kernel) the backend admits: full fine-tuning only on a floating base;
    the GPU's NF4 kernels only where there is a packed base to decode."""
    out = [("float32", "full", "host_tiled")]
    for storage in ("float32", "nf4", "nf4_double_quant"):
        for method in ("lora", "rslora", "lora_fa", "tinylora"):
            for kernel in ("host_tiled",) if storage == "float32" else ("host_tiled", "fused", "decoded"):
                out.append((storage, method, kernel))
    return out


def select(base, storage, method):
    if storage != "float32":
        base = base.nf4(double_quant=storage == "nf4_double_quant")
    kw = dict(rank=2, seed=3)
    return {"full": lambda m: m, "lora": lambda m: m.lora(**kw), "rslora": lambda m: m.rs_lora(**kw),
            "lora_fa": lambda m: m.lora_fa(**kw), "tinylora": lambda m: m.tinylora(**kw)}[method](base)


def tensors_equal(a, b):
    for k in a._weights:
        x, y = a._weights[k], b._weights[k]
        if isinstance(x, torch.Tensor) and not torch.equal(x.cpu(), y.cpu()):
            return False
    for k in a._adapter_tensors:
        if not torch.equal(a._adapter_tensors[k].cpu(), b._adapter_tensors[k].cpu()):
            return False
    for k, (m, v) in a._state.moments.items():
        m_b, v_b = b._state.moments[k]
        if not (torch.equal(m.cpu(), m_b.cpu()) and torch.equal(v.cpu(), v_b.cpu())):
            return False
    def counters(h):
        return h.updates(), h.scored_tokens(), h._state.loss_scale
    return counters(a) == counters(b)


@pytest.mark.parametrize("optimizer", ["adamw", "paged_adamw"])
@pytest.mark.parametrize("precision", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("storage,method,kernel", selections())
def test_exact_resume_matrix(tiny_path, data, tmp_path, storage, method, kernel, precision, optimizer):
    tr, va = data
    base = gen.import_model(tiny_path, device=DEV)
    try:
        src = select(base, storage, method)
    except AttributeError as e:
        pytest.skip(f"{storage}/{method} is not in this build: {e}")
    src = src.with_training_profile(precision=precision, optimizer=optimizer, nf4_kernel=kernel, page_bytes=PAGE)
    kw = dict(micro_batch=2, accumulation=2, rate=1e-3, seed=4)
    two = src.fine_tune(tr, va, steps=2, **kw)
    one = src.fine_tune(tr, va, steps=1, **kw)
    one.checkpoint(tmp_path / "ck")
    resumed = gen.load_pretrained_checkpoint(tmp_path / "ck", device=DEV).resume(tr, va, steps=1)
    assert tensors_equal(two, resumed)
    assert two.validation_loss() == resumed.validation_loss()
    assert np.isfinite(two.validation_loss())
    again = src.fine_tune(tr, va, steps=2, **kw)  # the same inputs give the same bits
    assert tensors_equal(two, again)
    assert src.updates() == 0


def recording(kept_casts, record):
    """`kept_casts` that calls record(model, trainable, casts) once the casts are made."""
    @contextlib.contextmanager
    def wrapped(model, trainable, profile):
        with kept_casts(model, trainable, profile) as casts:
            record(model, trainable, casts)
            yield casts
    return wrapped


@contextlib.contextmanager
def no_kept_casts(model, trainable, profile):
    """`kept_casts` that keeps none: every forward casts its weights."""
    yield {}


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("optimizer", ["adamw", "paged_adamw"])
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_kept_casts_follow_their_weights(tiny_path, data, monkeypatch, precision, optimizer, graphs):
    """Full fine-tuning under a low-precision policy keeps each trained matrix's cast, which AdamW
    rewrites: before every update each equals a fresh cast of its weight, and the trained
    weights, moments and validation loss equal a run's that casts every weight in every forward."""
    import aner.train.loop as loop
    tr, va = data
    src = gen.import_model(tiny_path, device=DEV).with_training_profile(
        precision=precision, optimizer=optimizer, page_bytes=PAGE, cuda_graphs=graphs, layer_kernel="fused")
    kw = dict(micro_batch=2, accumulation=2, rate=1e-3, seed=4)
    kept, checked = [], []
    real_clip = loop.clip_divisor

    def checking(grads, clip_norm):
        casts, trainable = kept[-1]
        checked.append(all(torch.equal(c, trainable[n].detach().to(c.dtype)) for n, c in casts.items()))
        return real_clip(grads, clip_norm)

    monkeypatch.setattr(loop, "kept_casts", recording(loop.kept_casts, lambda model, trainable, casts:
                                                      kept.append((casts, trainable))))
    monkeypatch.setattr(loop, "clip_divisor", checking)
    ours = src.fine_tune(tr, va, steps=3, **kw)
    casts = kept[0][0]
    # the untied tiny model: 7 matrices a layer and the head; the embedding table is only looked up
    assert sorted(casts) == sorted(n for n, w in src._weights.items() if w.dim() == 2 and n != "token_embd.weight")
    assert all(c.dtype == getattr(torch, precision) for c in casts.values()) and checked == [True] * 3

    monkeypatch.setattr(loop, "kept_casts", no_kept_casts)
    fresh = src.fine_tune(tr, va, steps=3, **kw)
    assert tensors_equal(ours, fresh) and ours.validation_loss() == fresh.validation_loss()


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("adapter_kernel", ["torch", "fused"])
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_frozen_casts_made_once(tiny_path, data, monkeypatch, precision, adapter_kernel, graphs):
    """LoRA under a low-precision policy casts each frozen matrix (every projection and the untied
    head) once for the run: during it each holds its cast, equal to a fresh one and unchanged by
    the updates, and the adapters, moments and validation loss equal a run's that casts every
    weight in every forward. The casts are gone when the run returns."""
    import aner.train.loop as loop
    from aner.model.llama import Dense
    tr, va = data
    src = gen.import_model(tiny_path, device=DEV).lora(targets=list(ALIASES), rank=4).with_training_profile(
        precision=precision, cuda_graphs=graphs, adapter_kernel=adapter_kernel, layer_kernel="fused")
    kw = dict(micro_batch=2, accumulation=2, rate=1e-3, seed=4)
    held, checked = [], []
    real_clip = loop.clip_divisor

    def checking(grads, clip_norm):
        checked.append(all(torch.equal(m.cast, m.weight.to(m.cast.dtype)) for m in held[-1]))
        return real_clip(grads, clip_norm)

    monkeypatch.setattr(loop, "kept_casts", recording(loop.kept_casts, lambda model, trainable, casts: held.append(
        [m for m in model.modules() if type(m) is Dense and m.cast is not None])))
    monkeypatch.setattr(loop, "clip_divisor", checking)
    ours = src.fine_tune(tr, va, steps=3, **kw)
    n_layer = src.config().n_layer
    assert len(held[0]) == 7 * n_layer + 1 and checked == [True] * 3   # the F32 file: every matrix cast
    assert all(m.cast is None for m in held[0])

    monkeypatch.setattr(loop, "kept_casts", no_kept_casts)
    monkeypatch.setattr(loop, "clip_divisor", real_clip)
    fresh = src.fine_tune(tr, va, steps=3, **kw)
    assert tensors_equal(ours, fresh) and ours.validation_loss() == fresh.validation_loss()


def test_paged_equals_resident_adamw_bitwise(tiny_path, data):
    tr, va = data
    base = gen.import_model(tiny_path, device=DEV).lora(rank=4)
    a = base.fine_tune(tr, va, steps=3, rate=1e-3)
    b = base.with_training_profile(optimizer="paged_adamw", page_bytes=PAGE).fine_tune(tr, va, steps=3, rate=1e-3)
    assert tensors_equal(a, b)
    mem = b.memory_summary()
    assert mem.paged_optimizer and mem.paged_optimizer_bytes == mem.optimizer_bytes > 0
    assert mem.optimizer_window_bytes == 4 * PAGE
    assert all(m.device.type == "cpu" and m.is_pinned() for m, _ in b._state.moments.values())


def test_cuda_fp32_agrees_with_cpu(tiny_path):
    cpu = gen.import_model(tiny_path)
    gpu = gen.import_model(tiny_path, device=DEV)
    toks = np.random.default_rng().integers(0, 49152, 48).tolist()
    a, b = cpu.logits(toks), gpu.logits(toks)
    scaled = np.abs(a - b).max() / np.abs(a).max()
    assert scaled <= 1e-3, scaled
    moved = cpu.to(DEV)
    assert np.abs(moved.logits(toks) - b).max() == 0.0


@pytest.mark.parametrize("precision,bound", [("float16", 0.05), ("bfloat16", 0.05)])
def test_mixed_precision_logits_within_bound(tiny_path, data, precision, bound):
    """The same weights evaluated under the low-precision policy stay within the seed's bound."""
    from aner.train.loss import summed_loss
    from aner.train.profile import Profile
    tr, _ = data
    m = gen.import_model(tiny_path, device=DEV)
    e = tr.items[0]
    x = torch.tensor([e.tokens], device=DEV)
    ref = m.module()(x)
    with Profile(precision=precision).autocast(DEV), torch.no_grad():
        low = m.module()(x)
    scaled = float((low.float() - ref).abs().max() / ref.abs().max())
    assert 0 < scaled <= bound, scaled
    assert float(summed_loss(m.module(), [e], DEV, Profile(precision=precision))) > 0


def test_fp16_overflow_replays_without_committing(tiny_path, data):
    """A scale so large that the first window overflows: halved until it fits, the update once."""
    from aner.train.loop import RunConfig, TrainState, window
    from aner.train.scaler import LossScale
    tr, va = data
    src = gen.import_model(tiny_path, device=DEV).lora(rank=2).with_training_profile(precision="float16")
    start = TrainState(RunConfig(rate=1e-3), tr.sha256(), va.sha256(), loss_scale=LossScale(scale=2.0 ** 40))
    out = src._train(tr, va, start, 1, progress=False)
    s = out._state.loss_scale
    assert out.updates() == 1 and s.overflows >= 1 and s.scale < 2.0 ** 40 and s.retries == 0
    assert out.scored_tokens() == sum(tr.items[i].scored for i in window(start, tr.examples()))


def test_policy_refusals(tiny_path, data, monkeypatch):
    with pytest.raises(ResourceError, match="cuda:99"):
        gen.import_model(tiny_path, device="cuda:99")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with pytest.raises(ResourceError, match="CUBLAS_WORKSPACE_CONFIG"):
        gen.import_model(tiny_path, device=DEV)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cuda.matmul.allow_tf32
    m = gen.import_model(tiny_path, device=DEV)
    with pytest.raises(ConfigError, match="precision='float64' is not supported"):
        m.with_training_profile(precision="float64")
    trained = m.lora(rank=2).fine_tune(*data, steps=1)
    with pytest.raises(ConfigError, match="changing the training profile of a trained model"):
        trained.with_training_profile(nf4_kernel="fused")


def test_fused_matches_host_tiled_and_counts_its_copy(tiny_path, data):
    """The fused kernels compute what host tiling computes (up to summation order), keep one
    packed copy on the GPU that memory_summary counts, and decode nothing outside the tile."""
    tr, va = data
    packed = gen.import_model(tiny_path, device=DEV).nf4().lora(rank=2, seed=1)
    fused = packed.with_training_profile(nf4_kernel="fused")
    mem = fused.memory_summary()
    shapes = [w.shape for w in fused._weights.values() if not isinstance(w, torch.Tensor)]
    # the same packed buffers, plus each matrix's two codebooks (16 + 256 FP32 values) and on a
    # Hopper GPU the transposed copy of each matrix of whole blocks both ways (codes, FP32 absmax)
    hopper = torch.cuda.get_device_capability(DEV)[0] == 9
    transposed = sum(n * k // 2 + n * k // 64 * 4 for n, k in shapes if hopper and n % 64 == 0 and k % 64 == 0)
    assert mem.gpu_packed_base_bytes - mem.packed_base_bytes == len(shapes) * 4 * (16 + 256) + transposed
    assert mem.packed_base_bytes > 0 and mem.dequant_tile_bytes == 0
    assert packed.memory_summary().gpu_packed_base_bytes == 0
    toks = np.random.default_rng().integers(0, 49152, 40).tolist()
    a, b = packed.logits(toks), fused.logits(toks)
    assert np.abs(a - b).max() / np.abs(a).max() <= 1e-5
    ta = packed.fine_tune(tr, va, steps=2, rate=1e-3)
    tb = fused.fine_tune(tr, va, steps=2, rate=1e-3)
    assert abs(ta.validation_loss() - tb.validation_loss()) <= 1e-4 * abs(ta.validation_loss())


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("storage", ["nf4", "nf4_double_quant"])
@pytest.mark.parametrize("kernel", ["decoded", "decoded_kept"])
def test_decoded_kernel_trains_what_a_dense_base_of_its_weights_trains(tiny_path, data, storage, precision, kernel):
    """nf4_kernel='decoded' (and 'decoded_kept') gives a dense weight's bits: logits and LoRA
    training, with adapters on some projections (the others' products have no adapter), equal
    those of a floating base holding NF4Weight.dequantize() of every matrix, bit for bit, while
    the GPU holds the packed copy and memory_summary counts the decoded matrices alive at once:
    the largest, or with decoded_kept every one multiplied whole (not the untied embedding)."""
    tr, va = data
    packed = gen.import_model(tiny_path, device=DEV).nf4(double_quant=storage == "nf4_double_quant")
    decoded = packed.with_training_profile(precision=precision, nf4_kernel=kernel)
    weights = {n: w if isinstance(w, torch.Tensor) else w.dequantize().to(DEV) for n, w in packed._weights.items()}
    dense = packed._derive(weights=weights, storage="float32").with_training_profile(precision=precision)
    mem = decoded.memory_summary()
    sizes = [w.numel() * dense._profile.compute_dtype.itemsize for n, w in weights.items()
             if not isinstance(packed._weights[n], torch.Tensor) and n != "token_embd.weight"]
    matrices = sum(not isinstance(w, torch.Tensor) for w in packed._weights.values())
    assert mem.gpu_packed_base_bytes == mem.packed_base_bytes + matrices * 4 * (16 + 256) > 0    # no transposed copy
    assert mem.dequant_tile_bytes == (sum(sizes) if kernel == "decoded_kept" else max(sizes))
    toks = np.random.default_rng().integers(0, 49152, 40).tolist()
    assert np.array_equal(decoded.logits(toks), dense.logits(toks))
    kw = dict(steps=2, micro_batch=2, rate=1e-3, seed=2)
    lora = dict(rank=2, seed=1, targets=["attention.q_proj", "attention.v_proj", "mlp.up_proj"])
    a, b = decoded.lora(**lora).fine_tune(tr, va, **kw), dense.lora(**lora).fine_tune(tr, va, **kw)
    assert a._state.losses == b._state.losses and a.validation_loss() == b.validation_loss()
    assert all(torch.equal(a._adapter_tensors[k], b._adapter_tensors[k]) for k in a._adapter_tensors)


def test_joined_deltas_train_as_the_deltas_added(tiny_factory, data, monkeypatch):
    """QLoRA as the throughput rows run it (nf4_kernel="decoded_kept", the fused adapter kernels,
    BF16, rank 8 on all seven projections), on a model whose gate and up are twice x's width:
    their deltas join the decoded products (`kernels.lora._joined`), the others' do not; down's
    input is twice its output's width: du @ A joins its input gradient (`kernels.lora._joined_grad`),
    no other's does; the kept decodes are counted 3 r columns or rows more along their longer side
    (gate's and up's 6 r: paired, `kernels.lora.gated_mlp`).
    The losses are those of a floating base holding the decoded weights, its casts kept without
    room, so that every delta is added, to 1e-3; recorded graphs give the eager bits, and resume is
    exact."""
    import aner.train.loop as loop
    from aner.kernels import lora
    tr, va = data
    path = tiny_factory(Shape(tied=False, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128))
    packed = gen.import_model(path, device=DEV).nf4()
    weights = {n: w if isinstance(w, torch.Tensor) else w.dequantize().to(DEV) for n, w in packed._weights.items()}
    dense = packed._derive(weights=weights, storage="float32")
    profile = dict(precision="bfloat16", adapter_kernel="fused", layer_kernel="fused")
    lora_kw = dict(rank=8, seed=1, targets=list(ALIASES))
    kw = dict(micro_batch=2, rate=1e-3, seed=4)
    joins, grads, joined, joined_grad = [], [], lora._joined, lora._joined_grad

    def spy(bases, *args):
        out = joined(bases, *args)
        joins.append((len(bases), out is not None))
        return out

    def spy_grad(bases, x2d, *args):
        out = joined_grad(bases, x2d, *args)
        grads.append((len(bases), x2d.shape[1], out))
        return out
    monkeypatch.setattr(lora, "_joined", spy)
    monkeypatch.setattr(lora, "_joined_grad", spy_grad)
    src = packed.with_training_profile(nf4_kernel="decoded_kept", **profile).lora(**lora_kw)
    plain = packed.with_training_profile(nf4_kernel="decoded_kept", **profile).memory_summary()
    longer = sum(max(packed._weights[n].shape) * (2 if ".ffn_gate." in n or ".ffn_up." in n else 1)
                 for n in src._method.config.targets)
    assert src.memory_summary().dequant_tile_bytes == plain.dequant_tile_bytes + longer * 3 * 8 * 2
    eager = src.fine_tune(tr, va, steps=4, **kw)
    assert set(joins) == {(3, False), (2, True), (1, False)}     # q, k, v; gate, up; o and down
    assert set(grads) == {(3, 64, 0), (2, 64, 0), (1, 64, 0), (1, 128, 24)}     # the same; down's joins
    with monkeypatch.context() as m:
        m.setattr(loop, "room", lambda model, dtype: {})
        added = dense.with_training_profile(**profile).lora(**lora_kw).fine_tune(tr, va, steps=4, **kw)
    assert np.allclose(eager._state.losses, added._state.losses, rtol=1e-3, atol=0)
    graphed = src.with_training_profile(nf4_kernel="decoded_kept", cuda_graphs=True, **profile)
    four = graphed.fine_tune(tr, va, steps=2, **kw).resume(tr, va, steps=2)
    assert tensors_equal(eager, four) and eager._state.losses == four._state.losses


@contextlib.contextmanager
def first_update_gradients(monkeypatch):
    """Yields a dict that holds, after the block, a copy of the gradients the block's first update
    hands to the clipping norm (reduced over the window and unscaled)."""
    from aner.train import loop
    seen, divisor = {}, loop.clip_divisor

    def spy(grads, clip_norm):
        if not seen:
            seen.update({k: g.clone() for k, g in grads.items()})
        return divisor(grads, clip_norm)
    monkeypatch.setattr(loop, "clip_divisor", spy)
    yield seen
    monkeypatch.setattr(loop, "clip_divisor", divisor)


def assert_trained_as_made_apart(gated, graphed, apart, gated_grads, apart_grads, bound):
    """The gated run has the graphed run's bits; its first loss has the run made apart's bits, its
    next ones are theirs to 1e-3, and each tensor of its first update's gradients is within bound
    of theirs, relative to that tensor's largest magnitude (where theirs is all zeros, its own)."""
    assert graphed._state.losses == gated._state.losses and tensors_equal(graphed, gated)
    assert apart._state.losses[0] == gated._state.losses[0]
    assert np.allclose(apart._state.losses, gated._state.losses, rtol=1e-3, atol=0)
    assert gated_grads and gated_grads.keys() == apart_grads.keys()
    for k, b in apart_grads.items():
        top = float(b.abs().max())
        scaled = float((gated_grads[k] - b).abs().max()) / top if top else float(gated_grads[k].abs().max())
        assert scaled <= bound, (k, scaled)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="Hopper GPU only (the Gluon kernels)")
@pytest.mark.parametrize("storage", ["nf4", "float32"])
def test_swiglu_inside_the_gemms_trains_as_made_apart(tiny_factory, data, monkeypatch, storage):
    """QLoRA as the throughput rows run it, rank 16 on all seven projections, and LoRA over the
    casts kept with room for the joins (`train.loop.kept_casts`): gate's and up's product makes h
    in its kernel and down's input gradient gives theirs (`kernels.lora.gated_mlp`, each layer
    once a micro-batch each way); recorded graphs give the eager bits; the first loss
    has the bits of the projections and the SwiGLU made apart (the forward's outputs are theirs),
    the next ones are theirs to 1e-3 and the first update's gradients to 2e-2 of each tensor's
    largest (6.3e-3 measured on the H100: gate's and up's input gradient is one GEMM over the pair,
    rounded once, where apart it is a chain of two, rounded after each); without down adapted the
    MLP is made apart."""
    from aner.adapters.lora import LoRALinear
    from aner.kernels import mlp
    tr, va = data
    path = tiny_factory(Shape(tied=False, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128))
    base = gen.import_model(path, device=DEV)
    profile = dict(precision="bfloat16", adapter_kernel="fused", layer_kernel="fused")
    if storage == "nf4":
        base, profile = base.nf4(), dict(profile, nf4_kernel="decoded_kept")
    kw = dict(micro_batch=2, rate=1e-3, seed=4)
    calls, forward, backward = [], mlp.gated_forward, mlp.gated_backward
    monkeypatch.setattr(mlp, "gated_forward", lambda *a, **k: calls.append("forward") or forward(*a, **k))
    monkeypatch.setattr(mlp, "gated_backward", lambda *a: calls.append("backward") or backward(*a))
    src = base.with_training_profile(**profile).lora(rank=16, seed=1, targets=list(ALIASES))
    with first_update_gradients(monkeypatch) as gated_grads:
        gated = src.fine_tune(tr, va, steps=2, **kw)
    assert calls.count("forward") >= 4 and calls.count("backward") == 4     # 2 layers x 2 updates; validation too
    graphed = src.with_training_profile(cuda_graphs=True, **profile).fine_tune(tr, va, steps=2, **kw)
    calls.clear()
    no_down = [t for t in ALIASES if t != "mlp.down_proj"]
    base.with_training_profile(**profile).lora(rank=16, seed=1, targets=no_down).fine_tune(tr, va, steps=1, **kw)
    assert not calls
    monkeypatch.setattr(LoRALinear, "gated_mlp", staticmethod(lambda *args: None))
    with first_update_gradients(monkeypatch) as apart_grads:
        apart = src.fine_tune(tr, va, steps=2, **kw)
    assert not calls
    assert_trained_as_made_apart(gated, graphed, apart, gated_grads, apart_grads, 2e-2)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="Hopper GPU only (the Gluon kernels)")
@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_swiglu_inside_the_gemms_trains_full_fine_tuning_as_made_apart(tiny_factory, data, monkeypatch, precision):
    """Full fine-tuning under a low-precision policy with the fused layer kernels: gate's and up's
    product makes h in its kernel and down's input gradient gives theirs (`Dense.gated_mlp`, each
    layer once a micro-batch each way); recorded graphs give the eager bits; the first update's
    gradients and loss have the bits of the projections and the SwiGLU made apart (as measured on
    the H100), the next losses are theirs to 1e-3 (cuBLAS may sum these small products in another
    order)."""
    from aner.kernels import mlp
    from aner.model.llama import Dense
    tr, va = data
    base = gen.import_model(tiny_factory(Shape(tied=False, n_layer=2, dim=64, n_head=4, n_kv_head=2, ffn_dim=128)),
                            device=DEV)
    profile = dict(precision=precision, layer_kernel="fused")
    kw = dict(micro_batch=2, rate=1e-3, seed=4)
    calls, forward, backward = [], mlp.gated_forward, mlp.gated_backward
    monkeypatch.setattr(mlp, "gated_forward", lambda *a, **k: calls.append("forward") or forward(*a, **k))
    monkeypatch.setattr(mlp, "gated_backward", lambda *a: calls.append("backward") or backward(*a))
    src = base.with_training_profile(**profile)
    with first_update_gradients(monkeypatch) as gated_grads:
        gated = src.fine_tune(tr, va, steps=2, **kw)
    windows = 2 + gated._state.loss_scale.overflows         # FP16 replays a window whose gradients overflowed
    assert calls.count("forward") >= 2 * windows and calls.count("backward") == 2 * windows     # 2 layers
    graphed = base.with_training_profile(cuda_graphs=True, **profile).fine_tune(tr, va, steps=2, **kw)
    monkeypatch.setattr(Dense, "gated_mlp", staticmethod(lambda *args: None))
    calls.clear()
    with first_update_gradients(monkeypatch) as apart_grads:
        apart = src.fine_tune(tr, va, steps=2, **kw)
    assert not calls
    assert_trained_as_made_apart(gated, graphed, apart, gated_grads, apart_grads, 0.0)


@pytest.mark.parametrize("storage,method,kernel,precision", [
    ("float32", "full", "host_tiled", "float32"), ("float32", "full", "host_tiled", "bfloat16"),
    ("float32", "lora", "host_tiled", "float16"), ("nf4_double_quant", "lora", "fused", "bfloat16"),
    ("nf4", "lora_fa", "fused", "float16"), ("nf4", "tinylora", "fused", "float32"),
    ("float32", "rslora", "host_tiled", "bfloat16"), ("float32", "lora", "host_tiled+fused", "bfloat16"),
    ("nf4_double_quant", "lora_fa", "fused+fused", "float16"), ("float32", "tinylora", "host_tiled+fused", "float32"),
    ("float32", "full", "host_tiled+torch+fused", "bfloat16"),
    ("nf4_double_quant", "lora", "fused+fused+fused", "bfloat16"),
    ("nf4_double_quant", "lora", "decoded+fused+fused", "bfloat16"), ("nf4", "lora_fa", "decoded", "float16"),
    ("nf4_double_quant", "lora", "decoded_kept+fused+fused", "bfloat16")])
def test_cuda_graphs_replay_the_eager_bits(tiny_path, data, tmp_path, monkeypatch, storage, method, kernel,
                                           precision):
    """Recorded graphs give the eager run's bits, with micro-batches of several padded lengths,
    more shapes than are recorded (the rest run eagerly) and accumulation; resume is exact."""
    from aner.train import graphs
    tr, va = data
    base = gen.import_model(tiny_path, device=DEV)
    src = select(base, storage, method)
    kernel, adapter, layer = (kernel + "+torch+torch").split("+")[:3]   # nf4_kernel[+adapter_kernel[+layer_kernel]]
    kw = dict(micro_batch=2, accumulation=2, rate=1e-3, seed=4)
    profile = dict(precision=precision, nf4_kernel=kernel, adapter_kernel=adapter, layer_kernel=layer)
    eager = src.with_training_profile(**profile).fine_tune(tr, va, steps=4, **kw)
    replays, shapes = [], []
    replay, call = torch.cuda.CUDAGraph.replay, graphs.Graphed.__call__
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda g: replays.append(g) or replay(g))
    monkeypatch.setattr(graphs.Graphed, "__call__",
                        lambda self, x, y, rows, scale: shapes.append(tuple(x.shape)) or call(self, x, y, rows, scale))
    monkeypatch.setattr(graphs, "MAX_SHAPES", 3)
    graphed = src.with_training_profile(**profile, cuda_graphs=True)
    two = graphed.fine_tune(tr, va, steps=2, **kw)
    four = two.resume(tr, va, steps=2)
    assert tensors_equal(eager, four) and eager._state.losses == four._state.losses
    assert eager.validation_loss() == four.validation_loss()
    # each of the two runs records at most 3 shapes and runs the others eagerly
    assert 0 < len(set(replays)) <= 2 * 3 and len(set(shapes)) > 3
    two.checkpoint(tmp_path / "ck")
    resumed = gen.load_pretrained_checkpoint(tmp_path / "ck", device=DEV).resume(tr, va, steps=2)
    assert resumed.training_profile()["cuda_graphs"] and tensors_equal(four, resumed)


@pytest.mark.parametrize("storage,method,kernel", [("nf4_double_quant", "lora", "decoded_kept+fused+fused"),
                                                   ("float32", "full", "host_tiled+torch+fused")])
def test_cuda_graphs_replay_the_eager_bits_where_the_head_reads_some_rows(tiny_path, data, storage, method, kernel):
    """Micro-batches of 4 at up to 64 positions: the head reads the scored rows padded to 128 of
    up to 252 (`loss.batch`), in the recorded graphs as in the eager run, whose bits they give."""
    from aner.train.loss import batch
    tr, va = data
    assert len(batch(tr.items[:4], DEV)[2]) == 128
    src = select(gen.import_model(tiny_path, device=DEV), storage, method)
    nf4, adapter, layer = kernel.split("+")
    profile = dict(precision="bfloat16", nf4_kernel=nf4, adapter_kernel=adapter, layer_kernel=layer)
    kw = dict(steps=3, micro_batch=4, rate=1e-3, seed=5)
    eager = src.with_training_profile(**profile).fine_tune(tr, va, **kw)
    graphed = src.with_training_profile(**profile, cuda_graphs=True).fine_tune(tr, va, **kw)
    assert tensors_equal(eager, graphed) and eager._state.losses == graphed._state.losses


FUSED_RUN = dict(steps=3, micro_batch=2, rate=1e-3, seed=5)


def fused_against_torch_ops(tiny_path, data, method, precision, choice, value="fused"):
    """(fused, reference): 3 updates with `choice`=`value` and with the torch ops; the fused run
    repeats its own bits, and both agree on losses within FP32 (2e-2 under FP16/BF16)."""
    tr, va = data
    src = select(gen.import_model(tiny_path, device=DEV), "float32", method)
    ref = src.with_training_profile(precision=precision).fine_tune(tr, va, **FUSED_RUN)
    fused = src.with_training_profile(precision=precision, **{choice: value})
    a, b = fused.fine_tune(tr, va, **FUSED_RUN), fused.fine_tune(tr, va, **FUSED_RUN)
    assert tensors_equal(a, b) and a._state.losses == b._state.losses
    loss_tol = 1e-5 if precision == "float32" else 2e-2
    assert np.allclose(a._state.losses, ref._state.losses, rtol=loss_tol, atol=0)
    assert np.isclose(a.validation_loss(), ref.validation_loss(), rtol=loss_tol, atol=0)
    return a, ref


@pytest.mark.parametrize("method", ["lora", "rslora", "lora_fa", "tinylora"])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_fused_adapters_agree_with_torch_ops(tiny_path, data, method, precision):
    """adapter_kernel='fused' trains what the torch ops train, up to FP32 summation order (and,
    under BF16, the roundings of a base's GEMM and of the delta), and repeats its own bits."""
    a, ref = fused_against_torch_ops(tiny_path, data, method, precision, "adapter_kernel")
    if precision == "float32":
        # Under BF16 a gradient entry near zero may change sign with the rounding of the sum,
        # and AdamW's first steps move every entry by about the rate either way: losses only.
        for k in ref._trainable_names():
            x, y = a._adapter_tensors[k], ref._adapter_tensors[k]
            assert (x - y).abs().max() <= 1e-3 * y.abs().max(), k


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("precision", ["float32", "float16", "bfloat16"])
def test_fused_layers_agree_with_torch_ops(tiny_path, data, method, precision):
    """layer_kernel='fused' trains what the torch ops train, up to FP32 summation order in the
    norms and the loss (and, under FP16/BF16, the projections' input gradients summed in that
    dtype and SwiGLU's single rounding), and repeats its own bits."""
    a, ref = fused_against_torch_ops(tiny_path, data, method, precision, "layer_kernel")
    assert a._state.losses != ref._state.losses or precision == "float32"   # the fused path did run


@pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="needs nvidia-cudnn-frontend")
@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("precision", ["float16", "bfloat16"])
def test_cudnn_attention_agrees_with_torch_ops(tiny_path, data, method, precision):
    """attention_kernel='cudnn' trains what the torch ops train, repeats its own bits, and a
    recorded CUDA graph's updates give the eager run's bits."""
    from aner.kernels import cudnn_attention
    cudnn_attention._graphs.clear()
    a, ref = fused_against_torch_ops(tiny_path, data, method, precision, "attention_kernel", "cudnn")
    assert {key[0] for key in cudnn_attention._graphs} == {"forward", "backward"}   # cuDNN's attention ran
    tr, va = data
    src = select(gen.import_model(tiny_path, device=DEV), "float32", method)
    graphed = src.with_training_profile(precision=precision, attention_kernel="cudnn", cuda_graphs=True)
    b = graphed.fine_tune(tr, va, **FUSED_RUN)
    assert tensors_equal(a, b) and a._state.losses == b._state.losses


@pytest.mark.parametrize("storage,method,nf4_kernel", [("float32", "full", None), ("float32", "lora", None),
                                                        ("nf4_double_quant", "lora", "decoded"),
                                                        ("nf4_double_quant", "lora", "decoded_kept")])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("layer_kernel", ["torch", "fused"])
def test_kept_estimate_covers_what_backward_keeps(tiny_path, data, storage, method, nf4_kernel, precision,
                                                  layer_kernel):
    """On the GPU, under each policy and either layer path, the admission's estimate of what
    backward keeps (plus the decoded weights alive at once) is at least what autograd saves. The
    fused loss saves no logits, which the estimate counts as the chunk alive during the loss: on
    this tiny model they are most of it, so there the estimate without them is bounded from above
    too (with the fused layers, attention and adapters, what it counts is what they keep)."""
    base = gen.import_model(tiny_path, device=DEV)
    kernels = dict(adapter_kernel="fused", nf4_kernel=nf4_kernel) if storage != "float32" else {}
    if storage != "float32":
        base = base.nf4(double_quant=True)
    src = base if method == "full" else base.lora(targets=list(ALIASES), rank=2)
    src = src.with_training_profile(precision=precision, layer_kernel=layer_kernel, **kernels)
    _, kept = train_counting_saved(src, data, micro_batch=4)
    tokens = max(len(e.tokens) for e in data[0].items)
    estimate = src._kept_bytes(4, tokens) + src.memory_summary().dequant_tile_bytes
    assert kept <= estimate
    if storage != "float32" and layer_kernel == "fused" and precision == "bfloat16":
        loss = loss_chunk_bytes(src.config(), 4 * tokens, 2, True, False)
        assert estimate - loss <= 1.25 * kept, (estimate, loss, kept)


def test_cuda_graphs_refuse_host_tiles(tiny_path):
    m = gen.import_model(tiny_path, device=DEV)
    with pytest.raises(ConfigError, match="cannot record nf4_kernel='host_tiled'"):
        m.nf4().with_training_profile(cuda_graphs=True)
    with pytest.raises(ConfigError, match="cannot record nf4_kernel='host_tiled'"):
        m.with_training_profile(cuda_graphs=True).nf4()


def test_gpu_recipe_checks_and_trains_with_its_profile(tiny_path, tmp_path):
    """examples/recipes/qlora_gpu.toml, the throughput table's profile, from the command line over
    the tiny model: `check` finds nothing (its profile's keys fit together), `run` trains with that
    profile and publishes its checkpoint and adapter package."""
    from aner.cli import main
    for part in ("recipes", "data"):
        shutil.copytree(EXAMPLES / part, tmp_path / "examples" / part)
    recipe = tmp_path / "examples" / "recipes" / "qlora_gpu.toml"
    sets = ["--set", f"model.path={json.dumps(str(tiny_path))}", "--set", "training.steps=2",
            "--set", "data.context=64"]
    assert main(["check", str(recipe), *sets]) == 0
    assert main(["run", str(recipe), *sets]) == 0
    out = tmp_path / "out" / "qlora_gpu"
    manifest = json.loads((out / "checkpoint" / "manifest.json").read_text())
    assert manifest["counters"]["updates"] == 2 and manifest["storage"] == "nf4_double_quant"
    assert {k: manifest["profile"][k] for k in ("precision", "nf4_kernel", "cuda_graphs", "adapter_kernel",
                                                "layer_kernel")} == \
        {"precision": "bfloat16", "nf4_kernel": "decoded_kept", "cuda_graphs": True, "adapter_kernel": "fused",
         "layer_kernel": "fused"}
    assert (out / "adapter-package" / "base.gguf").is_file()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_trained_projection_keeps_its_weight_gradient_in_fp32(dtype):
    """A trained FP32 weight under a low-precision policy: the output and the input gradient are
    autocast's bits, and the weight gradient g^T x is summed in FP32 and never rounded to `dtype`:
    within 1e-6 of float64, where autocast's, rounded, is at least 30x further off."""
    from aner.model.llama import Dense
    g = torch.Generator(device=DEV).manual_seed(0)
    w = (torch.randn(96, 64, device=DEV, generator=g) * 0.05).requires_grad_(True)
    x = torch.randn(3, 50, 64, device=DEV, generator=g).requires_grad_(True)   # FP32, as the torch norms give
    dy = torch.randn(3, 50, 96, device=DEV, generator=g).to(dtype)
    with torch.autocast("cuda", dtype=dtype):
        y, ref_y = Dense(w)(x), torch.nn.functional.linear(x, w)
    dx, dw = torch.autograd.grad(y, [x, w], dy)
    ref_dx, ref_dw = torch.autograd.grad(ref_y, [x, w], dy)
    assert torch.equal(y, ref_y) and torch.equal(dx, ref_dx) and dw.dtype == torch.float32
    want = dy.flatten(0, 1).double().T @ x.to(dtype).flatten(0, 1).double()
    magnitude = (dy.flatten(0, 1).double().abs().T @ x.to(dtype).flatten(0, 1).double().abs()).max()
    err = ((dw.double() - want).abs() / magnitude).max().item()
    err_rounded = ((ref_dw.double() - want).abs() / magnitude).max().item()
    assert err <= 1e-6 and err_rounded >= 30 * err, (err, err_rounded)


@pytest.mark.parametrize("laid", ["apart", "side_by_side"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_trained_projections_of_one_input_are_one_product(dtype, laid):
    """Trained weights that read one x (q, k, v) are one product of their casts laid one under
    another: each output within one rounding of the float64 product. Their gradients handed back
    apart: each weight's gradient is that of the weight on its own, bit for bit, and the input's
    one chain of products (one rounding of the running sum per weight). Handed back side by side
    (as the fused RoPE lays them out): one product each, the input gradient within one rounding of
    its float64 sum, the weights' within FP32 accuracy."""
    from aner.model.llama import Dense
    g = torch.Generator(device=DEV).manual_seed(0)
    ws = [(torch.randn(n, 64, device=DEV, generator=g) * 0.05).requires_grad_(True) for n in (96, 32, 32)]
    x = torch.randn(3, 50, 64, device=DEV, generator=g).requires_grad_(True)
    dy = torch.randn(3, 50, 160, device=DEV, generator=g).to(dtype)
    dys = list(dy.split([96, 32, 32], dim=-1)) if laid == "side_by_side" else \
        [t.contiguous() for t in dy.split([96, 32, 32], dim=-1)]
    with torch.autocast("cuda", dtype=dtype):
        ys = Dense.joint(x, [Dense(w) for w in ws])
        alone = [Dense(w)(x) for w in ws]
    grads = torch.autograd.grad(ys, [x, *ws], dys)
    eps = 2.0 ** (-10 if dtype == torch.float16 else -7)
    x_op, w_op = x.detach().to(dtype).double(), [w.detach().to(dtype).double() for w in ws]
    for y, w in zip(ys, w_op):
        want = x_op @ w.T
        assert y.dtype == dtype and ((y.double() - want).abs() <= eps * (x_op.abs() @ w.abs().T) + 1e-30).all()
    want = sum(d.double() @ w for d, w in zip(dys, w_op))
    terms = sum(d.double().abs() @ w.abs() for d, w in zip(dys, w_op))
    assert grads[0].dtype == torch.float32
    assert ((grads[0].double() - want).abs() <= (len(ws) if laid == "apart" else 1) * eps * terms + 1e-30).all()
    for y1, w, dw, d in zip(alone, ws, grads[1:], dys):
        assert dw.dtype == torch.float32 and dw.shape == w.shape
        if laid == "apart":
            assert torch.equal(dw, torch.autograd.grad(y1, w, d, retain_graph=True)[0])
        want = d.flatten(0, 1).double().T @ x_op.flatten(0, 1)
        scale = d.flatten(0, 1).double().abs().T @ x_op.flatten(0, 1).abs()
        assert ((dw.double() - want).abs() <= 1e-5 * scale + 1e-30).all()

"""The adapter family: LoRA, rsLoRA, LoRA-FA, TinyLoRA — selection, numerics, resume and export.

Closed forms are checked against float64 references built here from the stored tensors; exports
against llama.cpp (adapter GGUF) and against Hugging Face transformers + peft (PEFT directory).
"""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from aner import gen
from aner.adapters import registry
from aner.adapters.lora import LoRALinear
from aner.adapters.tinylora import TinyLoRALinear
from aner.errors import ArtifactError, ConfigError, FormatError, ResourceError
from aner.formats.gguf import read_gguf
from aner.model import names
from aner.model.build import build
from aner.model.llama import Dense
from aner.train.loop import RunConfig, TrainState, window
from aner.train.loss import IGNORE, batch
from conftest import EXAMPLES
from fixtures import LLAMA_TOL as TOL, Shape, assert_same_state, llama_logits, tokens

SELECT = {
    "lora": lambda b, **kw: b.lora(**kw),
    "rslora": lambda b, **kw: b.rs_lora(**kw),
    "lora_fa": lambda b, **kw: b.lora_fa(**kw),
    "tinylora": lambda b, **kw: b.tinylora(**kw),
    "tinylora_per_target": lambda b, **kw: b.tinylora(sharing="per_target", **kw),
}


@pytest.fixture(scope="module")
def tiny_path(tiny_factory):
    return tiny_factory(Shape(tied=False), "f32")


@pytest.fixture(scope="module")
def base(tiny_path):
    return gen.import_model(tiny_path)


@pytest.fixture(scope="module")
def data(base):
    tr = gen.supervised_csv(base, EXAMPLES / "data" / "training.csv", role="training", context=64)
    va = gen.supervised_csv(base, EXAMPLES / "data" / "validation.csv", role="validation", context=64)
    return tr, va


def trainable_names(model):
    return set(model._trainable_names())


def randomized(model, rng):
    """The model's adapter tensors with every trainable tensor replaced by fresh random values."""
    tensors = dict(model._adapter_tensors)
    for n in trainable_names(model):
        tensors[n] = torch.from_numpy(rng.standard_normal(tuple(tensors[n].shape)).astype(np.float32)) * 0.1
    return tensors


def reference_delta(method, target, t) -> torch.Tensor:
    """float64 delta W of one target from the stored tensors, written out from the method's definition."""
    cfg = method.config
    if cfg.method in ("lora", "rslora", "lora_fa"):
        s = cfg.alpha / cfg.rank if cfg.method != "rslora" else cfg.alpha / np.sqrt(cfg.rank)
        return s * t[f"{target}.lora_b"].double() @ t[f"{target}.lora_a"].double()
    assert cfg.method == "tinylora"
    v = t["tinylora.v"] if cfg.sharing == "global" else t[f"{target}.tinylora_v"]
    p = t[f"{target}.tinylora_p"].double()
    r = sum(float(v[i]) * p[i] for i in range(cfg.parameters))            # R = sum_i v_i P_i
    u, s, vt = (t[f"{target}.tinylora_{k}"].double() for k in ("u", "s", "vt"))
    return u @ torch.diag(s) @ r @ vt


# ---- selection -------------------------------------------------------------------------------

def test_selection_forms_and_defaults(base):
    qv = tuple(f"blk.{i}.attn_{p}.weight" for i in range(2) for p in ("q", "v"))
    fa = base.lora_fa()
    assert fa.method() == "lora_fa" and base.method() == "full"
    c = fa._method.config
    assert (c.targets, c.rank, c.alpha, c.seed, c.scale) == (qv, 8, 16.0, 0, 2.0)
    # B only: q (64 x 8) and v (32 x 8) in each of 2 layers
    assert fa.trainable_parameters() == 2 * (64 * 8 + 32 * 8)
    assert trainable_names(fa) == {f"{t}.lora_b" for t in qv}

    tl = base.tinylora()
    c = tl._method.config
    assert tl.method() == "tinylora"
    assert (c.targets, c.rank, c.parameters, c.sharing, c.seed, c.alpha, c.scale) == (qv, 8, 13, "global", 0, 1.0, 1.0)
    assert tl.trainable_parameters() == 13 and trainable_names(tl) == {"tinylora.v"}
    assert not tl._adapter_tensors["tinylora.v"].any()

    per = base.tinylora(sharing="per_target")
    assert per.trainable_parameters() == 4 * 13
    assert trainable_names(per) == {f"{t}.tinylora_v" for t in qv}

    # a target list alone, and the complete configuration positionally
    assert base.lora_fa(["attention.k_proj"])._method.config.targets == ("blk.0.attn_k.weight", "blk.1.attn_k.weight")
    c = base.lora_fa(["blk.1.ffn_up.weight"], 4, 8.0, 3)._method.config
    assert (c.method, c.targets, c.rank, c.alpha, c.seed, c.scale) == \
        ("lora_fa", ("blk.1.ffn_up.weight",), 4, 8.0, 3, 2.0)
    c = base.tinylora(["mlp.down_proj"], 4, 7, 3, "per_target")._method.config
    assert (c.targets, c.rank, c.parameters, c.seed, c.sharing) == (
        ("blk.0.ffn_down.weight", "blk.1.ffn_down.weight"), 4, 7, 3, "per_target")
    c = base.rs_lora(["attention.o_proj"], 4, 8.0, 1)._method.config
    assert base.rs_lora()._method.config.method == "rslora" and c.scale == 8.0 / 2.0
    assert base.lora(rank=4)._method.config.scale == 4.0


def test_selection_refusals(base, data):
    tr, va = data
    for kind in SELECT:
        select = SELECT[kind]
        for bad, msg in [(dict(rank=0), "rank=0"), (dict(rank=257), "rank=257"), (dict(rank=True), "rank=True"),
                         (dict(rank=33, targets=["attention.k_proj"]), "rank=33 exceeds target 'blk.0.attn_k.weight'"),
                         (dict(targets=["attention.q_proj", "attention.q_proj"]), "listed twice"),
                         (dict(targets=["attention.q_proj", "blk.0.attn_q.weight"]), "already selected by an alias"),
                         (dict(targets=["blk.0.attn_norm.weight"]), "neither a projection alias"),
                         (dict(targets=["output.weight"]), "neither a projection alias"),
                         (dict(targets=[]), "0 entries"),
                         (dict(targets=["blk.0.attn_q.weight"] * 257), "257 entries"),
                         (dict(seed=-1), "seed=-1")]:
            with pytest.raises(ConfigError, match=msg):
                select(base, **bad)
    for select in (base.lora_fa, base.rs_lora):
        for alpha in (0, -1.0, float("inf"), "16"):
            with pytest.raises(ConfigError, match="alpha="):
                select(alpha=alpha)
    for parameters in (0, 4097, 1.5, True, "13"):
        with pytest.raises(ConfigError, match=f"parameters={parameters!r}.*1..4096"):
            base.tinylora(parameters=parameters)
    for sharing in ("layer", None, "GLOBAL"):
        with pytest.raises(ConfigError, match=f"sharing={sharing!r}; accepted: 'global', 'per_target'"):
            base.tinylora(sharing=sharing)
    with pytest.raises(TypeError):
        base.tinylora(alpha=4.0)  # TinyLoRA has no alpha
    # reconfiguration: only an unchanged imported base accepts a configuration
    for first in SELECT.values():
        for second in ("lora", "rs_lora", "lora_fa", "tinylora"):
            adapted = first(base, rank=2)
            with pytest.raises(ConfigError, match=f"already has a {adapted.method()} adapter"):
                getattr(adapted, second)()
    trained = base.fine_tune(tr, va, steps=1, rate=1e-6)
    for second in ("lora_fa", "tinylora"):
        with pytest.raises(ConfigError, match="full weights were trained"):
            getattr(trained, second)()
    with pytest.raises(FormatError, match="'dora' is not known"):
        registry.restore({"method": "dora", "targets": [], "rank": 1, "alpha": 1.0, "seed": 0})


def test_tinylora_selection_is_admitted_against_the_budget(tiny_path):
    small = gen.import_model(tiny_path, max_memory_bytes=48 << 20)
    # P alone: 4 targets x 4096 x 32 x 32 FP32 = 64 MiB
    with pytest.raises(ResourceError, match="tinylora selection .* needs an estimated"):
        small.tinylora(rank=32, parameters=4096)
    assert small.tinylora(rank=4, parameters=64).trainable_parameters() == 64


# ---- closed forms ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(SELECT))
def test_delta_matches_float64_closed_form(base, kind):
    """Each wrapper's output and each method's delta/lora_factors against s B A or U S R V^T in float64."""
    rng = np.random.default_rng()
    model = SELECT[kind](base, targets=["attention.q_proj", "attention.k_proj", "mlp.up_proj"], rank=4,
                         seed=int(rng.integers(1 << 30)))
    method = model._method
    t = randomized(model, rng)
    checked = 0
    for target in method.config.targets:
        w = base._weights[target]
        ref = reference_delta(method, target, t)
        assert ref.abs().max() > 1e-3  # a real delta, not zeros
        x = torch.from_numpy(rng.standard_normal((3, 5, w.shape[1])).astype(np.float32))
        out = method.wrap(target, Dense(w), t)(x).double()
        expected = x.double() @ (w.double() + ref).t()
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
        torch.testing.assert_close(method.delta(target, t).double(), ref, rtol=1e-5,
                                   atol=1e-6 * float(ref.abs().max()))
        a, b = method.lora_factors(target, t)
        assert a.shape == (4, w.shape[1]) and b.shape == (w.shape[0], 4)
        torch.testing.assert_close(method.config.scale * b.double() @ a.double(), ref, rtol=1e-5,
                                   atol=1e-6 * float(ref.abs().max()))
        checked += 1
    assert checked == 6


def test_tinylora_frozen_factors_are_the_truncated_svd(base):
    rank = 6
    model = base.tinylora(["attention.q_proj", "attention.k_proj", "mlp.down_proj"], rank=rank)
    t = model._adapter_tensors
    checked = 0
    for target in model._method.config.targets:
        w = base._weights[target].double()
        u_ref, s_ref, vt_ref = torch.linalg.svd(w, full_matrices=False)
        u, s, vt = (t[f"{target}.tinylora_{k}"] for k in ("u", "s", "vt"))
        assert u.dtype == s.dtype == vt.dtype == torch.float32
        assert u.shape == (w.shape[0], rank) and s.shape == (rank,) and vt.shape == (rank, w.shape[1])
        # one FP32 rounding of the float64 SVD (within one FP32 ulp: LAPACK's last float64 bits may vary)
        torch.testing.assert_close(s.double(), s_ref[:rank], rtol=2.0 ** -23, atol=0)
        signs = torch.sign((u.double() * u_ref[:, :rank]).sum(0))       # singular vectors up to sign
        torch.testing.assert_close(u.double(), u_ref[:, :rank] * signs, rtol=0, atol=2e-7)
        torch.testing.assert_close(vt.double(), vt_ref[:rank] * signs[:, None], rtol=0, atol=2e-7)
        torch.testing.assert_close(u.double().t() @ u.double(), torch.eye(rank, dtype=torch.float64),
                                   rtol=0, atol=1e-6)
        checked += 1
    assert checked == 6


def test_tinylora_projections_are_seeded_normal(base):
    rank, n = 8, 64
    a = base.tinylora(["attention.q_proj", "attention.v_proj"], rank=rank, parameters=n, seed=4)
    p = a._adapter_tensors["blk.0.attn_q.weight.tinylora_p"]
    assert p.shape == (n, rank, rank) and p.dtype == torch.float32
    # 4,096 N(0, 1/r) draws: the sample std is within 5% (about 4.5 standard errors), the mean near 0
    assert abs(float(p.double().std()) * np.sqrt(rank) - 1) < 0.05
    assert abs(float(p.double().mean())) < 4 / np.sqrt(p.numel() * rank)
    # same seed -> same bits whatever other targets are chosen; other seed or target -> other draws
    alone = base.tinylora(["blk.0.attn_q.weight"], rank=rank, parameters=n, seed=4)
    assert torch.equal(alone._adapter_tensors["blk.0.attn_q.weight.tinylora_p"], p)
    assert not torch.equal(base.tinylora(["attention.q_proj"], rank=rank, parameters=n, seed=5)
                           ._adapter_tensors["blk.0.attn_q.weight.tinylora_p"], p)
    assert not torch.equal(a._adapter_tensors["blk.1.attn_q.weight.tinylora_p"], p)
    # v starts at zero: a fresh TinyLoRA model is exactly the base
    toks = tokens(16, base.config().vocab_size, seed=5)
    assert np.array_equal(a.logits(toks), base.logits(toks))


class _OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor an aten operation returns."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(o, torch.Tensor):
                self.shapes.append(tuple(o.shape))
        return out


class _Zero(nn.Module):
    def __init__(self, rows):
        super().__init__()
        self.rows = rows

    def forward(self, x):
        return x.new_zeros(*x.shape[:-1], self.rows)


def test_tinylora_forward_never_forms_a_dense_delta(base):
    model = base.tinylora(["blk.0.ffn_up.weight"], rank=4, parameters=13)
    t = randomized(model, np.random.default_rng())
    wrapper = model._method.wrap("blk.0.ffn_up.weight", _Zero(96), t)
    x = torch.randn(1, 2, 64)
    with _OutputShapes() as seen:
        y = wrapper(x)
    assert y.shape == (1, 2, 96) and seen.shapes
    assert max(int(np.prod(s)) for s in seen.shapes) < 96 * 64 // 8, seen.shapes  # (..., r), (r, r), (..., out)
    with _OutputShapes() as dense:
        model._method.delta("blk.0.ffn_up.weight", t)  # the merge path does form it, and is seen doing so
    assert (96, 64) in dense.shapes


# ---- gradients -------------------------------------------------------------------------------

def test_gradcheck_lora_and_tinylora_wrappers():
    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    f64 = dict(dtype=torch.float64)
    w = torch.randn(6, 5, generator=g, **f64)
    x = torch.randn(2, 3, 5, generator=g, **f64).requires_grad_()
    a = torch.randn(3, 5, generator=g, **f64).requires_grad_()
    b = torch.randn(6, 3, generator=g, **f64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, a, b: LoRALinear(Dense(w), a, b, 1.7)(x), (x, a, b))
    # LoRA-FA: the same wrapper with A a constant; only B (and the input) carry gradients
    assert torch.autograd.gradcheck(lambda x, b: LoRALinear(Dense(w), a.detach(), b, 0.5)(x), (x, b))

    u = torch.linalg.qr(torch.randn(6, 3, generator=g, **f64))[0]
    s = torch.rand(3, generator=g, **f64) + 0.5
    vt = torch.linalg.qr(torch.randn(5, 3, generator=g, **f64))[0].t()
    p = torch.randn(4, 3, 3, generator=g, **f64).requires_grad_()
    v = torch.randn(4, generator=g, **f64).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, v, p: TinyLoRALinear(Dense(w), u, s, vt, p, v)(x), (x, v, p))
    # a global vector shared by two targets collects both targets' gradients
    p2 = torch.randn(4, 3, 3, generator=g, **f64)
    w2 = torch.randn(6, 5, generator=g, **f64)

    def two_targets(v):
        return (TinyLoRALinear(Dense(w), u, s, vt, p.detach(), v)(x.detach())
                + TinyLoRALinear(Dense(w2), u, s, vt, p2, v)(x.detach()) ** 2)
    assert torch.autograd.gradcheck(two_targets, (v,))


def test_lora_fa_precondition_against_float64_by_hand(base):
    """g_B <- s^-2 g_B (A A^T + 1e-8 I)^-1, the 2 x 2 inverse written out (adjugate / determinant)."""
    rng = np.random.default_rng()
    model = base.lora_fa(["attention.q_proj", "attention.v_proj"], rank=2, alpha=5.0)
    method, t = model._method, model._adapter_tensors
    grads = {n: torch.from_numpy(rng.standard_normal(tuple(t[n].shape)).astype(np.float32))
             for n in trainable_names(model)}
    raw = {n: g.clone() for n, g in grads.items()}
    method.precondition(grads, t)
    s = 5.0 / 2
    checked = 0
    for target in method.config.targets:
        a = t[f"{target}.lora_a"].double()
        m = a @ a.t() + 1e-8 * torch.eye(2, dtype=torch.float64)
        (p, q), (r, d) = m.tolist()
        inv = torch.tensor([[d, -q], [-r, p]], dtype=torch.float64) / (p * d - q * r)
        ref = raw[f"{target}.lora_b"].double() @ inv / s ** 2
        got = grads[f"{target}.lora_b"]
        assert got.dtype == torch.float32 and ref.abs().max() > 1e-3
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
        assert not torch.allclose(got.double(), raw[f"{target}.lora_b"].double(), rtol=0.1)
        # the saved preconditioner is that inverse, in FP32
        torch.testing.assert_close(t[f"{target}.lora_fa_precond"].double(), inv, rtol=1e-5,
                                   atol=1e-6 * float(inv.abs().max()))
        checked += 1
    assert checked == 4


def test_lora_fa_training_preconditions_before_the_moments(base, data):
    """After one update (no clipping) Adam's first moment is (1 - b1) * the preconditioned gradient of
    the window's loss, recomputed here by an independent forward/backward and float64 algebra."""
    tr, va = data
    src = base.lora_fa(["blk.0.attn_q.weight", "blk.1.attn_v.weight"], rank=3, alpha=6.0, seed=2)
    src = src._derive(adapter_tensors=randomized(src, np.random.default_rng()))  # B away from zero
    tuned = src.fine_tune(tr, va, steps=1, micro_batch=2, rate=1e-3, seed=3, clip_norm=0)
    tensors = {n: v.clone() for n, v in src._adapter_tensors.items()}
    leaves = {n: tensors[n].requires_grad_(True) for n in trainable_names(src)}
    model = build(base.config(), base._weights, src._method, tensors)
    examples = [tr.items[i] for i in window(TrainState(RunConfig(micro_batch=2, seed=3), "", ""), tr.examples())]
    inputs, targets, _ = batch(examples, "cpu")
    total = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum")
    (total / sum(e.scored for e in examples)).backward()
    assert set(tuned._state.moments) == set(leaves) == {f"{t}.lora_b" for t in src._method.config.targets}
    s = 6.0 / 3
    for target in src._method.config.targets:
        name = f"{target}.lora_b"
        a = tensors[f"{target}.lora_a"].double()
        ref = leaves[name].grad.double() @ torch.linalg.inv(a @ a.t()) / s ** 2
        m, v = tuned._state.moments[name]
        torch.testing.assert_close(m.double() / 0.1, ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))
        # A frozen: bitwise unchanged, no moments; the preconditioner unchanged
        for part in ("lora_a", "lora_fa_precond"):
            assert torch.equal(tuned._adapter_tensors[f"{target}.{part}"], src._adapter_tensors[f"{target}.{part}"])
        assert not torch.equal(tuned._adapter_tensors[name], src._adapter_tensors[name])


def test_memory_split_on_tiny(base, data):
    tr, va = data
    fa = base.lora_fa(["blk.0.attn_q.weight", "blk.0.attn_k.weight"], rank=4)
    m = fa.memory_summary()
    assert (m.adapter_bytes, m.trainable_bytes, m.optimizer_bytes) == (4 * 4 * (64 + 32),) * 2 + (0,)
    assert m.frozen_adapter_bytes == 4 * (2 * 4 * 64 + 2 * 4 * 4)   # A (4 x 64) and 4 x 4 preconditioner each
    assert fa.fine_tune(tr, va, steps=1).memory_summary().optimizer_bytes == 2 * 4 * 4 * (64 + 32)
    tl = base.tinylora(["blk.0.attn_q.weight", "blk.1.ffn_down.weight"], rank=4, parameters=13, sharing="per_target")
    m = tl.memory_summary()
    assert (m.adapter_bytes, m.trainable_bytes) == (2 * 13 * 4,) * 2
    #   U (64 x 4) S (4) V^T (4 x 64) P (13 x 4 x 4)   +   U (64 x 4) S (4) V^T (4 x 96) P (13 x 4 x 4)
    assert m.frozen_adapter_bytes == 4 * ((256 + 4 + 256 + 208) + (256 + 4 + 384 + 208))


# ---- exact resume ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["rslora", "lora_fa", "tinylora", "tinylora_per_target"])
def test_exact_resume(base, data, tmp_path, kind):
    """One update + checkpoint + load + one update == two updates, bit for bit; fixed tensors round-trip."""
    tr, va = data
    src = SELECT[kind](base, rank=4, seed=5)
    before = {k: v.clone() for k, v in src._adapter_tensors.items()}
    kw = dict(micro_batch=2, accumulation=2, rate=1e-3, seed=9)
    two = src.fine_tune(tr, va, steps=2, **kw)
    one = src.fine_tune(tr, va, steps=1, **kw)
    one.checkpoint(tmp_path / "ck")
    restored = gen.load_pretrained_checkpoint(tmp_path / "ck")
    assert restored.summary() == one.summary() and restored.method() == src.method()
    assert type(restored._method) is type(src._method) and restored._method.config == src._method.config
    fixed = set(before) - trainable_names(src)
    assert restored._adapter_tensors.keys() == before.keys() and bool(fixed) == (kind != "rslora")
    assert all(torch.equal(restored._adapter_tensors[k], before[k]) for k in fixed)
    resumed = restored.resume(tr, va, steps=1)
    assert_same_state(two, resumed)
    assert two.updates() == 2 and set(two._state.moments) == trainable_names(src)
    for k in before:
        assert torch.equal(src._adapter_tensors[k], before[k]), k      # the source is unchanged
        changed = not torch.equal(two._adapter_tensors[k], before[k])
        assert changed == (k in trainable_names(src)), k                # only the trainable tensors moved


# ---- exports ---------------------------------------------------------------------------------

def rope_permute(weights, n_head):
    """llama.cpp convert_hf_to_gguf's `LlamaModel.permute` (HF -> GGUF rows), as written there."""
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def hf_rows(gguf_rows, n_head):
    """GGUF rows -> HF rows by inverting llama.cpp's permutation as an index map (independent of names.py)."""
    index = rope_permute(np.arange(gguf_rows.shape[0]), n_head)   # gguf row j holds hf row index[j]
    out = np.empty_like(gguf_rows)
    out[index] = gguf_rows
    return out


def test_rope_to_hf_inverts_llama_cpp_permute():
    rng = np.random.default_rng()
    for rows, cols, n_head in [(576, 576, 9), (192, 576, 3), (64, 7, 4), (32, 1, 2)]:
        hf = rng.standard_normal((rows, cols)).astype(np.float32)
        gguf_w = rope_permute(hf, n_head)
        assert not np.array_equal(gguf_w, hf)
        assert np.array_equal(names.rope_to_hf(gguf_w, n_head), hf)
        assert np.array_equal(hf_rows(gguf_w, n_head), hf)
        assert torch.equal(names.rope_to_hf(torch.from_numpy(gguf_w), n_head), torch.from_numpy(hf))


def hf_llama(model):
    """A transformers LlamaForCausalLM holding the model's base weights (FP32, eager attention)."""
    import transformers
    c = model.config()
    hc = transformers.LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.ffn_dim, num_hidden_layers=c.n_layer,
        num_attention_heads=c.n_head, num_key_value_heads=c.n_kv_head, head_dim=c.head_dim,
        max_position_embeddings=c.context_length, rms_norm_eps=c.rms_eps,
        rope_parameters={"rope_type": "default", "rope_theta": c.rope_base},
        tie_word_embeddings=c.tied_embeddings, attention_bias=False, mlp_bias=False, hidden_act="silu",
        attn_implementation="eager")
    hf = transformers.LlamaForCausalLM(hc).to(torch.float32).eval()
    assert hf.config._attn_implementation == "eager"
    state = {}
    for name, w in model._weights.items():
        w = w.numpy()
        if name.endswith(("attn_q.weight", "attn_k.weight")):
            w = hf_rows(w, c.n_head if "attn_q" in name else c.n_kv_head)
        state[names.hf_name(name)] = torch.from_numpy(np.ascontiguousarray(w))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if c.tied_embeddings else set()), missing
    if c.tied_embeddings:
        hf.tie_weights()
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    return hf


@torch.no_grad()
def hf_logits(hf, toks):
    return hf(torch.tensor([toks])).logits[0].float().numpy()


def peft_logits(base, directory, toks):
    from peft import PeftModel
    hf = PeftModel.from_pretrained(hf_llama(base), str(directory)).eval()
    return hf_logits(hf, toks)


HF_MODULE = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj"}

EXPORTS = {   # method, targets, PEFT target_modules: short names for whole kinds, else exact module paths
    "lora": ("lora", ["attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.down_proj"],
             ["down_proj", "k_proj", "q_proj", "v_proj"]),
    "rslora": ("rslora", ["attention.q_proj", "attention.k_proj"], ["k_proj", "q_proj"]),
    "lora_fa": ("lora_fa", ["blk.0.attn_q.weight", "blk.1.attn_k.weight", "blk.1.ffn_gate.weight"],
                ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.k_proj", "model.layers.1.mlp.gate_proj"]),
    "tinylora": ("tinylora", ["attention.q_proj", "attention.k_proj", "attention.o_proj", "mlp.up_proj"],
                 ["k_proj", "o_proj", "q_proj", "up_proj"]),
    "tinylora_per_target": ("tinylora_per_target", ["blk.1.attn_q.weight", "blk.0.attn_k.weight"],
                            ["model.layers.0.self_attn.k_proj", "model.layers.1.self_attn.q_proj"]),
}


@pytest.fixture(scope="module")
def hf_base_agrees(base):
    """The Hugging Face model of the base weights agrees with our base (so the table and permutation are right)."""
    toks = tokens(32, base.config().vocab_size, seed=11)
    err = np.abs(hf_logits(hf_llama(base), toks) - base.logits(toks)).max()
    assert err <= TOL, err
    return err


@pytest.mark.parametrize("case", list(EXPORTS))
def test_exports_agree_with_llama_cpp_and_peft(base, data, tiny_path, tmp_path, hf_base_agrees, case):
    tr, va = data
    kind, targets, modules = EXPORTS[case]
    rank = 4
    tuned = SELECT[kind](base, targets=targets, rank=rank, seed=1).fine_tune(tr, va, steps=2, rate=5e-3, seed=1)
    cfg = tuned._method.config
    toks = tokens(32, base.config().vocab_size, seed=3)
    ours = tuned.logits(toks)
    assert np.abs(ours - base.logits(toks)).max() > 1e-3  # training changed the outputs
    # llama.cpp LoRA GGUF
    manifest = tuned.save_adapter(tmp_path / "adapter")
    g = read_gguf(manifest.adapter_path)
    assert g.get("adapter.lora.alpha") == pytest.approx(cfg.scale * rank, rel=1e-7)
    assert g.get("aner.method") == cfg.method and manifest.method == cfg.method
    assert sorted(g.tensors) == sorted(f"{t}.lora_{p}" for t in cfg.targets for p in "ab")
    err = np.abs(llama_logits(tiny_path, toks, manifest) - ours).max()
    assert err <= TOL, err
    merged = tuned.save_model(tmp_path / "merged.gguf")
    assert np.abs(llama_logits(merged, toks) - ours).max() <= TOL
    # PEFT directory on transformers
    out = tuned.save_peft_adapter(tmp_path / "peft")
    assert sorted(p.name for p in (tmp_path / "peft").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    pc = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert (pc["peft_type"], pc["task_type"], pc["r"]) == ("LORA", "CAUSAL_LM", rank)
    assert pc["use_rslora"] == (kind == "rslora")
    assert pc["lora_alpha"] == pytest.approx(cfg.alpha if kind == "rslora" else cfg.scale * rank)
    assert pc["target_modules"] == modules
    from safetensors import safe_open
    with safe_open(str(tmp_path / "peft" / "adapter_model.safetensors"), "pt") as f:
        assert f.metadata()["aner.format"] == "aner.peft-adapter" and f.metadata()["aner.version"] == "1"
        assert f.metadata()["aner.base.source_sha256"] == base.source_sha256()
        expected = {f"base_model.model.model.layers.{t.split('.')[1]}.{HF_MODULE[t.split('.')[2]]}.lora_{p}.weight"
                    for t in cfg.targets for p in "AB"}
        assert set(f.keys()) == expected and len(expected) == 2 * len(cfg.targets)
    err = np.abs(peft_logits(base, out, toks) - ours).max()
    assert err <= TOL, err
    with pytest.raises(ArtifactError, match="already exists"):
        tuned.save_peft_adapter(tmp_path / "peft")


def test_peft_export_refusals(base, data, tmp_path):
    tr, va = data
    with pytest.raises(ConfigError, match="no adapter"):
        base.fine_tune(tr, va, steps=1, rate=1e-6).save_peft_adapter(tmp_path / "p")
    assert not (tmp_path / "p").exists()


# ---- the real model --------------------------------------------------------------------------

SMOL_TOKENS = tokens(32, 49152, seed=2)


@pytest.fixture(scope="module")
def smol(smollm2_f32, tmp_path_factory):
    """The F32 SmolLM2, the example training rows (one update reads one) and a one-row validation set
    (the run's closing evaluation stays one forward), and the base logits of SMOL_TOKENS."""
    base = gen.import_model(smollm2_f32)
    tr = gen.supervised_csv(base, EXAMPLES / "data" / "training.csv", role="training", context=64)
    rows = (EXAMPLES / "data" / "validation.csv").read_text().splitlines()
    one = tmp_path_factory.mktemp("smol-data") / "validation-1.csv"
    one.write_text("\n".join(rows[:2]) + "\n")
    va = gen.supervised_csv(base, one, role="validation", context=64)
    assert va.examples() == 1
    return base, tr, va, base.logits(SMOL_TOKENS)


def test_smollm2_lora_fa_seed_memory_and_llama_cpp(smol, smollm2_f32, tmp_path):
    """The seed: first-layer query LoRA-FA rank 2 trains B (576 x 2) = 1,152 numbers and keeps
    A (2 x 576) plus the 2 x 2 preconditioner frozen: (1,152 + 4) x 4 = 4,624 bytes."""
    base, tr, va, base_logits = smol
    fa = base.lora_fa(["blk.0.attn_q.weight"], rank=2)
    m = fa.memory_summary()
    assert fa.trainable_parameters() == 1152
    assert (m.adapter_bytes, m.trainable_bytes, m.frozen_adapter_bytes, m.optimizer_bytes) == (4608, 4608, 4624, 0)
    tuned = fa.fine_tune(tr, va, steps=1, rate=1e-2)
    assert tuned.memory_summary().optimizer_bytes == 2 * 4608
    ours = tuned.logits(SMOL_TOKENS)
    assert np.abs(ours - base_logits).max() > 1e-3
    err = np.abs(llama_logits(smollm2_f32, SMOL_TOKENS, tuned.save_adapter(tmp_path / "fa")) - ours).max()
    assert err <= TOL, err


def test_smollm2_tinylora_seed_memory_and_llama_cpp(smol, smollm2_f32, tmp_path):
    """The seed: 13 globally shared TinyLoRA numbers, 52 trainable bytes, 104 optimizer bytes after training."""
    base, tr, va, base_logits = smol
    tl = base.tinylora(["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight"])
    m = tl.memory_summary()
    assert tl.trainable_parameters() == 13 and (m.adapter_bytes, m.trainable_bytes, m.optimizer_bytes) == (52, 52, 0)
    tuned = tl.fine_tune(tr, va, steps=1, rate=2e-2)
    m = tuned.memory_summary()
    assert (tuned.trainable_parameters(), m.trainable_bytes, m.optimizer_bytes) == (13, 52, 104)
    ours = tuned.logits(SMOL_TOKENS)
    assert np.abs(ours - base_logits).max() > 1e-3
    err = np.abs(llama_logits(smollm2_f32, SMOL_TOKENS, tuned.save_adapter(tmp_path / "tl")) - ours).max()
    assert err <= TOL, err

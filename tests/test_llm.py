"""Deployment through llama.cpp: tokenizer, built-in chat template, load / generate / chat / logits,
LoRA adapters, quantization, and every refusal.

The real model is the embedded SmolLM2-135M-Instruct (F16, `smollm2` fixture); tiny random Llama
files borrow its tokenizer. Independent oracles: the GGUF token list read by gguf-py (not
llama.cpp), a merged base written by numpy (W + s * B @ A) for adapters, our PyTorch forward for
tiny-model parity.
"""
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from aner import AnerError, gen, llm
from aner.data.tokenizer import Tokenizer, engine, identity
from aner.errors import ArtifactError, ConfigError, DataError, FormatError, ResourceError
from aner.formats.gguf import read_gguf, string_field
from aner.formats.publish import sha256_file
from aner.formats.quantize import FORMATS, quantize_gguf
from fixtures import Shape, rewrite, write_random_llama

QUESTION = [{"role": "user", "content": "What color is the clear daytime sky?"}]
ANSWER = {"role": "assistant", "content": "Blue."}
CHATML_PROMPT = "<|im_start|>user\nWhat color is the clear daytime sky?<|im_end|>\n<|im_start|>assistant\n"


@dataclass(frozen=True)
class Manifest:
    """The three attributes `with_adapter` reads from what `save_adapter` returns."""
    adapter_path: Path
    base_sha256: str
    scale: float = 1.0


@pytest.fixture(scope="module")
def smol_tok(smollm2):
    with Tokenizer.from_gguf(smollm2) as t:
        yield t


@pytest.fixture(scope="module")
def smol(smollm2):
    with llm.load(smollm2, context=128, device="cpu") as m:
        yield m


def _without_template(tok_fields):
    return [f for f in tok_fields if f.key != "tokenizer.chat_template"]


# -- tokenizer ----------------------------------------------------------------------------------

def test_tokenizer_reads_the_model_vocabulary(smol_tok, smollm2):
    g = read_gguf(smollm2)
    pieces = g.get("tokenizer.ggml.tokens")
    assert smol_tok.vocab_size == len(pieces) == 49152
    assert smol_tok.bos == g.get("tokenizer.ggml.bos_token_id") == 1
    assert smol_tok.eos == g.get("tokenizer.ggml.eos_token_id") == 2
    assert pieces[smol_tok.eos] == "<|im_end|>"
    assert pieces[smol_tok.eot] == "<|endoftext|>"                # llama.cpp's own pick for SmolLM2
    assert smol_tok.add_bos is False and g.get("tokenizer.ggml.add_bos_token") is False
    assert smol_tok.chat_template == g.get("tokenizer.chat_template")
    # Independent of llama.cpp: GPT-2 byte-level pieces straight from the GGUF token list.
    assert [pieces[i] for i in smol_tok.tokenize("Hello world, again")] == ["Hello", "Ġworld", ",", "Ġagain"]
    # add_special follows tokenizer.ggml.add_bos_token (false here): no BOS either way.
    assert smol_tok.tokenize("Hello", add_special=True) == smol_tok.tokenize("Hello", add_special=False)
    # parse_special: the marker text is one special token, or plain text pieces.
    assert smol_tok.tokenize("<|im_start|>user") == [pieces.index("<|im_start|>"), pieces.index("user")]
    assert len(smol_tok.tokenize("<|im_start|>", parse_special=False)) > 1
    for t in (smol_tok.eos, smol_tok.eot, pieces.index("<|endoftext|>")):
        assert smol_tok.is_end_of_generation(t)
    assert not smol_tok.is_end_of_generation(pieces.index("Hello"))


ROUND_TRIP = [
    "Hello world",
    "  leading and trailing spaces  ",
    "Ünïcödé — 漢字, emoji 🙂 and ünicode",
    "line\nbreaks\n\n\ttabs\r\n",
    "<|im_start|>user\nHi<|im_end|>\n",
    "1234567890 + 0.5e-3 = x",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenize_detokenize_round_trip(smol_tok, text):
    ids = smol_tok.tokenize(text)
    assert all(0 <= i < smol_tok.vocab_size for i in ids)
    assert len(ids) <= len(text.encode("utf-8"))
    assert smol_tok.detokenize(ids) == text


def test_detokenize_can_hide_special_tokens(smol_tok):
    ids = smol_tok.tokenize("<|im_start|>user\nHi<|im_end|>")
    assert smol_tok.detokenize(ids, special=False) == "user\nHi"


# -- chat template ------------------------------------------------------------------------------

def test_chat_template_renders_llama_cpp_chatml(smol_tok):
    assert smol_tok.apply_template(QUESTION, add_assistant=True) == CHATML_PROMPT
    assert smol_tok.apply_template(QUESTION + [ANSWER], add_assistant=False) == \
        CHATML_PROMPT + "Blue.<|im_end|>\n"
    # llama.cpp's built-in ChatML adds no default system prompt (the Jinja text would).
    system = [{"role": "system", "content": "Be brief."}] + QUESTION
    assert smol_tok.apply_template(system, add_assistant=True) == \
        "<|im_start|>system\nBe brief.<|im_end|>\n" + CHATML_PROMPT


def test_rendered_prompt_tokens_are_a_prefix_of_the_conversation(smol_tok):
    pairs = [("What color is fresh grass?", "Green."),
             ("Say hi", " leading space and trailing newline\n"),
             ("Ünïcödé?", "漢字 🙂")]
    for question, answer in pairs:
        q = [{"role": "user", "content": question}]
        prompt = smol_tok.tokenize(smol_tok.apply_template(q, add_assistant=True))
        full = smol_tok.tokenize(smol_tok.apply_template(q + [{"role": "assistant", "content": answer}],
                                                         add_assistant=False))
        assert len(full) > len(prompt) and full[:len(prompt)] == prompt
        assert smol_tok.detokenize(full[len(prompt):]) == answer + "<|im_end|>\n"
    assert len(pairs) == 3


def test_long_chat_grows_the_buffer(smol_tok):
    content = "".join(f"word{i} " for i in range(3000))        # ~25 kB, well over the first buffer
    out = smol_tok.apply_template([{"role": "user", "content": content}], add_assistant=True)
    assert out == f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


def test_unrecognised_template_is_refused_never_executed(tmp_path, tok_fields):
    jinja = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    path = write_random_llama(tmp_path / "bogus.gguf", Shape(), _without_template(tok_fields),
                              extra_fields=[string_field("tokenizer.chat_template", jinja)])
    with Tokenizer.from_gguf(path) as tok:
        assert tok.chat_template == jinja
        with pytest.raises(DataError, match="not one of llama.cpp's built-in conventions") as e:
            tok.apply_template(QUESTION, add_assistant=True)
        assert "never executed as Jinja" in str(e.value)
        assert tok.tokenize("Hello world")                   # the vocabulary itself is fine
    with llm.load(path) as m:
        with pytest.raises(DataError, match="built-in"):
            m.chat(QUESTION)
        assert m.generate("Hello", max_tokens=2).tokens      # raw completion needs no template

    none = write_random_llama(tmp_path / "none.gguf", Shape(), _without_template(tok_fields))
    with Tokenizer.from_gguf(none) as tok:
        assert tok.chat_template is None
        with pytest.raises(DataError, match="no tokenizer.chat_template"):
            tok.apply_template(QUESTION, add_assistant=True)


BAD_MESSAGES = [
    ([], "empty"),
    ("hello", "must be a list"),
    ({"role": "user", "content": "x"}, "must be a list"),
    ([{"role": "tool", "content": "x"}], "role 'tool'"),
    ([{"role": "user"}], "exactly the keys"),
    ([{"role": "user", "content": "x", "name": "n"}], "exactly the keys"),
    ([("user", "x")], "exactly the keys"),
    ([{"role": "user", "content": 3}], "content must be a str"),
    ([{"role": "user", "content": "a\x00b"}], "NUL"),
]


@pytest.mark.parametrize("messages, message", BAD_MESSAGES)
def test_malformed_messages_are_refused(smol_tok, messages, message):
    with pytest.raises(DataError, match=message):
        smol_tok.apply_template(messages, add_assistant=True)


def test_tokenizer_refusals(smol_tok, tmp_path):
    with pytest.raises(FormatError, match="does not exist"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(FormatError, match="not a GGUF file"):
        Tokenizer.from_gguf(tmp_path / "text.gguf")
    with pytest.raises(DataError, match="49152 is outside"):
        smol_tok.detokenize([1, 49152])
    with pytest.raises(DataError, match="-1 is outside"):
        smol_tok.detokenize([-1])
    with pytest.raises(DataError, match="must be a str"):
        smol_tok.tokenize(b"bytes")
    with pytest.raises(DataError, match="NUL"):
        smol_tok.tokenize("a\x00b")


def test_closed_tokenizer_refuses(smollm2):
    tok = Tokenizer.from_gguf(smollm2)
    tok.close()
    tok.close()
    for call in (lambda: tok.tokenize("x"), lambda: tok.detokenize([1]),
                 lambda: tok.apply_template(QUESTION, True), lambda: tok.is_end_of_generation(2)):
        with pytest.raises(AnerError, match="closed"):
            call()


# -- identity -----------------------------------------------------------------------------------

def test_identity_is_a_pure_function_of_tokenizer_metadata(smollm2, tiny, tmp_path, tok_fields):
    real = read_gguf(smollm2).fields
    ident = identity(real)
    assert len(ident) == 64 and int(ident, 16) >= 0
    # The tiny model borrows SmolLM2's tokenizer: other weights and general.* keys, same identity.
    assert identity(read_gguf(tiny).fields) == ident
    assert identity({k: f.value for k, f in reversed(list(real.items()))}) == ident   # plain, reordered
    other = write_random_llama(tmp_path / "other.gguf", Shape(), _without_template(tok_fields),
                               extra_fields=[string_field("tokenizer.chat_template", "chatml")])
    assert identity(read_gguf(other).fields) != ident
    with pytest.raises(DataError, match="no tokenizer"):
        identity({"general.architecture": "llama"})


# -- load / generate / chat / logits on the real model ------------------------------------------

def test_generate_is_greedy_and_deterministic(smol):
    a = smol.generate("The capital of France is", max_tokens=12)
    b = smol.generate("The capital of France is", max_tokens=12)
    assert a == b and a.text() == b.text()
    assert a.finish_reason in ("stop", "length") and 0 < len(a.tokens) <= 12
    assert a.text() == smol.tokenizer.detokenize(a.tokens)
    assert list(a.prompt_tokens) == smol.tokenizer.tokenize("The capital of France is")
    # Greedy: every generated token is the argmax of llama.cpp's logits at its position.
    scores = smol.logits(list(a.prompt_tokens) + list(a.tokens))
    n = len(a.prompt_tokens)
    assert np.argmax(scores[n - 1:-1], axis=1).tolist() == list(a.tokens)


def test_sampling_is_seeded(smol):
    a, b, c = (smol.generate("Once upon a time", max_tokens=8, temperature=1.5, seed=seed) for seed in (0, 0, 1))
    assert a == b
    assert a.tokens != c.tokens
    assert a.tokens != smol.generate("Once upon a time", max_tokens=8).tokens   # not greedy


def test_chat_renders_like_data_preparation_and_stops_at_end_of_turn(smol):
    question = [{"role": "user", "content": "What color is the clear daytime sky? Answer in one word."}]
    g = smol.chat(question, max_tokens=64)
    tok = smol.tokenizer
    assert list(g.prompt_tokens) == tok.tokenize(tok.apply_template(question, add_assistant=True))
    assert tok.detokenize(g.prompt_tokens).endswith("one word.<|im_end|>\n<|im_start|>assistant\n")
    assert g.finish_reason == "stop" and g.tokens           # the instruct model closes its turn
    assert not any(tok.is_end_of_generation(t) for t in g.tokens)
    assert "<|im_end|>" not in g.text() and g.text().strip()
    assert smol.chat(question, max_tokens=64) == g


def test_logits_every_position_deterministic_and_reset(smol):
    ids = smol.tokenizer.tokenize("The quick brown fox jumps over the lazy dog.")
    a = smol.logits(ids)
    assert a.shape == (len(ids), 49152) and a.dtype == np.float32 and np.isfinite(a).all()
    assert np.array_equal(a, smol.logits(ids))
    smol.generate("Something unrelated entirely", max_tokens=4)  # fills the KV cache
    assert np.array_equal(a, smol.logits(ids))                    # logits start from an empty cache
    prefix = smol.logits(ids[:4])
    np.testing.assert_allclose(prefix, a[:4], rtol=0, atol=1e-3 * np.abs(a[:4]).max())
    assert not np.allclose(a[0], a[1])                            # rows are positions, not copies


def test_tiny_model_parity_with_the_torch_forward(tiny):
    ids = [5, 17, 300, 42, 9, 1200, 7]
    with llm.load(tiny, context=32) as m:
        ours = m.logits(ids)
    ref = np.asarray(gen.import_model(tiny).logits(ids), dtype=np.float32)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-4 * np.abs(ref).max())


# -- adapters -----------------------------------------------------------------------------------

def _write_lora(path, pairs: dict, alpha: float) -> Path:
    """An adapter GGUF in llama.cpp's layout, written here with gguf-py: lora_a (r, in), lora_b (out, r)."""
    w = GGUFWriter(path, "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", alpha)
    for name, (a, b) in pairs.items():
        w.add_tensor(f"{name}.lora_a", np.ascontiguousarray(a, dtype=np.float32))
        w.add_tensor(f"{name}.lora_b", np.ascontiguousarray(b, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def test_adapter_gives_the_merged_logits_and_leaves_the_base(tiny, tmp_path):
    rng = np.random.default_rng(7)
    rank, alpha, scale = 4, 8.0, 0.5
    shapes = {"blk.0.attn_q.weight": (64, 64), "blk.1.attn_v.weight": (32, 64), "blk.1.ffn_down.weight": (64, 96)}
    pairs = {n: (rng.standard_normal((rank, i)) * 0.3, rng.standard_normal((o, rank)) * 0.3)
             for n, (o, i) in shapes.items()}
    lora = _write_lora(tmp_path / "adapter.gguf", pairs, alpha)
    s = scale * alpha / rank                                     # llama.cpp: scale * alpha / rank
    merged = rewrite(tiny, tmp_path / "merged.gguf", tensors=lambda n, w: (
        (w + s * pairs[n][1] @ pairs[n][0]).astype(np.float32) if n in pairs else w))

    ids = [3, 14, 15, 92, 65, 35, 89, 79]
    with llm.load(tiny, context=32) as base:
        before = base.logits(ids)
        with base.with_adapter(Manifest(lora, sha256_file(tiny), scale)) as tuned:
            assert tuned.adapter == (lora, scale) and tuned.base_sha256() == base.base_sha256()
            adapted = tuned.logits(ids)
        assert np.array_equal(base.logits(ids), before)          # the source handle is unchanged
    with llm.load(merged, context=32) as m:
        reference = m.logits(ids)
    assert not np.allclose(adapted, before, atol=1e-2)
    np.testing.assert_allclose(adapted, reference, rtol=0, atol=1e-4 * np.abs(reference).max())


def test_adapter_refusals(tiny, tmp_path, tok_fields):
    rng = np.random.default_rng(1)
    lora = _write_lora(tmp_path / "a.gguf", {"blk.0.attn_q.weight": (rng.standard_normal((2, 64)),
                                                                     rng.standard_normal((64, 2)))}, 2.0)
    wrong = _write_lora(tmp_path / "wrong.gguf", {"blk.0.attn_q.weight": (rng.standard_normal((2, 32)),
                                                                          rng.standard_normal((64, 2)))}, 2.0)
    copy = tmp_path / "base.gguf"
    copy.write_bytes(Path(tiny).read_bytes())
    sha = sha256_file(copy)
    with llm.load(copy, context=16) as base:
        with pytest.raises(ArtifactError, match="SHA-256") as e:
            base.with_adapter(Manifest(lora, "0" * 64))
        assert sha in str(e.value)
        with pytest.raises(ConfigError, match="base_sha256"):
            base.with_adapter(Manifest(lora, "not-a-digest"))
        with pytest.raises(ConfigError, match="scale"):
            base.with_adapter(Manifest(lora, sha, float("nan")))
        with pytest.raises(ConfigError, match="not an adapter manifest"):
            base.with_adapter(str(lora))
        with pytest.raises(FormatError, match="does not exist"):
            base.with_adapter(Manifest(tmp_path / "missing.gguf", sha))
        with pytest.raises(ArtifactError, match="refused the adapter.*llama.cpp said"):
            base.with_adapter(Manifest(wrong, sha))
        os.utime(copy, ns=(1, 1))                                # the base changed after loading
        with pytest.raises(ArtifactError, match="changed on disk"):
            base.with_adapter(Manifest(lora, sha))


# -- quantization -------------------------------------------------------------------------------

# Lower bounds on the correlation of quantized and F32 logits of the tiny random model; measured
# on two seeds: q4 0.965-0.972, q5 0.991-0.995, q8_0 0.9996, f16 0.9999995.
MIN_CORRELATION = {"q4_0": 0.93, "q4_1": 0.93, "q5_0": 0.98, "q5_1": 0.98, "q8_0": 0.999, "f16": 0.99999}


def test_quantize_every_format_then_load(tiny, tmp_path):
    ids = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]
    with llm.load(tiny, context=16) as m:
        reference = m.logits(ids).ravel()
    llama = engine()
    done = []
    for fmt, ftype in FORMATS.items():
        dst = quantize_gguf(tiny, tmp_path / f"tiny-{fmt}.gguf", format=fmt)
        assert dst == tmp_path / f"tiny-{fmt}.gguf"
        g = read_gguf(dst)
        assert g.get("general.file_type") == getattr(llama, ftype)
        assert g.tensors["blk.0.attn_q.weight"].type == GGMLQuantizationType[fmt.upper()]
        assert g.tensors["blk.0.attn_norm.weight"].type == GGMLQuantizationType.F32   # 1-D stays F32
        with llm.load(dst, context=16) as m:
            scores = m.logits(ids).ravel()
        assert np.isfinite(scores).all()
        corr = np.corrcoef(scores, reference)[0, 1]
        assert MIN_CORRELATION[fmt] < corr < 1.0, (fmt, corr)
        done.append(fmt)
    assert done == ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "f16"]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"tiny-{f}.gguf" for f in done)


def test_quantize_refusals(tiny, tmp_path):
    with pytest.raises(ConfigError, match="'q3_k' is not accepted; accepted: q4_0, q4_1, q5_0, q5_1, q8_0, f16"):
        quantize_gguf(tiny, tmp_path / "x.gguf", format="q3_k")
    existing = tmp_path / "exists.gguf"
    existing.write_bytes(b"keep me")
    with pytest.raises(ArtifactError, match="already exists"):
        quantize_gguf(tiny, existing)
    assert existing.read_bytes() == b"keep me"
    with pytest.raises(FormatError, match="does not exist"):
        quantize_gguf(tmp_path / "missing.gguf", tmp_path / "y.gguf")
    with pytest.raises(FormatError, match="not a GGUF file"):
        quantize_gguf(existing, tmp_path / "y.gguf")
    q4 = quantize_gguf(tiny, tmp_path / "q4.gguf")
    with pytest.raises(FormatError, match="could not quantize.*requantiz"):   # llama.cpp's own refusal
        quantize_gguf(q4, tmp_path / "q4-again.gguf", format="q4_1")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.gguf", "q4.gguf"]   # nothing staged left


# -- load refusals and lifetime -----------------------------------------------------------------

def test_load_refusals(tiny, tmp_path):
    with pytest.raises(FormatError, match="does not exist"):
        llm.load(tmp_path / "missing.gguf")
    (tmp_path / "text.gguf").write_text("definitely not GGUF")
    with pytest.raises(FormatError, match="not a GGUF file"):
        llm.load(tmp_path / "text.gguf")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(Path(tiny).read_bytes()[:4096])
    with pytest.raises(FormatError, match="could not load.*llama.cpp said"):
        llm.load(truncated)
    for context in (0, -1, 1.5, True, "128"):
        with pytest.raises(ConfigError, match="context"):
            llm.load(tiny, context=context)
    for device in ("tpu", "cuda", "cuda:x", "CPU", 0, None):
        with pytest.raises(ConfigError, match="accepted: 'cpu' or 'cuda:N'"):
            llm.load(tiny, device=device)
    if not engine().llama_supports_gpu_offload():
        with pytest.raises(ResourceError, match="CPU-only"):
            llm.load(tiny, device="cuda:0")


def test_inference_refusals(tiny):
    with llm.load(tiny, context=16) as m:
        with pytest.raises(DataError, match="empty"):
            m.logits([])
        with pytest.raises(DataError, match="49152 is outside"):
            m.logits([1, 49152])
        with pytest.raises(DataError, match="17 tokens, more than the context of 16"):
            m.logits([1] * 17)
        with pytest.raises(DataError, match="empty"):
            m.generate("")                                      # SmolLM2's tokenizer adds no BOS
        for kwargs, name in [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
                             ({"temperature": float("nan")}, "temperature"), ({"seed": -1}, "seed"),
                             ({"seed": 2**32 - 1}, "seed"), ({"max_tokens": 16}, "does not fit")]:
            with pytest.raises(ConfigError, match=name):
                m.generate("Hello there", **kwargs)
        assert len(m.generate("Hello there", max_tokens=14).tokens) <= 14


def test_every_call_after_close_raises(tiny):
    m = llm.load(tiny, context=16)
    m.close()
    m.close()                                                   # idempotent
    assert m.closed and "closed" in repr(m)
    calls = [lambda: m.generate("x"), lambda: m.chat(QUESTION), lambda: m.logits([1]),
             lambda: m.with_adapter(Manifest(Path(tiny), "0" * 64)), lambda: m.base_sha256(),
             lambda: m.tokenizer]
    for call in calls:
        with pytest.raises(AnerError, match="closed"):
            call()
    assert len(calls) == 6
    with llm.load(tiny, context=16) as m2:
        assert not m2.closed
    assert m2.closed

"""Supervised CSV preparation with the model's own tokenizer and chat template, and its refusals."""
import pytest

from aner import gen
from aner.data.tokenizer import Tokenizer
from aner.errors import ConfigError, DataError
from conftest import DATA


@pytest.fixture(scope="module")
def base(smollm2):
    return gen.import_model(smollm2)


def test_seed_rows_prepare_as_the_seed_describes(base, smollm2):
    tr = gen.supervised_csv(base, DATA / "seed_training.csv", input="question", target="answer",
                            role="training", context=128)
    va = gen.supervised_csv(base, DATA / "seed_validation.csv", input="question", target="answer",
                            role="validation", context=128)
    assert (tr.role(), tr.examples(), va.role(), va.examples()) == ("training", 1, "validation", 1)
    tok = Tokenizer.from_gguf(smollm2)
    e = tr.items[0]
    prompt = tok.detokenize(list(e.tokens[:e.prompt_len]))
    reply = tok.detokenize(list(e.tokens[e.prompt_len:]))
    assert prompt.endswith("<|im_start|>user\nWhat color is the clear daytime sky?<|im_end|>\n<|im_start|>assistant\n")
    assert reply.startswith("Blue.<|im_end|>")            # the reply and its end-of-turn suffix are scored
    assert tr.scored_tokens() == len(e.tokens) - e.prompt_len
    assert tr.summary() == (f"Pretrained data; role=training; examples=1; scored_tokens={tr.scored_tokens()}; "
                            f"sha256={tr.sha256()}")
    again = gen.supervised_csv(base, DATA / "seed_training.csv", role="training", context=128)
    assert again.sha256() == tr.sha256() and again.items == tr.items      # deterministic
    assert va.sha256() != tr.sha256()


def write(tmp_path, text, name="d.csv"):
    p = tmp_path / name
    p.write_text(text)
    return p


@pytest.mark.parametrize("text,kw,message", [
    ("question,answer\nWhat?,\"unterminated\n", {}, "line 2"),
    ("question,answer\nA?,B.\nC?,D.,extra\n", {}, "line 3: 3 fields; the header has 2"),
    ("prompt,answer\nA?,B.\n", {}, "column 'question' is missing"),
    ("question,answer\nA?,B.\nC?,   \n", {}, "line 3: the target column 'answer' is empty"),
    ("question,answer\n", {}, "has a header but no rows"),
    ("", {}, "is empty"),
    ("question,answer\nA?," + "very long answer " * 60 + "\n", dict(context=32), "more than context=32"),
])
def test_refusals_name_the_row(base, tmp_path, text, kw, message):
    with pytest.raises(DataError, match=message):
        gen.supervised_csv(base, write(tmp_path, text), role="training", **({"context": 128} | kw))


@pytest.mark.parametrize("kw,message", [
    (dict(role="test"), "role='test'"), (dict(context=1), "context=1"), (dict(context=8193), "context=8193"),
    (dict(context=64.0), "context=64.0"),
])
def test_argument_refusals(base, tmp_path, kw, message):
    with pytest.raises(ConfigError, match=message):
        gen.supervised_csv(base, write(tmp_path, "question,answer\nA?,B.\n"), **({"role": "training"} | kw))


def test_missing_file_and_non_model(base, tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        gen.supervised_csv(base, tmp_path / "absent.csv")
    with pytest.raises(ConfigError, match="PretrainedModel"):
        gen.supervised_csv("model.gguf", DATA / "seed_training.csv")


def test_data_is_immutable(base):
    tr = gen.supervised_csv(base, DATA / "seed_training.csv", role="training")
    with pytest.raises(AttributeError):
        tr.role_name = "validation"

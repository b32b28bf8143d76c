"""Supervised question/answer data rendered with the model's own chat template.

Each CSV row becomes one conversation: the `input` column as the user message, the `target`
column as the assistant reply. The prompt (everything up to and including the assistant
generation prefix) is not scored; the reply and its end-of-turn suffix are. The prompt's tokens
must be an exact prefix of the whole conversation's tokens, or the row is refused: a tokenizer
that merges across that boundary would make the mask a guess.
"""
import csv
import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, DataError

ROLES = ("training", "validation")


@dataclass(frozen=True)
class Example:
    tokens: tuple[int, ...]   # the whole rendered conversation
    prompt_len: int           # tokens[:prompt_len] are context; the rest are scored

    @property
    def scored(self) -> int:
        return len(self.tokens) - self.prompt_len

    def sha256(self) -> str:
        return hashlib.sha256(repr((self.tokens, self.prompt_len)).encode()).hexdigest()


@dataclass(frozen=True)
class TrainingData:
    role_name: str
    items: tuple[Example, ...]
    tokenizer_sha256: str
    context: int
    source: str

    def role(self) -> str:
        return self.role_name

    def examples(self) -> int:
        return len(self.items)

    def scored_tokens(self) -> int:
        return sum(e.scored for e in self.items)

    def sha256(self) -> str:
        h = hashlib.sha256(f"aner.training-data/1;tokenizer={self.tokenizer_sha256}".encode())
        for e in self.items:
            h.update(bytes.fromhex(e.sha256()))
        return h.hexdigest()

    def example_hashes(self) -> frozenset[str]:
        return frozenset(e.sha256() for e in self.items)

    def summary(self) -> str:
        return (f"Pretrained data; role={self.role_name}; examples={self.examples()}; "
                f"scored_tokens={self.scored_tokens()}; sha256={self.sha256()}")

    def __repr__(self):
        return f"<TrainingData {self.summary()}>"


def render_example(tokenizer, question: str, answer: str) -> Example:
    """One user/assistant exchange -> tokens and the length of its unscored prompt."""
    prompt = tokenizer.apply_template([{"role": "user", "content": question}], add_assistant=True)
    full = tokenizer.apply_template([{"role": "user", "content": question},
                                     {"role": "assistant", "content": answer}], add_assistant=False)
    p = tokenizer.tokenize(prompt)
    t = tokenizer.tokenize(full)
    if len(t) <= len(p) or t[:len(p)] != p:
        raise DataError("the rendered prompt's tokens are not an exact prefix of the rendered "
                        "conversation's tokens (unsupported boundary behaviour)")
    return Example(tuple(t), len(p))


def read_csv_rows(path, input: str, target: str) -> list[tuple[int, str, str]]:
    """(line number, input, target) for each data row; refuses malformed rows with their line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"CSV file {str(path)!r} does not exist") from None
    except UnicodeDecodeError as e:
        raise DataError(f"CSV file {str(path)!r} is not UTF-8 text: {e}") from e
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        header = next(reader)
    except StopIteration:
        raise DataError(f"CSV file {str(path)!r} is empty; it needs a header naming {input!r} and {target!r}") from None
    except csv.Error as e:
        raise DataError(f"{path}: line 1: malformed CSV header: {e}") from e
    for col in (input, target):
        if col not in header:
            raise DataError(f"{path}: column {col!r} is missing; the header has {header}")
    if len(set(header)) != len(header):
        raise DataError(f"{path}: the header repeats a column name: {header}")
    i, j = header.index(input), header.index(target)
    rows = []
    try:
        for fields in reader:
            line = reader.line_num
            if not fields:
                continue
            if len(fields) != len(header):
                raise DataError(f"{path}: line {line}: {len(fields)} fields; the header has {len(header)}")
            if not fields[j].strip():
                raise DataError(f"{path}: line {line}: the target column {target!r} is empty")
            rows.append((line, fields[i], fields[j]))
    except csv.Error as e:
        raise DataError(f"{path}: line {reader.line_num}: malformed CSV: {e}") from e
    if not rows:
        raise DataError(f"CSV file {str(path)!r} has a header but no rows")
    return rows


def supervised_csv(tokenizer, tokenizer_sha256: str, model_context: int, path, input: str,
                   target: str, role: str, context: int) -> TrainingData:
    if role not in ROLES:
        raise ConfigError(f"role={role!r} is not accepted; accepted: 'training' or 'validation'")
    if isinstance(context, bool) or not isinstance(context, int) or not 2 <= context <= model_context:
        raise ConfigError(f"context={context!r} is outside the model's accepted range 2..{model_context}")
    examples = []
    for line, question, answer in read_csv_rows(path, input, target):
        try:
            example = render_example(tokenizer, question, answer)
        except DataError as e:
            raise DataError(f"{path}: line {line}: {e}") from e
        if len(example.tokens) > context:
            raise DataError(f"{path}: line {line}: the rendered example has {len(example.tokens)} tokens, "
                            f"more than context={context}; shorten the row or raise the context")
        examples.append(example)
    return TrainingData(role, tuple(examples), tokenizer_sha256, context, str(path))

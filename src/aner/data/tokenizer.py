"""Tokenizer and chat template of a GGUF model, through llama.cpp itself.

Data preparation and deployment must agree token for token, so both go through the engine that
serves the model: `llama_tokenize` / `llama_detokenize` on the model's vocabulary (loaded
vocab-only: no weights are read) and `llama_chat_apply_template`, llama.cpp's built-in chat
conventions (ChatML, Llama 3, Mistral, ...). The model's `tokenizer.chat_template` text is only
*inspected* by llama.cpp to pick one of those conventions; it is never executed as Jinja and no
model-supplied code runs. A template llama.cpp does not recognise is refused, not approximated.
(llama-cpp-python's high-level `Llama` class is not used: its constructor compiles every chat
template in the metadata with Jinja2, and fails on one that is not valid Jinja.)

This module is also the one place that binds llama.cpp: `engine()` imports `llama_cpp` once,
checks it is the pinned version, routes llama.cpp's log into a short in-memory tail (quoted in
our error messages rather than printed to stderr) and initialises the backend.
"""
import ctypes
import hashlib
import json
import os
from collections import deque
from collections.abc import Mapping
from operator import index
from pathlib import Path

import numpy as np

from ..errors import AnerError, DataError, FormatError, ResourceError

ENGINE_VERSION = "0.3.36"            # llama-cpp-python; its ctypes structs match only its own build
ROLES = ("system", "user", "assistant")
_TEMPLATE_BUFFER = 1024              # first guess; grown to the exact size llama.cpp reports

# -- the engine ---------------------------------------------------------------------------------

_ENGINE = None
_LOG_CALLBACK = None                 # ctypes callback; llama.cpp keeps its address: keep it alive
_LOG_TAIL: deque = deque(maxlen=16)  # recent (level, text) WARN/ERROR messages
# enum ggml_log_level of this llama.cpp: NONE 0, DEBUG 1, INFO 2, WARN 3, ERROR 4, CONT 5 (CONT
# continues the previous message). llama-cpp-python's own _logger.py still assumes INFO 1 .. ERROR 3.
_WARN, _ERROR, _CONT = 3, 4, 5
_log_level = 0


def _on_log(level: int, text: bytes, user_data) -> None:
    global _log_level
    if level != _CONT:
        _log_level = level
    if _log_level in (_WARN, _ERROR) and text:
        _LOG_TAIL.append((_log_level, text.decode("utf-8", "replace")))


def engine():
    """The `llama_cpp` module, initialised once, with llama.cpp's logging kept off stderr."""
    global _ENGINE, _LOG_CALLBACK
    if _ENGINE is None:
        try:
            import llama_cpp
        except ImportError as e:
            raise ResourceError(
                f"llama.cpp is not available: install llama-cpp-python=={ENGINE_VERSION} "
                f"(import failed: {e})") from e
        if llama_cpp.__version__ != ENGINE_VERSION:
            raise ResourceError(f"llama-cpp-python {llama_cpp.__version__} is installed; aner is "
                                f"pinned to {ENGINE_VERSION}: install that version")
        _LOG_CALLBACK = llama_cpp.llama_log_callback(_on_log)
        llama_cpp.llama_log_set(_LOG_CALLBACK, None)
        llama_cpp.llama_backend_init()
        _ENGINE = llama_cpp
    return _ENGINE


def clear_engine_log() -> None:
    _LOG_TAIL.clear()


def engine_log() -> str:
    """What llama.cpp warned or complained about since `clear_engine_log()`, for error messages."""
    errors = [t for level, t in _LOG_TAIL if level == _ERROR]
    lines = errors or [t for _, t in _LOG_TAIL]
    text = " ".join(line.strip() for line in lines if line.strip())
    _LOG_TAIL.clear()
    return f"llama.cpp said: {text}" if text else "llama.cpp logged no warning or error"


def require_gguf(path, what: str = "GGUF file") -> Path:
    """Check that `path` is a file starting with the GGUF magic, before llama.cpp sees it."""
    p = Path(path)
    if not p.is_file():
        raise FormatError(f"{what} {str(p)!r} does not exist or is not a file")
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise FormatError(f"{what} {str(p)!r} is not a GGUF file: it starts with {magic!r}, "
                          "a GGUF file starts with b'GGUF'")
    return p


# -- identity -----------------------------------------------------------------------------------

def identity(fields: Mapping) -> str:
    """SHA-256 of a tokenizer: every `tokenizer.*` metadata key and value, as canonical JSON.

    `fields` maps GGUF keys to values or to objects with `.value` (`read_gguf(p).fields`). Pure:
    needs no llama.cpp, and two files with equal tokenizer metadata have equal identities.
    """
    items = {k: _plain(getattr(v, "value", v)) for k, v in fields.items() if k.startswith("tokenizer.")}
    if not items:
        raise DataError("the metadata has no tokenizer.* keys; a tokenizer identity needs the "
                        "GGUF tokenizer metadata (tokenizer.ggml.model, tokenizer.ggml.tokens, ...)")
    blob = json.dumps(items, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _plain(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    assert isinstance(value, (str, int, float, bool)), type(value)
    return value


# -- the tokenizer ------------------------------------------------------------------------------

class Tokenizer:
    """A GGUF model's vocabulary and chat convention, loaded vocab-only into llama.cpp.

    Token ids: `bos`, `eos`, `eot` (None where the model has none), `vocab_size`; `add_bos`
    is the model's `tokenizer.ggml.add_bos_token` as llama.cpp reads it. Build with `from_gguf`;
    `close()` frees the native vocabulary (also on garbage collection).
    """

    def __init__(self, path: Path, model):
        llama = engine()
        self.path = Path(path)
        self._model = model
        self._vocab = llama.llama_model_get_vocab(model)
        self.vocab_size: int = llama.llama_vocab_n_tokens(self._vocab)
        self.bos = _token_or_none(llama.llama_vocab_bos(self._vocab))
        self.eos = _token_or_none(llama.llama_vocab_eos(self._vocab))
        self.eot = _token_or_none(llama.llama_vocab_eot(self._vocab))
        self.add_bos = bool(llama.llama_vocab_get_add_bos(self._vocab))
        template = llama.llama_model_chat_template(model, None)   # tokenizer.chat_template
        self.chat_template: str | None = None if template is None else template.decode("utf-8")

    @classmethod
    def from_gguf(cls, path) -> "Tokenizer":
        path = require_gguf(path, "tokenizer source")
        llama = engine()
        params = llama.llama_model_default_params()
        params.vocab_only = True
        clear_engine_log()
        model = llama.llama_model_load_from_file(os.fsencode(path), params)
        if not model:
            raise FormatError(f"llama.cpp could not load the tokenizer of {str(path)!r}; {engine_log()}")
        return cls(path, model)

    # -- text <-> tokens

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`.

        add_special: add BOS/EOS where the model's `tokenizer.ggml.add_bos_token` /
        `add_eos_token` ask for them (llama.cpp decides; SmolLM2 asks for neither); False never
        adds them. parse_special: text such as `<|im_start|>` becomes its special token, as in
        a rendered chat template; False tokenizes it as plain text.
        """
        vocab = self._require_open()
        if not isinstance(text, str):
            raise DataError(f"text to tokenize must be a str, got {type(text).__name__}")
        data = _utf8(text, "text to tokenize")
        llama = engine()
        n = len(data) + 4                          # a byte-level BPE never yields more than a token a byte
        while True:
            buf = (llama.llama_token * n)()
            got = llama.llama_tokenize(vocab, data, len(data), buf, n, bool(add_special), bool(parse_special))
            if got >= 0:
                return list(buf[:got])
            if -got <= n:
                raise DataError(f"llama.cpp failed to tokenize a text of {len(data)} bytes (returned {got})")
            n = -got

    def detokenize(self, tokens, special: bool = True) -> str:
        """Text of `tokens`; special tokens are rendered as their text (`<|im_end|>`) unless
        `special=False`. Bytes that do not form UTF-8 (a token sequence cut inside a character)
        become U+FFFD."""
        vocab = self._require_open()
        ids = self.check_tokens(tokens)
        if not ids:
            return ""
        llama = engine()
        arr = (llama.llama_token * len(ids))(*ids)
        n = 8 * len(ids) + 16
        while True:
            buf = ctypes.create_string_buffer(n)
            got = llama.llama_detokenize(vocab, arr, len(ids), buf, n, False, bool(special))
            if got >= 0:
                return buf.raw[:got].decode("utf-8", "replace")
            n = -got

    def check_tokens(self, tokens) -> list[int]:
        """`tokens` as a list of ints, each a valid id of this vocabulary."""
        try:
            ids = [index(t) for t in tokens]
        except TypeError as e:
            raise DataError(f"tokens must be a sequence of integer ids, got {tokens!r:.80}") from e
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise DataError(f"token id {bad[0]} is outside this vocabulary; accepted: 0 to "
                            f"{self.vocab_size - 1} ({len(bad)} ids out of range)")
        return ids

    def is_end_of_generation(self, token: int) -> bool:
        """True for every token llama.cpp ends generation at (eos, eot, `<|im_end|>`, ...)."""
        vocab = self._require_open()
        return bool(engine().llama_vocab_is_eog(vocab, int(token)))

    # -- chat

    def apply_template(self, messages, add_assistant: bool) -> str:
        """Render `messages` ([{"role", "content"}], roles system/user/assistant) in the model's
        chat convention; `add_assistant` appends the header that opens the assistant's turn."""
        self._require_open()
        msgs = _check_messages(messages)
        if self.chat_template is None:
            raise DataError(f"{str(self.path)!r} has no tokenizer.chat_template; a chat needs a model "
                            "whose template is one of llama.cpp's built-in conventions")
        llama = engine()
        chat = (llama.llama_chat_message * len(msgs))()
        for slot, (role, content) in zip(chat, msgs):
            slot.role = role.encode("utf-8")               # the struct keeps these bytes alive
            slot.content = _utf8(content, "message content")
        template = self.chat_template.encode("utf-8")
        size = _TEMPLATE_BUFFER
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama.llama_chat_apply_template(template, chat, len(msgs), bool(add_assistant), buf, size)
            if n < 0:
                raise DataError(
                    f"the chat template of {str(self.path)!r} (tokenizer.chat_template starting "
                    f"{self.chat_template[:60]!r}) is not one of llama.cpp's built-in conventions; "
                    "templates are never executed as Jinja, so only a recognised convention "
                    "(ChatML, Llama 2/3, Mistral, Gemma, Phi, ...) is accepted")
            if n <= size:                                  # strncpy: complete when it fits
                return buf.raw[:n].decode("utf-8")
            size = n

    # -- lifetime

    def close(self) -> None:
        if self._model is not None:
            model, self._model, self._vocab = self._model, None, None
            engine().llama_model_free(model)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_model", None) is not None and _ENGINE is not None:
            self.close()

    def _require_open(self):
        if self._model is None:
            raise AnerError(f"the tokenizer of {str(self.path)!r} is closed")
        return self._vocab


def _token_or_none(token: int) -> int | None:
    return None if token < 0 else int(token)        # LLAMA_TOKEN_NULL is -1


def _utf8(text: str, what: str) -> bytes:
    if "\x00" in text:
        raise DataError(f"{what} contains a NUL character at position {text.index(chr(0))}; "
                        "llama.cpp reads C strings, so NUL is not accepted")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise DataError(f"{what} is not encodable as UTF-8 ({e}); accepted: valid Unicode text") from e


def _check_messages(messages) -> list[tuple[str, str]]:
    if isinstance(messages, (str, bytes, Mapping)) or not hasattr(messages, "__iter__"):
        raise DataError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                        f"{type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or set(m) != {"role", "content"}:
            keys = sorted(m) if isinstance(m, Mapping) else type(m).__name__
            raise DataError(f"message {i} must be a dict with exactly the keys 'role' and "
                            f"'content', got {keys}")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise DataError(f"message {i} has role {role!r}; accepted roles: {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise DataError(f"message {i} content must be a str, got {type(content).__name__}")
        out.append((role, content))
    if not out:
        raise DataError("messages is empty; a chat needs at least one message")
    return out

"""Deployment through llama.cpp: load a GGUF, apply a LoRA adapter, generate, chat, score.

    with llm.load("base-f16.gguf", context=128, device="cpu") as base:
        tuned = base.with_adapter(manifest)          # a new model; `base` is unchanged
        print(tuned.generate("Explain this.", max_tokens=32).text())
        print(tuned.chat([{"role": "user", "content": "Hi"}]).text())
        scores = tuned.logits(tokens)                # (len(tokens), vocab) float32
        tuned.close()

This is the engine our trained artifacts are deployed to, so its numerics are pinned to make runs
comparable with training and with each other: flash attention off, FP32 KV cache, logits of every
position available (llama.cpp computes a position's logits only when its batch entry asks: the
`logits_all` behaviour is set per call), sampling seeded by the caller, greedy by default.
llama.cpp is driven through llama-cpp-python's low-level C bindings, not its `Llama` class (which
compiles the model's chat template with Jinja2). Chat prompts are rendered and tokenized exactly as
data preparation does: `Tokenizer.apply_template(messages, add_assistant=True)`, then `tokenize`
with its defaults.

Handles own native memory: `close()` frees it (also as a context manager); any call after close
raises `AnerError`. A handle is not safe to use from two threads at once.
"""
import ctypes
import math
import os
import re
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path

import numpy as np

from .data.tokenizer import (ENGINE_VERSION, Tokenizer, clear_engine_log, engine, engine_log,
                             require_gguf)
from .errors import AnerError, ArtifactError, ConfigError, DataError, FormatError, ResourceError
from .formats.publish import sha256_file

__all__ = ["load", "LLMModel", "Generation"]

GGML_TYPE_F32 = 0                   # KV cache type: FP32 keys and values (llama.cpp's default is F16)
MAX_UBATCH = 512                    # tokens per physical batch (llama.cpp's default)
LLAMA_DEFAULT_SEED = 0xFFFFFFFF     # means "random seed" to llama.cpp's samplers: never passed


def load(path, context: int = 128, device: str = "cpu") -> "LLMModel":
    """Open the GGUF model at `path` in llama.cpp with a `context`-token window.

    device: "cpu" (no layer offloaded) or "cuda:N" (every layer on GPU N; needs a llama.cpp built
    with CUDA). The file is checked to be a GGUF before llama.cpp reads it.
    """
    path = require_gguf(path, "model")
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ConfigError(f"context {context!r} is not accepted; accepted: a whole number of tokens >= 1")
    _gpu_index(device)
    return LLMModel(path, context, device)


@dataclass(frozen=True)
class Generation:
    """What `generate` or `chat` produced: the new tokens and their text."""
    tokens: tuple[int, ...]         # generated tokens; the end-of-generation token is not included
    prompt_tokens: tuple[int, ...]  # what the model was conditioned on
    finish_reason: str              # "stop": an end-of-generation token; "length": max_tokens reached
    _text: str = field(repr=False)

    def text(self) -> str:
        return self._text


class LLMModel:
    """A GGUF model open in llama.cpp, optionally with one LoRA adapter. Build with `load`."""

    def __init__(self, path: Path, context: int, device: str, adapter: tuple[Path, float] | None = None,
                 base_sha256: str | None = None, base_stat: tuple | None = None):
        self.path, self.context, self.device, self.adapter = Path(path), context, device, adapter
        self._base_sha256 = base_sha256
        self._stat = _stat_key(self.path)
        if base_stat is not None and base_stat != self._stat:
            raise ArtifactError(f"base model {str(self.path)!r} changed on disk since it was loaded; "
                                "load it again before applying an adapter")
        self._tokenizer = self._model = self._lora = self._ctx = self._batch = None
        try:
            self._tokenizer = Tokenizer.from_gguf(self.path)
            self._open(engine(), _gpu_index(device))
        except BaseException:
            self.close()
            raise

    def _open(self, llama, gpu: int | None) -> None:
        mparams = llama.llama_model_default_params()
        mparams.n_gpu_layers = 0 if gpu is None else -1     # -1: all layers (also llama.cpp's default!)
        mparams.split_mode = llama.LLAMA_SPLIT_MODE_NONE   # one device: main_gpu
        mparams.main_gpu = 0 if gpu is None else gpu
        clear_engine_log()
        self._model = llama.llama_model_load_from_file(os.fsencode(self.path), mparams)
        if not self._model:
            raise FormatError(f"llama.cpp could not load the model {str(self.path)!r} on {self.device}; "
                              f"{engine_log()}")
        if self.adapter is not None:
            adapter_path, _ = self.adapter
            lora = llama.llama_adapter_lora_init(self._model, os.fsencode(adapter_path))
            if not lora:
                raise ArtifactError(f"llama.cpp refused the adapter {str(adapter_path)!r} for the base "
                                    f"{str(self.path)!r}; {engine_log()}")
            self._lora = lora

        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        cparams = llama.llama_context_default_params()
        cparams.n_ctx = self.context
        cparams.n_batch = self.context                      # a whole window goes in one llama_decode
        cparams.n_ubatch = min(self.context, MAX_UBATCH)
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.type_k = cparams.type_v = GGML_TYPE_F32
        cparams.offload_kqv = cparams.op_offload = gpu is not None
        cparams.no_perf = True
        self._ctx = llama.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            raise ResourceError(f"llama.cpp could not create a {self.context}-token context for "
                                f"{str(self.path)!r} on {self.device}; {engine_log()}")
        if self._lora is not None:
            adapters = (llama.llama_adapter_lora_p_ctypes * 1)(self._lora)
            scales = (ctypes.c_float * 1)(self.adapter[1])
            if llama.llama_set_adapters_lora(self._ctx, adapters, 1, scales) != 0:
                raise ArtifactError(f"llama.cpp could not apply the adapter {str(self.adapter[0])!r}; "
                                    f"{engine_log()}")
        self._memory = llama.llama_get_memory(self._ctx)
        self._batch = llama.llama_batch_init(self.context, 0, 1)
        self.vocab_size: int = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self._model))
        assert self.vocab_size == self._tokenizer.vocab_size

    # -- adapters

    def with_adapter(self, manifest) -> "LLMModel":
        """A new model: this base file with the LoRA adapter of `manifest` applied at its scale.

        `manifest` has `adapter_path` (the adapter GGUF), `base_sha256` (the SHA-256 of the base
        GGUF it was trained on) and optionally `scale` (default 1.0). Adapters do not stack: the
        result has exactly this one. The base must be the exact file the adapter was trained on.
        """
        self._require_open()
        adapter_path, base_sha256, scale = _read_manifest(manifest)
        adapter_path = require_gguf(adapter_path, "adapter")
        actual = self.base_sha256()
        if actual != base_sha256:
            raise ArtifactError(f"the adapter {str(adapter_path)!r} was trained on a base with SHA-256 "
                                f"{base_sha256}, but {str(self.path)!r} has SHA-256 {actual}; load "
                                "the exact base file the adapter was trained on")
        return LLMModel(self.path, self.context, self.device, (adapter_path, scale), actual, self._stat)

    def base_sha256(self) -> str:
        """SHA-256 of the base GGUF file, computed once per handle."""
        self._require_open()
        if self._base_sha256 is None:
            digest = sha256_file(self.path)
            if _stat_key(self.path) != self._stat:
                raise ArtifactError(f"base model {str(self.path)!r} changed on disk since it was loaded; "
                                    "load it again")
            self._base_sha256 = digest
        return self._base_sha256

    # -- inference

    def generate(self, prompt: str, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0) -> Generation:
        """Raw text completion of `prompt` (tokenized with the model's BOS policy, special-token
        text parsed). Stops at an end-of-generation token or after `max_tokens`."""
        tok = self._require_open()
        if not isinstance(prompt, str):
            raise DataError(f"prompt must be a str, got {type(prompt).__name__}")
        return self._complete(tok.tokenize(prompt), max_tokens, temperature, seed)

    def chat(self, messages, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0) -> Generation:
        """The assistant's reply to `messages` ([{"role", "content"}]), rendered in the model's
        built-in chat convention with the assistant header appended, as data preparation renders
        training prompts. Stops at end-of-turn / end-of-sequence or after `max_tokens`."""
        tok = self._require_open()
        prompt = tok.apply_template(messages, add_assistant=True)
        return self._complete(tok.tokenize(prompt), max_tokens, temperature, seed)

    def stream_chat(self, messages, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0):
        """chat(...) as it is generated: an iterator of text pieces whose concatenation is
        chat(...).text(). Arguments are checked now; use no other method of this handle until
        the iterator is exhausted or closed."""
        tok = self._require_open()
        prompt = tok.tokenize(tok.apply_template(messages, add_assistant=True))
        return self._pieces(self._tokens(prompt, max_tokens, temperature, seed))

    def stream(self, prompt: str, max_tokens: int = 32, temperature: float = 0.0, seed: int = 0):
        """generate(...) as it is generated: text pieces whose concatenation is generate(...).text()."""
        tok = self._require_open()
        if not isinstance(prompt, str):
            raise DataError(f"prompt must be a str, got {type(prompt).__name__}")
        return self._pieces(self._tokens(tok.tokenize(prompt), max_tokens, temperature, seed))

    def logits(self, tokens) -> np.ndarray:
        """Logits of every position of `tokens`, (len(tokens), vocab) float32, from an empty cache:
        row i scores the token after tokens[: i + 1]."""
        tok = self._require_open()
        ids = tok.check_tokens(tokens)
        self._check_length(len(ids), "the token sequence")
        llama = engine()
        llama.llama_memory_clear(self._memory, True)
        self._decode(ids, start=0, all_logits=True)
        out = np.ctypeslib.as_array(llama.llama_get_logits(self._ctx), shape=(len(ids), self.vocab_size))
        return np.array(out, dtype=np.float32, copy=True)

    @property
    def tokenizer(self) -> Tokenizer:
        return self._require_open()

    def _complete(self, prompt: list[int], max_tokens, temperature, seed) -> Generation:
        out = list(self._tokens(prompt, max_tokens, temperature, seed))
        finish = "stop" if len(out) < max_tokens else "length"   # fewer tokens: an end-of-generation token came
        return Generation(tuple(out), tuple(prompt), finish, self._tokenizer.detokenize(out))

    def _tokens(self, prompt: list[int], max_tokens, temperature, seed):
        """Check the sampling arguments now; return an iterator of the generated tokens."""
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise ConfigError(f"max_tokens {max_tokens!r} is not accepted; accepted: a whole number >= 1")
        if isinstance(temperature, bool) or not isinstance(temperature, Real) or not (
                math.isfinite(temperature) and temperature >= 0):
            raise ConfigError(f"temperature {temperature!r} is not accepted; accepted: 0 (greedy) or "
                              "a finite number > 0")
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < LLAMA_DEFAULT_SEED:
            raise ConfigError(f"seed {seed!r} is not accepted; accepted: 0 to {LLAMA_DEFAULT_SEED - 1}")
        self._check_length(len(prompt), "the prompt")
        if len(prompt) + max_tokens > self.context:
            raise ConfigError(f"max_tokens={max_tokens} does not fit: the prompt has {len(prompt)} tokens "
                              f"and the context is {self.context}; accepted: max_tokens <= "
                              f"{self.context - len(prompt)}, or load with a larger context")
        return self._sample(prompt, max_tokens, temperature, seed)

    def _sample(self, prompt: list[int], max_tokens, temperature, seed):
        llama = engine()
        chain = llama.llama_sampler_chain_init(llama.llama_sampler_chain_default_params())
        if temperature == 0:
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_greedy())
        else:  # plain temperature sampling: no top-k / top-p truncation
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_temp(float(temperature)))
            llama.llama_sampler_chain_add(chain, llama.llama_sampler_init_dist(seed))
        try:
            llama.llama_memory_clear(self._memory, True)
            self._decode(prompt, start=0, all_logits=False)
            for step in range(max_tokens):
                token = llama.llama_sampler_sample(chain, self._ctx, -1)
                if self._tokenizer.is_end_of_generation(token):
                    return
                yield token
                if step + 1 < max_tokens:
                    self._decode([token], start=len(prompt) + step, all_logits=False)
        finally:
            llama.llama_sampler_free(chain)

    def _pieces(self, tokens):
        """Text pieces of a token stream. The whole sequence is detokenized each time (a piece is
        the new suffix), and a piece ending inside a UTF-8 character waits for its next token."""
        out, sent = [], ""
        for token in tokens:
            out.append(token)
            text = self._tokenizer.detokenize(out)
            if not text.endswith("\ufffd"):
                yield text[len(sent):]
                sent = text
        text = self._tokenizer.detokenize(out)
        if text != sent:
            yield text[len(sent):]

    def _check_length(self, n: int, what: str) -> None:
        if n == 0:
            raise DataError(f"{what} is empty (0 tokens); accepted: 1 to {self.context} tokens")
        if n > self.context:
            raise DataError(f"{what} has {n} tokens, more than the context of {self.context}; "
                            "load with a larger context or shorten it")

    def _decode(self, tokens: list[int], start: int, all_logits: bool) -> None:
        """Append `tokens` at positions start.. of sequence 0; the last one always gets logits."""
        batch, n = self._batch, len(tokens)
        assert 0 < n and start + n <= self.context
        for i, t in enumerate(tokens):
            batch.token[i] = t
            batch.pos[i] = start + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = all_logits or i == n - 1
        batch.n_tokens = n
        clear_engine_log()
        rc = engine().llama_decode(self._ctx, batch)
        if rc != 0:
            raise ResourceError(f"llama_decode of {n} tokens at position {start} failed with code {rc}; "
                                f"{engine_log()}")

    # -- lifetime

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def close(self) -> None:
        """Free the native model, context and adapter. Idempotent."""
        if self._tokenizer is not None:
            self._tokenizer.close()
        if self._model is None:
            return
        llama = engine()
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            llama.llama_free(self._ctx)
            self._ctx = None
        if self._lora is not None:      # before its model: the model's destructor frees its adapters
            llama.llama_adapter_lora_free(self._lora)
            self._lora = None
        if self._model is not None:
            llama.llama_model_free(self._model)
            self._model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_model", None) is not None or getattr(self, "_tokenizer", None) is not None:
            try:
                self.close()
            except (AttributeError, TypeError):   # interpreter shutdown: modules already torn down
                pass

    def __repr__(self):
        adapter = "" if self.adapter is None else f", adapter={str(self.adapter[0])!r}@{self.adapter[1]}"
        state = ", closed" if self.closed else ""
        return f"LLMModel({str(self.path)!r}, context={self.context}, device={self.device!r}{adapter}{state})"

    def _require_open(self) -> Tokenizer:
        if self._ctx is None:
            raise AnerError(f"{self!r} is closed; load the model again")
        return self._tokenizer


def _gpu_index(device) -> int | None:
    if device == "cpu":
        return None
    m = re.fullmatch(r"cuda:(\d+)", device) if isinstance(device, str) else None
    if m is None:
        raise ConfigError(f"device {device!r} is not accepted; accepted: 'cpu' or 'cuda:N' (N a GPU index)")
    if not engine().llama_supports_gpu_offload():
        raise ResourceError(f"device {device!r} needs llama.cpp built with GPU support; the installed "
                            f"llama-cpp-python {ENGINE_VERSION} is CPU-only: use device='cpu'")
    return int(m.group(1))


def _read_manifest(manifest) -> tuple[Path, str, float]:
    try:
        adapter_path, base_sha256 = manifest.adapter_path, manifest.base_sha256
    except AttributeError as e:
        raise ConfigError(f"{type(manifest).__name__} is not an adapter manifest; accepted: an object "
                          "with adapter_path, base_sha256 and scale (what save_adapter returns)") from e
    scale = getattr(manifest, "scale", 1.0)
    if not (isinstance(base_sha256, str) and re.fullmatch(r"[0-9a-f]{64}", base_sha256)):
        raise ConfigError(f"manifest base_sha256 {base_sha256!r} is not accepted; accepted: 64 lowercase "
                          "hexadecimal digits")
    if isinstance(scale, bool) or not isinstance(scale, Real) or not math.isfinite(scale):
        raise ConfigError(f"manifest scale {scale!r} is not accepted; accepted: a finite number")
    return Path(adapter_path), base_sha256, float(scale)


def _stat_key(path: Path) -> tuple:
    st = path.stat()
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

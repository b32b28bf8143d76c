"""LlamaConfig: the one description of a supported dense Llama, built from GGUF metadata."""
from dataclasses import dataclass

from ..errors import UnsupportedModelError

REQUIRED_KEYS = (
    "llama.block_count",
    "llama.embedding_length",
    "llama.feed_forward_length",
    "llama.attention.head_count",
    "llama.context_length",
    "llama.attention.layer_norm_rms_epsilon",
)


@dataclass(frozen=True)
class LlamaConfig:
    n_layer: int
    dim: int
    n_head: int
    n_kv_head: int
    ffn_dim: int
    vocab_size: int
    context_length: int
    rms_eps: float
    rope_base: float
    tied_embeddings: bool

    def __post_init__(self):
        for name in ("n_layer", "dim", "n_head", "n_kv_head", "ffn_dim", "vocab_size", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UnsupportedModelError(f"{name}={value!r} is not supported; accepted: a positive integer")
        if self.dim % self.n_head:
            raise UnsupportedModelError(
                f"embedding_length={self.dim} is not divisible by head_count={self.n_head}")
        if self.n_head % self.n_kv_head:
            raise UnsupportedModelError(
                f"head_count={self.n_head} is not divisible by head_count_kv={self.n_kv_head}")
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head dimension {self.head_dim} is odd; RoPE needs an even one")
        if not (self.rms_eps > 0):
            raise UnsupportedModelError(f"layer_norm_rms_epsilon={self.rms_eps!r}; accepted: > 0")
        if not (self.rope_base > 0):
            raise UnsupportedModelError(f"rope.freq_base={self.rope_base!r}; accepted: > 0")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_dim(self) -> int:
        return self.n_kv_head * self.head_dim

    @classmethod
    def from_gguf(cls, gguf, tied: bool | None = None) -> "LlamaConfig":
        """Validate a GGUF's metadata against the supported profile and build the config.

        `tied` defaults to what the file's tensors say (no `output.weight`: the head is the
        embedding); a metadata-only GGUF (a checkpoint's) passes it explicitly.
        """
        arch = gguf.get("general.architecture")
        if arch != "llama":
            raise UnsupportedModelError(
                f"general.architecture={arch!r} is not supported; accepted: 'llama' (dense Llama)")
        for key in REQUIRED_KEYS:
            if key not in gguf.fields:
                raise UnsupportedModelError(f"required metadata key {key!r} is missing")
        n_head = gguf.get("llama.attention.head_count")
        dim = gguf.get("llama.embedding_length")
        n_kv = gguf.get("llama.attention.head_count_kv", n_head)
        if any(isinstance(v, list) for v in (n_head, n_kv, gguf.get("llama.feed_forward_length"))):
            raise UnsupportedModelError("per-layer head counts or feed-forward sizes are not supported")
        head_dim = dim // n_head if n_head else 0
        rope_dims = gguf.get("llama.rope.dimension_count", head_dim)
        if rope_dims != head_dim:
            raise UnsupportedModelError(
                f"llama.rope.dimension_count={rope_dims} is not supported; accepted: the full head "
                f"dimension {head_dim} (partial RoPE is another architecture)")
        for key in ("llama.attention.key_length", "llama.attention.value_length"):
            if gguf.get(key, head_dim) != head_dim:
                raise UnsupportedModelError(f"{key}={gguf.get(key)} differs from embedding/heads={head_dim}")
        scaling = gguf.get("llama.rope.scaling.type", "none")
        if scaling != "none" or gguf.get("llama.rope.scaling.factor", 1.0) not in (0.0, 1.0):
            raise UnsupportedModelError(
                f"llama.rope.scaling.type={scaling!r} is not supported; accepted: no RoPE scaling")
        if gguf.get("llama.expert_count", 0):
            raise UnsupportedModelError("mixture-of-experts Llama is not supported; accepted: dense Llama")
        tokens = gguf.get("tokenizer.ggml.tokens")
        vocab = gguf.get("llama.vocab_size", len(tokens) if tokens is not None else 0)
        return cls(
            n_layer=gguf.get("llama.block_count"),
            dim=dim,
            n_head=n_head,
            n_kv_head=n_kv,
            ffn_dim=gguf.get("llama.feed_forward_length"),
            vocab_size=vocab,
            context_length=gguf.get("llama.context_length"),
            rms_eps=float(gguf.get("llama.attention.layer_norm_rms_epsilon")),
            rope_base=float(gguf.get("llama.rope.freq_base", 10000.0)),
            tied_embeddings=("output.weight" not in gguf.tensors) if tied is None else tied,
        )

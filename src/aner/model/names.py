"""The one table between GGUF tensor names and the Llama module tree, in both directions.

Parameter names throughout aner are the GGUF names (`blk.3.attn_q.weight`): they are what users
see in `parameter_names()`, what adapters export, and what llama.cpp reads. Each row names the
module that holds the tensor and the tensor's shape. GGUF stores Q and K already permuted for
adjacent-pair RoPE, which is the layout our forward uses, so no row needs a transform here.

A second table maps the same names to Hugging Face Llama parameter names (PEFT adapter export).
Hugging Face keeps Q and K rows in the half-split RoPE layout; its rows refer to `rope_to_hf`.
"""
import re

from ..errors import UnsupportedModelError

# gguf name                  module path             role         shape (rows, columns)
GLOBAL = {
    "token_embd.weight":   ("tok_embd",    "embedding", lambda c: (c.vocab_size, c.dim)),  # token embeddings
    "output_norm.weight":  ("output_norm", "norm",      lambda c: (c.dim,)),               # final RMSNorm
    "output.weight":       ("output",      "projection", lambda c: (c.vocab_size, c.dim)), # LM head (absent when tied)
}
PER_LAYER = {
    "attn_norm.weight":   ("attn_norm",   "norm",       lambda c: (c.dim,)),               # pre-attention RMSNorm
    "attn_q.weight":      ("attn_q",      "projection", lambda c: (c.dim, c.dim)),         # query
    "attn_k.weight":      ("attn_k",      "projection", lambda c: (c.kv_dim, c.dim)),      # key (GQA: kv heads)
    "attn_v.weight":      ("attn_v",      "projection", lambda c: (c.kv_dim, c.dim)),      # value
    "attn_output.weight": ("attn_output", "projection", lambda c: (c.dim, c.dim)),         # attention output
    "ffn_norm.weight":    ("ffn_norm",    "norm",       lambda c: (c.dim,)),               # pre-MLP RMSNorm
    "ffn_gate.weight":    ("ffn_gate",    "projection", lambda c: (c.ffn_dim, c.dim)),     # SwiGLU gate
    "ffn_up.weight":      ("ffn_up",      "projection", lambda c: (c.ffn_dim, c.dim)),     # SwiGLU up
    "ffn_down.weight":    ("ffn_down",    "projection", lambda c: (c.dim, c.ffn_dim)),     # SwiGLU down
}

# The projection aliases users may name as adapter targets (the seed's list).
ALIASES = {
    "attention.q_proj": "attn_q.weight",
    "attention.k_proj": "attn_k.weight",
    "attention.v_proj": "attn_v.weight",
    "attention.o_proj": "attn_output.weight",
    "mlp.gate_proj": "ffn_gate.weight",
    "mlp.up_proj": "ffn_up.weight",
    "mlp.down_proj": "ffn_down.weight",
}

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def rope_to_hf(w, n_head: int):
    """GGUF rows (adjacent-pair RoPE) -> Hugging Face rows (half-split RoPE) of a Q or K matrix.

    The inverse of llama.cpp convert_hf_to_gguf's `permute(w, n_head, n_head_kv)`, which is
    w.reshape(n_head, 2, E/2, *rest).swapaxes(1, 2).reshape(w.shape). Rows only: the columns (and a
    LoRA A factor) are untouched. Works on torch tensors and numpy arrays.
    """
    rows = w.shape[0]
    assert rows % (2 * n_head) == 0, (tuple(w.shape), n_head)
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# gguf name (per layer: blk.{i}.<name>)  Hugging Face name (model.layers.{i}.<name>)  row transform
HF_GLOBAL = {
    "token_embd.weight":  ("model.embed_tokens.weight", None),  # token embeddings
    "output_norm.weight": ("model.norm.weight",         None),  # final RMSNorm
    "output.weight":      ("lm_head.weight",            None),  # LM head (absent when tied)
}
HF_PER_LAYER = {
    "attn_norm.weight":   ("input_layernorm.weight",          None),                    # pre-attention RMSNorm
    "attn_q.weight":      ("self_attn.q_proj.weight",         lambda w, c: rope_to_hf(w, c.n_head)),     # query
    "attn_k.weight":      ("self_attn.k_proj.weight",         lambda w, c: rope_to_hf(w, c.n_kv_head)),  # key
    "attn_v.weight":      ("self_attn.v_proj.weight",         None),                    # value
    "attn_output.weight": ("self_attn.o_proj.weight",         None),                    # attention output
    "ffn_norm.weight":    ("post_attention_layernorm.weight", None),                    # pre-MLP RMSNorm
    "ffn_gate.weight":    ("mlp.gate_proj.weight",            None),                    # SwiGLU gate
    "ffn_up.weight":      ("mlp.up_proj.weight",              None),                    # SwiGLU up
    "ffn_down.weight":    ("mlp.down_proj.weight",            None),                    # SwiGLU down
}


def hf_name(name: str) -> str:
    """GGUF tensor name -> Hugging Face Llama parameter name."""
    return _hf_row(name)[0]


def to_hf(name: str, w, config):
    """A tensor (or the output-row factor of a LoRA delta, B) in GGUF row layout -> Hugging Face's."""
    transform = _hf_row(name)[1]
    return w if transform is None else transform(w, config)


def _hf_row(name: str):
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in HF_PER_LAYER:
        hf, transform = HF_PER_LAYER[m.group(2)]
        return f"model.layers.{m.group(1)}.{hf}", transform
    if name in HF_GLOBAL:
        return HF_GLOBAL[name]
    raise UnsupportedModelError(f"tensor {name!r} is not part of the supported Llama profile")


def expected(config) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """Every tensor a model of `config` has, in canonical order: name -> (module path, role, shape)."""
    out = {}
    out["token_embd.weight"] = _row(GLOBAL["token_embd.weight"], config)
    for i in range(config.n_layer):
        for suffix, row in PER_LAYER.items():
            path, role, shape = _row(row, config)
            out[f"blk.{i}.{suffix}"] = (f"layers.{i}.{path}", role, shape)
    out["output_norm.weight"] = _row(GLOBAL["output_norm.weight"], config)
    if not config.tied_embeddings:
        out["output.weight"] = _row(GLOBAL["output.weight"], config)
    return out


def _row(row, config):
    path, role, shape = row
    return path, role, shape(config)


def check_tensors(config, present: dict[str, tuple[int, ...]]) -> dict:
    """Refuse unknown, missing or misshapen tensors; return the expected table."""
    table = expected(config)
    for name in present:
        if name not in table:
            raise UnsupportedModelError(
                f"tensor {name!r} is not part of the supported Llama profile "
                f"(unknown or extra tensors are refused)")
    for name, (_, _, shape) in table.items():
        if name not in present:
            raise UnsupportedModelError(f"required tensor {name!r} is missing")
        if tuple(present[name]) != shape:
            raise UnsupportedModelError(
                f"tensor {name!r} has shape {tuple(present[name])}; expected {shape}")
    return table

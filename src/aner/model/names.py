"""The one table between GGUF tensor names and the Llama module tree, in both directions.

Parameter names throughout aner are the GGUF names (`blk.3.attn_q.weight`): they are what users
see in `parameter_names()`, what adapters export, and what llama.cpp reads. Each row names the
module that holds the tensor and the tensor's shape. GGUF stores Q and K already permuted for
adjacent-pair RoPE, which is the layout our forward uses, so no row needs a transform here.
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


def module_path(name: str) -> str:
    """GGUF tensor name -> path of the module that owns it in the Llama tree."""
    m = _LAYER.fullmatch(name)
    if m and m.group(2) in PER_LAYER:
        return f"layers.{m.group(1)}.{PER_LAYER[m.group(2)][0]}"
    if name in GLOBAL:
        return GLOBAL[name][0]
    raise UnsupportedModelError(f"tensor {name!r} is not part of the supported Llama profile")


def gguf_name(path: str) -> str:
    """Module path -> GGUF tensor name (the inverse of `module_path`)."""
    for name, row in GLOBAL.items():
        if row[0] == path:
            return name
    m = re.fullmatch(r"layers\.(\d+)\.(\w+)", path)
    if m:
        for suffix, row in PER_LAYER.items():
            if row[0] == m.group(2):
                return f"blk.{m.group(1)}.{suffix}"
    raise KeyError(path)


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

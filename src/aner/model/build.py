"""Build the torch Llama for a handle: weights -> modules, adapters wrapped around their targets.

This is where weight types meet the forward: a floating tensor becomes `Dense`, an NF4 weight its
packed projection, and each adapter target is wrapped by its method. The forward itself
(`llama.py`) never sees the difference.
"""
import torch
from torch import nn

from . import names
from .llama import Block, Dense, Llama, RMSNorm, attend, rope, swiglu


def weight_module(weight, device_copy=None, nf4_kernel="fused") -> nn.Module:
    if isinstance(weight, torch.Tensor):
        return Dense(weight)
    from ..quant.module import NF4Module
    return NF4Module(weight, device_copy=device_copy, decoded=nf4_kernel in ("decoded", "decoded_kept"),
                     kept=nf4_kernel == "decoded_kept")


def build(config, weights: dict, method=None, adapter_tensors: dict | None = None,
          device_copies: dict | None = None, adapter_kernel: str = "torch", layer_kernel: str = "torch",
          nf4_kernel: str = "fused", attention_kernel: str | None = None) -> Llama:
    """`device_copies`: name -> GPU copy of a packed weight, for the fused or decoded NF4 kernels
    (`nf4_kernel`); `adapter_kernel`, `layer_kernel`: the training profile's choices for the
    adapters' products and for RMSNorm, RoPE, SwiGLU, attention (and, in the loss, the head's
    cross-entropy); `attention_kernel`: the profile's choice for attention, if not layer_kernel's."""
    table = names.expected(config)
    device_copies = device_copies or {}
    norm, rotate, gate, att = RMSNorm, rope, swiglu, attend
    if layer_kernel == "fused":
        from ..kernels.layer import FusedRMSNorm, rope as rotate, swiglu as gate  # noqa: F811 Triton only when chosen
        norm = FusedRMSNorm
    attention_kernel = attention_kernel or layer_kernel
    if attention_kernel == "fused":
        from ..kernels.attention import attend as att  # noqa: F811
    elif attention_kernel == "cudnn":
        from ..kernels.cudnn_attention import attend as att  # noqa: F811
    modules = {}
    for name, (path, role, _) in table.items():
        w = weights[name]
        modules[name] = norm(w, config.rms_eps) if role == "norm" else \
            weight_module(w, device_copies.get(name), nf4_kernel)
    if method is not None:
        for target in method.config.targets:
            modules[target] = method.wrap(target, modules[target], adapter_tensors, adapter_kernel == "fused")
    layers = []
    for i in range(config.n_layer):
        per = {path.split(".")[-1]: modules[name] for name, (path, _, _) in table.items()
               if name.startswith(f"blk.{i}.")}
        layers.append(Block(config, per, rotate, gate, att))
    output = modules.get("output.weight")
    return Llama(config, modules["token_embd.weight"], layers, modules["output_norm.weight"], output)

"""Causal attention through cuDNN's graph API, forward and its deterministic backward, for training
under FP16/BF16 (profile `attention_kernel="cudnn"`; the package `nvidia-cudnn-frontend`,
`pip install 'aner[cuda]'`).

    attention  q (B, H, T, E), k, v (B, K, T, E) -> (B, H, T, E)   as `kernels.attention.attention`:
               grouped key/value heads, position i sees keys 0..i, the output over (B, T, H, E) memory

cuDNN's flash attention: the forward saves each row's log-sum-exp for backward; the backward runs
with `use_deterministic_algorithm=True`, which fixes the order of its sums, so the same inputs give
the same bits on every run and in every CUDA graph replay (the GPU tests check both). Numerics as
flash attention's: scores, softmax and sums in FP32, the probabilities and dS rounded to the
operands' dtype for their products. PyTorch's own cuDNN attention is refused under the library's
deterministic policy (its backward is the non-deterministic one); this calls the library directly.

One cuDNN graph is built for each layout of the operands (shapes, strides, dtype, device) and kept,
as is one cuDNN handle a device; both are made on the first call of a shape, which training makes
eagerly before it records CUDA graphs. On the H200 at 8 x 1024 positions, under CUDA graphs
(`benchmarks/attention_cudnn.py`): at the Llama-3.1-8B heads (E = 128) 182 / 784 us forward /
backward against 252 / 829 for ours; at the Llama-3.2-1B heads (E = 64) 123 / 607 against 138 / 496.
"""
import math

import torch

from ..model import llama
from .attention import check, grads_like

_DTYPES = {torch.float16: "HALF", torch.bfloat16: "BFLOAT16", torch.float32: "FLOAT"}
_handles = {}    # device index -> cuDNN handle
_graphs = {}     # (op, operand layouts, device) -> (graph, its tensors by name)


def available() -> bool:
    """Whether the cuDNN frontend's Python package is installed."""
    try:
        import cudnn  # noqa: F401
    except ImportError:
        return False
    return True


def supported(q: torch.Tensor) -> bool:
    """FP16/BF16 with a head width that is a multiple of 8 up to 128."""
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0 and 8 <= q.shape[-1] <= 128


def _handle(device):
    import cudnn
    if device.index not in _handles:
        with torch.cuda.device(device):
            _handles[device.index] = cudnn.create_handle()
    return _handles[device.index]


def _build(op, inputs, outputs):
    import cudnn
    q = inputs["q"]
    dtype = lambda t: getattr(cudnn.data_type, _DTYPES[t.dtype])  # noqa: E731
    g = cudnn.pygraph(io_data_type=dtype(q), intermediate_data_type=cudnn.data_type.FLOAT,
                      compute_data_type=cudnn.data_type.FLOAT, handle=_handle(q.device))
    t = {n: g.tensor_like(x.detach()) for n, x in inputs.items()}
    scale = 1.0 / math.sqrt(q.shape[-1])
    if op == "forward":
        made = g.sdpa(name=op, q=t["q"], k=t["k"], v=t["v"], generate_stats=True, attn_scale=scale,
                      use_causal_mask=True)
    else:
        made = g.sdpa_backward(name=op, q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["do"], stats=t["stats"],
                               attn_scale=scale, use_causal_mask=True, use_deterministic_algorithm=True)
    for (n, x), m in zip(outputs.items(), made):
        t[n] = m.set_output(True).set_dim(list(x.shape)).set_stride(list(x.stride())).set_data_type(dtype(x))
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return g, t


def _run(op, inputs, outputs):
    """Execute `op` ("forward" or "backward") reading `inputs` and writing `outputs` (name -> tensor)."""
    import cudnn
    named = {**inputs, **outputs}
    device = inputs["q"].device
    key = (op, device, *((n, t.shape, t.stride(), t.dtype) for n, t in named.items()))
    if key not in _graphs:
        _graphs[key] = _build(op, inputs, outputs)
    graph, tensors = _graphs[key]
    workspace = torch.empty(graph.get_workspace_size(), device=device, dtype=torch.uint8)
    handle = _handle(device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    graph.execute({tensors[n]: t for n, t in named.items()}, workspace, handle=handle)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, E = q.shape
        o = torch.empty(B, T, H, E, device=q.device, dtype=q.dtype).transpose(1, 2)
        stats = torch.empty(B, H, T, 1, device=q.device, dtype=torch.float32)
        if q.numel():
            _run("forward", {"q": q, "k": k, "v": v}, {"o": o, "stats": stats})
        ctx.save_for_backward(q, k, v, o, stats)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do):
        q, k, v, o, stats = ctx.saved_tensors
        if do.stride(-1) != 1:
            do = do.contiguous()
        dq, dk, dv = grads_like(q, k, v)
        if q.numel():
            _run("backward", {"q": q, "k": k, "v": v, "o": o, "do": do, "stats": stats}, {"dq": dq, "dk": dk, "dv": dv})
        return dq, dk, dv


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The model's attention through `attention` where it applies, else the model's own (the FP32
    policy's operands, other head widths)."""
    return attention(q, k, v) if supported(q) else llama.attend(q, k, v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal grouped-query attention, softmax scale 1 / sqrt(E), with gradients for q, k and v:
    the operands of `kernels.attention.attention`, head widths multiples of 8 up to 128, on a CUDA
    device."""
    check(q, k, v, supported(q) and q.is_cuda, "float16, bfloat16 on one CUDA device, a head width "
                                               "that is a multiple of 8 up to 128")
    return _Attention.apply(q, k, v)

"""Training profiles: the numerical choices a user makes explicitly, and nothing chosen for them.

    precision  float32 | float16 | bfloat16   operation policy for projections and attention
    optimizer  adamw | paged_adamw            where the FP32 Adam moments live
    nf4_kernel host_tiled | fused | decoded | decoded_kept   how a packed NF4 base is decoded:
                                              bounded tiles on the host, inside the GPU matrix
                                              kernels' tiles, or whole on the GPU into a transient
                                              buffer for cuBLAS, made again for backward or kept
                                              for it (one decode a micro-batch, every decoded
                                              matrix alive until backward; `kernels/nf4.py`)
    adapter_kernel torch | fused              how an adapter's rank-r products run on a GPU:
                                              torch ops, or Triton kernels that never write
                                              the (tokens, out) FP32 delta; around a GEMM
                                              base its GEMM adds onto the delta, forward and
                                              backward (`kernels/lora.py`)
    page_bytes 4 KiB .. 64 MiB, 4096-aligned  the paged optimizer's chunk per moment
    cuda_graphs false | true                  replay each micro-batch shape's recorded kernels
                                              (`graphs.py`): the same bits, without the host's
                                              per-kernel cost; the recording keeps its memory
    layer_kernel torch | fused                how RMSNorm, RoPE, SwiGLU, attention and the head's
                                              cross-entropy run on a GPU: torch ops, or Triton
                                              kernels that read and write each activation once
                                              (`kernels/layer.py`, `kernels/attention.py`,
                                              `kernels/cross_entropy.py`).
                                              RoPE gives the same bits; RMSNorm adds the block
                                              output to the residual stream in its own pass (the
                                              same sum), sums its squares in another order and
                                              hands the projections its output already in the
                                              operand dtype (rounded once, as the casts did), so
                                              the gradients of q, k, v (gate, up) meet in that
                                              dtype; SwiGLU rounds once where the torch ops
                                              round silu(gate) first; attention (FP16/BF16, head
                                              widths 16-128) keeps the flash scheme's roundings and
                                              is deterministic; the loss is the same FP32
                                              formula, its reductions in another order. On a
                                              Hopper GPU the MLP's SwiGLU runs inside its GEMMs
                                              where gate, up and down are all trained, or all
                                              adapted by fused LoRA over floating weights or
                                              kept NF4 decodes in BF16 (`kernels/mlp.py`; the
                                              same bits forward)
    attention_kernel (layer_kernel's) | torch | fused | cudnn   how attention runs on a GPU: as
                                              layer_kernel says (the default), torch's
                                              scaled_dot_product_attention, ours
                                              (`kernels/attention.py`), or cuDNN's forward and
                                              deterministic backward through its graph API
                                              (`kernels/cudnn_attention.py`; FP16/BF16, head
                                              widths multiples of 8 up to 128, the package
                                              nvidia-cudnn-frontend: pip install 'aner[cuda]')

Mixed precision is an operation policy, not a conversion: master weights, their gradients, the
Adam moments, RMSNorm, RoPE, softmax and the loss stay FP32; only projection and attention matrix
products take FP16/BF16 operands (accumulating in FP32 inside the GEMM). Adapter contractions stay
FP32 too. FP16 needs loss scaling (`scaler.py`); BF16 has FP32's exponent range and uses none.
"""
import contextlib
from dataclasses import asdict, dataclass

import torch

from ..errors import ConfigError

PRECISIONS = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OPTIMIZERS = ("adamw", "paged_adamw")
NF4_KERNELS = ("host_tiled", "fused", "decoded", "decoded_kept")
ADAPTER_KERNELS = ("torch", "fused")
LAYER_KERNELS = ("torch", "fused")
ATTENTION_KERNELS = ("torch", "fused", "cudnn")
MIN_PAGE, MAX_PAGE, DEFAULT_PAGE = 4 << 10, 64 << 20, 2 << 20


@dataclass(frozen=True)
class Profile:
    precision: str = "float32"
    optimizer: str = "adamw"
    nf4_kernel: str = "host_tiled"
    page_bytes: int = DEFAULT_PAGE
    cuda_graphs: bool = False
    adapter_kernel: str = "torch"
    layer_kernel: str = "torch"
    attention_kernel: str | None = None

    def __post_init__(self):
        for field, accepted in (("precision", PRECISIONS), ("optimizer", OPTIMIZERS), ("nf4_kernel", NF4_KERNELS),
                                ("adapter_kernel", ADAPTER_KERNELS), ("layer_kernel", LAYER_KERNELS)):
            if getattr(self, field) not in accepted:
                raise ConfigError(f"{field}={getattr(self, field)!r} is not supported; accepted: "
                                  f"{', '.join(accepted)}")
        if self.attention_kernel is not None and self.attention_kernel not in ATTENTION_KERNELS:
            raise ConfigError(f"attention_kernel={self.attention_kernel!r} is not supported; accepted: "
                              f"{', '.join(ATTENTION_KERNELS)}, or none for layer_kernel's choice")
        p = self.page_bytes
        if isinstance(p, bool) or not isinstance(p, int) or not MIN_PAGE <= p <= MAX_PAGE or p % 4096:
            raise ConfigError(f"page_bytes={p!r} is not accepted; accepted: a multiple of 4096 from "
                              f"{MIN_PAGE} (4 KiB) to {MAX_PAGE} (64 MiB)")
        if not isinstance(self.cuda_graphs, bool):
            raise ConfigError(f"cuda_graphs={self.cuda_graphs!r} is not accepted; accepted: true or false")

    def check_placement(self, device: str, storage: str) -> None:
        """Refuse combinations this build cannot run; never substitute another."""
        if device == "cpu" and self.precision != "float32":
            raise ConfigError(f"precision={self.precision!r} needs a CUDA device; on device='cpu' use "
                              "precision='float32'")
        if device == "cpu" and self.optimizer == "paged_adamw":
            raise ConfigError("optimizer='paged_adamw' pages moments between host and GPU and needs a CUDA "
                              "device; on device='cpu' use optimizer='adamw'")
        if device == "cpu" and self.cuda_graphs:
            raise ConfigError("cuda_graphs=True records CUDA graphs and needs a CUDA device; on "
                              "device='cpu' use cuda_graphs=False")
        if self.cuda_graphs and storage != "float32" and self.nf4_kernel == "host_tiled":
            raise ConfigError("cuda_graphs=True cannot record nf4_kernel='host_tiled', which copies host "
                              "tiles on every call; use nf4_kernel='fused' or 'decoded', or cuda_graphs=False")
        for field, fallback in (("nf4_kernel", "host_tiled"), ("adapter_kernel", "torch"), ("layer_kernel", "torch"),
                                ("attention_kernel", "torch")):
            value = getattr(self, field)
            if value in (fallback, None):
                continue
            if device == "cpu":
                raise ConfigError(f"{field}={value!r} runs GPU kernels and needs a CUDA device; "
                                  f"on device='cpu' use {field}={fallback!r}")
            from ..kernels import triton_installed
            if not triton_installed():          # a CUDA device's own absence is check_device's to report
                raise ConfigError(f"{field}={value!r} needs Triton, which this installation lacks (it "
                                  f"comes with PyTorch's CUDA builds); use {field}={fallback!r}")
        if self.attention_kernel == "cudnn":
            if self.precision == "float32":
                raise ConfigError("attention_kernel='cudnn' takes FP16/BF16 operands; with precision='float32' "
                                  "use attention_kernel='torch'")
            from ..kernels.cudnn_attention import available
            if not available():
                raise ConfigError("attention_kernel='cudnn' needs the package nvidia-cudnn-frontend, which this "
                                  "installation lacks (pip install 'aner[cuda]'); use attention_kernel='fused'")

    @property
    def packed_on_device(self) -> bool:
        """Whether a packed base keeps a copy on the GPU (the fused and decoded NF4 kernels)."""
        return self.nf4_kernel != "host_tiled"

    @property
    def transposed_on_device(self) -> bool:
        """Whether that copy also holds each matrix transposed, for the fused kernels' register-operand
        form (its codes for the input gradient, its FP32 absmax for both directions; made where a
        Hopper GPU runs it: `DevicePacked.from_weight`)."""
        return self.nf4_kernel == "fused"

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    def autocast(self, device: str):
        """The operation policy as a context: low-precision matmuls, everything else FP32."""
        if self.precision == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type="cuda", dtype=self.compute_dtype)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        return cls(**data)

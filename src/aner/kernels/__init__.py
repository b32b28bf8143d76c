"""GPU kernels, each beside the pure-torch reference it is tested against."""
import os

import torch

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"    # Triton's CPU interpreter (tests)

FLOATS = (torch.float32, torch.float16, torch.bfloat16)    # the operand dtypes every kernel takes
TARGET_PROGRAMS = 264    # what a launch splitting its work aims at: two programs a multiprocessor (H200)


def joins_deltas(dtype: torch.dtype, ranks) -> bool:
    """Whether adapters' deltas of these ranks, in `dtype`, may join their bases' products along K
    (`lora._joined`, which also asks their widths and bases): BF16, and every rank a multiple of 8
    (each block of columns 16-byte aligned). Triton-free, for the memory estimate too."""
    return dtype == torch.bfloat16 and all(r % 8 == 0 for r in ranks)


def triton_installed() -> bool:
    """Whether Triton imports: here, on demand, never when aner is imported (a CPU install needs none)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_available() -> bool:
    """True when the fused kernels can run: a CUDA device and Triton."""
    return torch.cuda.is_available() and triton_installed()

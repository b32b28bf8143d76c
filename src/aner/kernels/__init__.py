"""GPU kernels, each beside the pure-torch reference it is tested against."""
import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)    # the operand dtypes every kernel takes
TARGET_PROGRAMS = 264    # what a launch splitting its work aims at: two programs a multiprocessor (H200)


def fused_available() -> bool:
    """True when the fused NF4 kernels (aner.kernels.nf4) can run: a CUDA device and Triton.

    Triton is imported here, on demand, never when aner is imported (CI has no Triton).
    """
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

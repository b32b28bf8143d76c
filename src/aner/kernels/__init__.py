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


def joined_columns(widths, n_in: int, dtype: torch.dtype, ranks) -> list[tuple[int, int]] | None:
    """The columns (left, right) to spare beside each base's weight when the adapters' deltas join
    their products along K (`lora._joins`, which also asks that the bases have room and x the
    dtype): one or two bases whose outputs are at least 4x as wide as their input (gate and up),
    the first's B to the left of W, the second's to the right; else None. Triton-free, for the
    casts laid out before a run (`train.loop.kept_casts`)."""
    if not joins_deltas(dtype, ranks) or len(widths) > 2 or sum(widths) < 4 * n_in:
        return None
    return [(3 * ranks[0], 0), (0, 3 * ranks[1])][:len(widths)]


def joined_rows(widths, n_in: int, dtype: torch.dtype, ranks) -> int:
    """The rows to spare under a base's weight when du @ A joins its input gradient's GEMM along K
    (`lora._joined_grad`): one base whose input is at least twice as wide as its output (down);
    else 0. Triton-free, as `joined_columns`."""
    if not joins_deltas(dtype, ranks) or len(widths) != 1 or n_in < 2 * widths[0]:
        return 0
    return 3 * ranks[0]


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

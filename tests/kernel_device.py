"""Where the Triton kernel tests run: a CUDA device, or the CPU under Triton's interpreter
(`make test` runs them there with the Triton it pins).

The interpreter of Triton 3.6 needs numpy < 2.4: it makes a Python int of a one-element array for
a loop bound computed in a kernel (the attention's), which numpy 2.4 refuses (TypeError: only
0-dimensional arrays can be converted to Python scalars)."""
import importlib.util
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def device_or_skip() -> str:
    """'cuda', or 'cpu' under TRITON_INTERPRET=1; skips the calling test module otherwise."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed", allow_module_level=True)
    if not (torch.cuda.is_available() or INTERPRET):
        pytest.skip("needs a CUDA device, or TRITON_INTERPRET=1 for Triton's CPU interpreter",
                    allow_module_level=True)
    return "cpu" if INTERPRET else "cuda"

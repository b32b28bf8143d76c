"""Programmatic dependent launch (Hopper and later GPUs): a kernel here may be launched while the
kernel before it in the stream is still finishing, so that its launch and its programs' start
overlap that kernel's last programs instead of following them (under a CUDA graph too, where the
gap between two kernels is otherwise about a microsecond).

Every Triton kernel of the package calls `after_prior()` first, before it reads or writes memory:
its programs wait there until the kernel before it has completed and its writes are visible, then
let the kernel after it be launched. So each kernel still starts its work after the one before it
has finished, as without this launch: the same work in the same order, the same bits. After a
kernel that does not let it launch early (cuBLAS, cuDNN, the Gluon NF4 products) it launches as
that kernel's programs exit; after a copy, as it always did. Triton's CPU interpreter runs no PTX:
there `after_prior()` does nothing, and no launch asks for it."""
import functools

import torch
import triton
import triton.language as tl
from triton.language.target_info import cuda_capability_geq

from . import INTERPRETING

INTERPRETED = tl.constexpr(INTERPRETING)    # the kernels' view of it (Triton's interpreter runs no PTX)


@triton.jit
def after_prior():
    """Wait for the kernel before this one (its writes visible after this), then let the next one
    launch: the first statement of every kernel here. On a GPU without it, nothing."""
    if not INTERPRETED:
        if cuda_capability_geq(9):
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()


@functools.cache
def _dependent(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def launch_options(device: torch.device) -> dict:
    """The launch's keyword arguments on `device`: programmatic dependent launch where it exists."""
    return {"launch_pdl": True} if device.type == "cuda" and _dependent(device.index) else {}

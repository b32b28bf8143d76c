"""CUDA placement policy: explicit, deterministic, never a fallback to the CPU."""
import os

import torch

from ..errors import ResourceError

DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")


def require_cuda(device: str) -> None:
    """Refuse a CUDA device that is absent or not under the deterministic policy; enable the policy."""
    if not torch.cuda.is_available():
        raise ResourceError(f"device={device!r} needs CUDA, but this PyTorch build or machine has no CUDA "
                            "device; there is no CPU fallback: use device='cpu' explicitly")
    index = int(device.split(":", 1)[1])
    if index >= torch.cuda.device_count():
        raise ResourceError(f"device={device!r} does not exist; this machine has {torch.cuda.device_count()} "
                            f"CUDA device(s): cuda:0..cuda:{torch.cuda.device_count() - 1}")
    workspace = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if workspace not in DETERMINISTIC_WORKSPACES:
        raise ResourceError(f"CUBLAS_WORKSPACE_CONFIG={workspace!r}; deterministic CUDA training needs one of "
                            f"{DETERMINISTIC_WORKSPACES} set before the process starts "
                            "(e.g. CUBLAS_WORKSPACE_CONFIG=:4096:8)")
    torch.use_deterministic_algorithms(True)
    # Deterministic mode also fills every new tensor with NaN, a debugging aid that costs a kernel
    # per allocation; nothing here reads memory before writing it, so results do not depend on it.
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def execution_profile(device: str) -> dict:
    """What a bitwise replay depends on beyond the backend identity (which already names torch
    and the thread count): for CUDA the device, its capability, the cuBLAS policy and the Triton
    compiler that builds the fused kernels for this device."""
    if device == "cpu":
        return {"device": "cpu"}
    from importlib.metadata import PackageNotFoundError, version
    try:
        triton = version("triton")
    except PackageNotFoundError:
        triton = None
    p = torch.cuda.get_device_properties(device)
    return {"device": "cuda", "name": p.name, "capability": f"{p.major}.{p.minor}",
            "multiprocessors": p.multi_processor_count, "memory_bytes": p.total_memory,
            "cuda_runtime": torch.version.cuda, "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "triton": triton}

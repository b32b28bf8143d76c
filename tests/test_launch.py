"""Programmatic dependent launch (aner.kernels.launch).

A kernel launched so may start while the kernel before it is still running; it is safe only if it
waits for that kernel before it reads or writes memory. So every Triton kernel of the package
calls `after_prior()` first, every launch of one asks for the early start, and `after_prior()`
compiles, for Hopper, to the wait before any load or store (and to nothing before Hopper): checked
without a GPU. On a CUDA device, a chain of launches each reading what the one before it wrote
gives the bits of the same sums made one at a time, eagerly and replayed from a CUDA graph."""
import ast
import importlib.util
import pathlib
import re

import numpy as np
import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("Triton is not installed", allow_module_level=True)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import constexpr_function  # noqa: E402

from aner.kernels import launch, lora  # noqa: E402
from aner.kernels.splits import sum_splits  # noqa: E402

SOURCES = sorted(pathlib.Path(launch.__file__).parent.glob("*.py"))


def _is_triton_jit(node) -> bool:
    return any(ast.unparse(d) == "triton.jit" for d in node.decorator_list)


def _kernels(tree):
    """The module's Triton kernels: jitted functions that a launch calls (named *_kernel)."""
    return [n for n in tree.body if isinstance(n, ast.FunctionDef) and _is_triton_jit(n) and n.name.endswith("_kernel")]


def test_every_kernel_waits_for_the_one_before_it_first():
    kernels = []
    for path in SOURCES:
        for fn in _kernels(ast.parse(path.read_text())):
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body
            kernels.append(fn.name)
            assert ast.unparse(body[0]) == "after_prior()", f"{path.name}: {fn.name} starts with {ast.unparse(body[0])}"
    assert len(kernels) >= 20, kernels


def test_every_launch_asks_for_the_early_start():
    launches = 0
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        if not _kernels(tree):
            continue        # the Hopper (Gluon) kernels wait for their predecessor as any launch does
        for call in ast.walk(tree):
            if isinstance(call, ast.Call) and isinstance(call.func, ast.Subscript):
                launches += 1
                options = [k for k in call.keywords if k.arg is None and isinstance(k.value, ast.Call)
                           and ast.unparse(k.value.func) == "launch_options"]
                assert options, f"{path.name}:{call.lineno}: {ast.unparse(call.func)} launched without launch_options"
    assert launches >= 17, launches


def _ptx(arch: int, monkeypatch, tmp_path) -> list[str]:
    """The spread kernel's PTX for sm_<arch>, its lines that wait, load or store in order. The
    capability is the compile target's here: without a GPU, Triton's own check sees none."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / str(arch)))

    @constexpr_function
    def target_at_least(major, minor=0):
        return arch >= major * 10 + minor

    monkeypatch.setattr(launch, "cuda_capability_geq", target_at_least)
    signature = {"b": "*fp32", "out": "*bf16", "N": "i32", "R": "i32", "stride_bn": "i32", "stride_br": "i32",
                 "out_rows": "i32", "out_cols": "i32", "scale": "fp32", "BN": "constexpr", "RP": "constexpr"}
    src = ASTSource(fn=lora._spread_kernel, signature=signature, constexprs={"BN": 64, "RP": 16})
    ptx = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"launch_pdl": True}).asm["ptx"]
    return [line.strip() for line in ptx.splitlines() if re.search(r"griddepcontrol|ld\.global|st\.global", line)]


def test_the_wait_comes_before_every_load_and_store_on_hopper(monkeypatch, tmp_path):
    lines = _ptx(90, monkeypatch, tmp_path)
    assert lines[0].startswith("griddepcontrol.wait") and lines[1].startswith("griddepcontrol.launch_dependents")
    assert any(line.startswith(("ld.global", "@")) for line in lines[2:]), lines
    assert not any("griddepcontrol" in line for line in lines[2:]), lines


def test_no_wait_is_compiled_before_hopper(monkeypatch, tmp_path):
    lines = _ptx(80, monkeypatch, tmp_path)
    assert lines and not any("griddepcontrol" in line for line in lines), lines


def _chain(x: torch.Tensor, steps: int) -> None:
    """x[2i + 2] = x[2i] + x[2i + 1] for i < steps, one launch each: each reads the row the one
    before it wrote."""
    for i in range(steps):
        sum_splits(x[2 * i:2 * i + 2], out=x[2 * i + 2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_chain_of_dependent_launches_reads_what_each_wrote():
    steps, n = 400, 1 << 16
    gen = torch.Generator().manual_seed(5)
    noise = torch.randn(steps, n, generator=gen)
    want = np.empty((steps + 1, n), np.float32)
    want[0] = noise[0].numpy()
    for i in range(steps):            # the FP32 sums in the same order, one at a time
        want[i + 1] = want[i] + (noise[i].numpy() if i else np.float32(0))
    start = torch.full((2 * steps + 1, n), float("nan"))
    start[0], start[1] = noise[0], 0.0
    start[3:2 * steps:2] = noise[1:]
    x = start.cuda()
    assert launch.launch_options(x.device) == ({"launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9
                                               else {})
    _chain(x, steps)                  # eagerly (and every kernel compiled before the capture)
    assert np.array_equal(x[0::2].cpu().numpy(), want)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _chain(x, steps)
    for _ in range(3):
        x.copy_(start)
        graph.replay()
        assert np.array_equal(x[0::2].cpu().numpy(), want)

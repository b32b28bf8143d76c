"""The kernels' tests under Triton's CPU interpreter, then every kernel variant they launched
compiled for a GPU that is not here: does it compile with the installed Triton, with how many
registers and how much stack a thread, and does it wait for the kernel before it first
(`wait_first.py`'s rule, on its PTX). `make test` runs it so.

    python3 benchmarks/compile_kernels.py [--all] [--out OUT.json] [--arch 90] [pytest arguments]

A child process runs the tests (default: the kernels' files) under the interpreter and records
every launch of the package's kernels: the kernel and its arguments as the JIT specializes them (a
tensor's dtype and whether its address is a multiple of 16, a number as it is). Each launch is
then compiled by the JIT's own specialization and compiler for sm_<arch>, with no device (Triton
is told the target), as a GPU launches it: with what a GPU's defaults choose where the interpreter
cannot (`GPU_CHOICES`) and the launch option a Hopper GPU passes. Exits non-zero if a test fails,
or a variant fails to compile, or (for Hopper) does not wait first. `--all` also runs the BF16 cases
the interpreter skips, for their launches (their checks may fail there, and do not count), and
compiles each launch as the interpreter ran it too.

The package's Gluon kernels (Hopper's; the interpreter runs none) are compiled from their host
functions called on CPU tensors at their tests' shapes, each launch compiled and not run: does it
compile, does its shared memory fit a Hopper multiprocessor (a launch that asks more fails only on
the GPU), and does it keep to its partitions' registers (no stack: their counts are set by hand)."""
import argparse
import concurrent.futures
import itertools
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import tempfile

import torch

HERE = pathlib.Path(__file__).resolve().parent
KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_lora_kernels.py", "tests/test_layer_kernels.py",
                "tests/test_attention.py", "tests/test_cross_entropy_kernel.py", "tests/test_adamw_kernel.py"]
# What a GPU's defaults choose where the interpreter cannot run them: products on the tensor cores
# through BF16 parts (the interpreter's numpy has no BF16) and the NF4 decode's inline-PTX table.
GPU_CHOICES = {"TC": True, "LUT": 3}
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
SHARED_LIMIT = 232448   # bytes of shared memory a Hopper program may ask for
MLP_SHAPES = [(1024, 560, 1024), (1000, 200, 1352), (64, 64, 128), (4096, 1048, 4096)]   # test_layer_kernels' (M, K, F)
NF4_SHAPES = [((4096, 4096), 2048), ((1000, 1024), 4500), ((2048, 64), 4096), ((136, 4096), 8192),   # test_kernels'
              ((49152, 576), 1000), ((576, 576), 8200)]                                              # ((N, K), M)


class Recorder:
    """A pytest plugin for the child: each interpreted launch of a package kernel, and the tests'
    outcome; with `everything`, the BF16 cases' skips lifted."""

    def __init__(self, out: str, everything: bool):
        self.out, self.everything, self.launches = out, everything, set()

    def pytest_configure(self, config):
        import pytest
        from triton.runtime.interpreter import InterpretedFunction
        run, skip, launches = InterpretedFunction.run, pytest.skip, self.launches

        def recorded(fn, *args, grid, warmup, **kwargs):
            if fn.fn.__module__.startswith("aner."):
                launches.add((fn.fn.__module__, fn.fn.__qualname__, tuple(map(_arg, args)),
                              tuple(sorted((k, _arg(v)) for k, v in kwargs.items()))))
            return run(fn, *args, grid=grid, warmup=warmup, **kwargs)

        def skip_but_bf16(reason="", **kwargs):
            if "BF16" not in str(reason):
                skip(reason, **kwargs)

        skip_but_bf16.Exception = skip.Exception
        InterpretedFunction.run = recorded
        if self.everything:
            pytest.skip = skip_but_bf16

    def pytest_collection_modifyitems(self, items):
        for item in items if self.everything else ():
            item.own_markers[:] = [m for m in item.own_markers
                                   if not (m.name == "skipif" and "BF16" in str(m.kwargs.get("reason", "")))]

    def pytest_sessionfinish(self, session, exitstatus):
        outcome = {"collected": session.testscollected, "failed": session.testsfailed, "exit": int(exitstatus)}
        pathlib.Path(self.out).write_bytes(pickle.dumps((outcome, sorted(self.launches, key=repr))))


def _arg(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return ("repr", repr(value))


def _brief(args, options) -> dict:
    return {"arguments": [a for a in args if not isinstance(a, tuple)],
            "options": {a: v for a, v in options.items() if not isinstance(v, torch.Tensor)}}


def _tensor(dtype: str, aligned: bool) -> torch.Tensor:
    t = torch.empty(64, dtype=getattr(torch, dtype))
    return t if aligned else t[1:]


def _value(arg):
    if isinstance(arg, tuple) and arg[0] == "tensor":
        return _tensor(*arg[1:])
    if isinstance(arg, tuple):
        raise ValueError(f"argument not recorded: {arg[1]}")
    return arg


def _options(kwargs, arch: int, on_gpu: bool) -> dict:
    """A launch's keyword arguments: as recorded, or with a GPU's choices; and the launch option a
    Hopper GPU's launch passes (`launch.launch_options`; the interpreter's launches ask none)."""
    options = {a: _value(v) for a, v in kwargs}
    if on_gpu:
        options.update({a: v for a, v in GPU_CHOICES.items() if a in options})
    if arch >= 90:
        options["launch_pdl"] = True
    return options


class Absent:
    """The driver of the GPU that is not here: its target, device 0, stream 0."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _resources(cubin: bytes, cuobjdump: pathlib.Path) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    reg, stack, shared, local = map(int, RESOURCES.search(text).groups())
    return {"registers": reg, "stack": stack, "shared": shared, "local": local}


def compile_all(launches, arch: int, everything: bool) -> dict:
    """Every kernel's launches compiled, the kernels shared out among a process a core."""
    by_kernel, shares = {}, [[] for _ in range(os.cpu_count() or 1)]
    for launch in launches:
        by_kernel.setdefault(launch[1], []).append(launch)
    for group in sorted(by_kernel.values(), key=len, reverse=True):
        min(shares, key=len).extend(group)
    with concurrent.futures.ProcessPoolExecutor(len(shares)) as pool:
        parts = [pool.submit(_compile, s, arch, everything) for s in shares if s]
        parts += [pool.submit(compile_gluon, which, arch) for which in ("mlp", "nf4") if arch >= 90]
        return dict(sorted(kv for part in parts for kv in part.result().items()))


def _entry(**more) -> dict:
    """A kernel's record: its launches and variants, what failed, registers and stack; and `more`."""
    return {"launches": 0, "variants": 0, "failed": [], "registers": [], "stack": 0, "local": 0, "with_stack": [],
            **more}


def _variant(k: dict, compiled, cuobjdump: pathlib.Path, seen: set) -> dict | None:
    """`compiled` counted in the kernel's record k as a variant, its registers and stack: its
    resources; None where a variant of its hash was seen."""
    if compiled.hash in seen:
        return None
    seen.add(compiled.hash)
    k["variants"] += 1
    r = _resources(compiled.asm["cubin"], cuobjdump)
    k["registers"] = sorted({*k["registers"], r["registers"]})
    k["stack"], k["local"] = max(k["stack"], r["stack"]), max(k["local"], r["local"])
    return r


def _compile(launches, arch: int, everything: bool) -> dict:
    import importlib

    import triton
    from triton.runtime import driver
    from wait_first import first_lines

    driver.set_active(Absent(arch))
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    kernels, seen = {}, set()
    for module, name, args, kwargs in launches:
        k = kernels.setdefault(name, _entry(waits_first=0, no_wait=0, memory_before_wait=0))
        k["launches"] += 1
        fn = getattr(importlib.import_module(module), name)
        for on_gpu in (False, True) if everything else (True,):
            try:
                options = _options(kwargs, arch, on_gpu)
                compiled = fn.run(*map(_value, args), grid=None, warmup=True, **options)
            except Exception as e:      # noqa: BLE001 (each failure is reported, and fails the run)
                k["failed"].append(f"{_brief(args, dict(kwargs))}: {type(e).__name__}: {str(e)[:300]}")
                continue
            r = _variant(k, compiled, cuobjdump, seen)
            if r is None:
                continue
            if r["stack"]:
                k["with_stack"].append({**r, **_brief(args, options)})
            _, wait, memory = first_lines(compiled.asm["ptx"])
            if wait is None:
                k["no_wait"] += 1
            elif memory is None or wait < memory:
                k["waits_first"] += 1
            else:
                k["memory_before_wait"] += 1
    return kernels


def gluon_launches(which: str):
    """The Gluon kernels' launches as their tests make them, on CPU tensors: the MLP's ("mlp",
    `test_layer_kernels.py`) or the NF4 products' ("nf4", `test_kernels.py` and the benchmarks'
    variant without the decode, a Hopper GPU taken as present where they ask)."""
    if which == "mlp":
        from aner.kernels import mlp
        for dtype in (torch.float16, torch.bfloat16):
            for M, K, F in MLP_SHAPES:
                x, w = torch.empty(M, K, dtype=dtype), torch.empty(2 * F, K, dtype=dtype)
                g, wd = torch.empty(M, K, dtype=dtype), torch.empty(K, F, dtype=dtype)
                j = K // 4 // 16 * 16
                gate, up, _ = mlp.gated_forward(x, w[:F], w[F:])
                mlp.gated_forward(x, w[:F], w[F:], gate_cols=K - j, up_first=j)
                mlp.gated_backward(g, wd, gate, up)
                mlp.gated_backward(g, wd, gate, up.contiguous())
        return
    from aner.kernels import nf4, nf4_rs, nf4_ws
    from aner.quant.nf4 import NF4Weight
    hopper = nf4.hopper
    nf4.hopper = nf4_ws.hopper = lambda device: True
    try:
        for dtype, double_quant, ((N, K), M) in itertools.product((torch.float16, torch.bfloat16), (False, True),
                                                                  NF4_SHAPES):
            w = NF4Weight.quantize(torch.randn(N, K) * 0.02, double_quant=double_quant)
            p = nf4.DevicePacked.from_weight(w, "cpu", transposed=True)
            x, g = torch.empty(M, K, dtype=dtype), torch.empty(M, N, dtype=dtype)
            for trans, a in ((False, x), (True, g)):
                if nf4_ws.supported(a, p, trans):
                    nf4_ws.nf4_ws_matmul(a, p, trans, programs=nf4.MULTIPROCESSORS)
                    if nf4_rs.supported(a, p, trans):
                        nf4_rs.nf4_rs_matmul(a, p, trans, programs=None)
        # benchmarks/nf4_rs.py's timing-only variant, the decode left out, both ways at 4096 x 4096 x 2048
        p = nf4.DevicePacked.from_weight(NF4Weight.quantize(torch.randn(4096, 4096) * 0.02), "cpu", transposed=True)
        x = torch.empty(2048, 4096, dtype=torch.bfloat16)
        nf4_rs.nf4_rs_matmul(x, p, skip=True)
        nf4_rs.nf4_rs_matmul(x, p, True, skip=True)
    finally:
        nf4.hopper = nf4_ws.hopper = hopper


def compile_gluon(which: str, arch: int) -> dict:
    """`gluon_launches(which)` with each launch compiled for sm_<arch>, not run: each kernel's variants."""
    import triton
    from triton.experimental.gluon._runtime import GluonJITFunction
    from triton.runtime import driver

    driver.set_active(Absent(arch))
    cuobjdump = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    compiled, run, kernels = [], GluonJITFunction.run, {}

    def compile_only(self, *args, grid, warmup, **kwargs):
        dtypes = [str(a.dtype).removeprefix("torch.") for a in args if isinstance(a, torch.Tensor)]
        brief = {"arguments": [a for a in args if isinstance(a, (int, float))] + dtypes[:1],
                 "options": {a: v for a, v in kwargs.items() if isinstance(v, (bool, int, float))}}
        compiled.append((f"{self.fn.__module__.rsplit('.', 1)[-1]}.{self.fn.__qualname__}", brief,
                         run(self, *args, grid=grid, warmup=True, **kwargs)))

    GluonJITFunction.run = compile_only
    try:
        gluon_launches(which)
    except Exception as e:      # noqa: BLE001 (reported, and fails the run)
        kernels[f"{which} launches"] = _entry(shared=0, failed=[f"{type(e).__name__}: {str(e)[:300]}"])
    finally:
        GluonJITFunction.run = run
    seen = set()
    for name, brief, c in compiled:
        k = kernels.setdefault(f"{name} (Gluon)", _entry(shared=0))
        k["launches"] += 1
        r = _variant(k, c, cuobjdump, seen)
        if r is None:
            continue
        k["shared"] = max(k["shared"], c.metadata.shared)
        if r["stack"]:
            k["with_stack"].append({**r, **brief})
            k["failed"].append(f"{brief}: {r['stack']} bytes of stack (registers spilled)")
        if c.metadata.shared > SHARED_LIMIT:
            k["failed"].append(f"shared memory {c.metadata.shared} bytes; a Hopper program may ask {SHARED_LIMIT}")
    return kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="BF16 cases too, and each launch as interpreted")
    parser.add_argument("--out", help="a JSON record of every kernel's variants")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--record", help=argparse.SUPPRESS)      # the child: where to write the launches
    opts, pytest_args = parser.parse_known_args()
    if opts.record:
        import pytest
        return pytest.main(["-q", "-p", "no:cacheprovider", *pytest_args], plugins=[Recorder(opts.record, opts.all)])
    root = HERE.parent
    sys.path[:0] = [str(root / "src")]
    pytest_args = pytest_args or KERNEL_TESTS
    with tempfile.TemporaryDirectory() as tmp:
        record = pathlib.Path(tmp) / "launches.pkl"
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{root / 'src'}{os.pathsep}{root / 'tests'}"}
        child = [sys.executable, __file__, "--record", str(record), *(["--all"] if opts.all else []), *pytest_args]
        tests = subprocess.run(child, cwd=root, env=env, stdout=subprocess.DEVNULL if opts.all else None)
        if not record.exists():
            return tests.returncode or 2
        outcome, launches = pickle.loads(record.read_bytes())
        if tests.returncode and not opts.all:
            return tests.returncode
        os.environ["TRITON_CACHE_DIR"] = os.path.join(tmp, "cache")
        os.environ.pop("TRITON_INTERPRET", None)        # compiled here, not interpreted
        import triton
        kernels = compile_all(launches, opts.arch, opts.all)
    failed = sorted(n for n, k in kernels.items()
                    if k["failed"] or k.get("memory_before_wait") or (opts.arch >= 90 and k.get("no_wait")))
    for name, k in sorted(kernels.items()):
        registers = f"{k['registers'][0]}-{k['registers'][-1]}" if k["registers"] else "-"
        last = f"shared {k['shared']} B" if "shared" in k else f"wait first {k['waits_first']}/{k['variants']}"
        print(f"{name:24} {k['launches']:4} launches {k['variants']:4} variants  registers {registers}  "
              f"stack <= {k['stack']}  {last}" + "".join(f"\n    FAILED {f}" for f in k["failed"]))
    if opts.out:
        pathlib.Path(opts.out).write_text(json.dumps(
            {"schema": "aner.compile_kernels/1", "triton": triton.__version__, "arch": opts.arch, "all": opts.all,
             "tests": pytest_args, "outcome": outcome, "launches": len(launches), "kernels": kernels,
             "failed": failed}, indent=1))
    print(f"Triton {triton.__version__}, sm_{opts.arch}: {len(launches)} launches of {len(kernels)} kernels, "
          f"{sum(k['variants'] for k in kernels.values())} variants; failed: {failed or 'none'}")
    return 1 if failed or not kernels else 0


if __name__ == "__main__":
    sys.exit(main())

"""Whether every compiled kernel waits for the kernel before it before it touches global memory.

    python3 benchmarks/wait_first.py CACHE_DIR [OUT.json]

Reads every PTX file in a Triton cache (`gpu_run.sh tests` points the GPU tests' processes at one)
and, for each kernel and each compiled variant, finds the first `griddepcontrol.wait` and the
first global load, store, atomic or asynchronous copy. A kernel launched with programmatic
dependent launch (`aner.kernels.launch`) is safe only if the wait comes first; kernels without any
wait (the Hopper kernels written in Gluon) are listed apart: they are launched without it. Exits 1
if any variant accesses global memory before its wait."""
import json
import pathlib
import re
import sys

ENTRY = re.compile(r"\.entry\s+(\w+)\(")
MEMORY = re.compile(r"\b(ld\.global|st\.global|atom\.global|red\.global|cp\.async|cp\.reduce\.async)")


def first_lines(ptx: str) -> tuple[str, int | None, int | None]:
    """(kernel name, line of the first wait, line of the first global memory access)."""
    name = ENTRY.search(ptx).group(1)
    wait = memory = None
    for i, line in enumerate(ptx.splitlines()):
        if wait is None and "griddepcontrol.wait" in line:
            wait = i
        if memory is None and MEMORY.search(line):
            memory = i
    return name, wait, memory


def main(cache: str, out: str | None = None) -> int:
    kernels = {}
    for path in sorted(pathlib.Path(cache).rglob("*.ptx")):
        name, wait, memory = first_lines(path.read_text())
        k = kernels.setdefault(name, {"variants": 0, "waits_first": 0, "no_wait": 0, "memory_before_wait": []})
        k["variants"] += 1
        if wait is None:
            k["no_wait"] += 1
        elif memory is None or wait < memory:
            k["waits_first"] += 1
        else:
            k["memory_before_wait"].append(str(path))
    bad = sorted(n for n, k in kernels.items() if k["memory_before_wait"])
    for name, k in sorted(kernels.items()):
        print(f"{name:32} {k['variants']:4} variants: {k['waits_first']} wait first, {k['no_wait']} without a wait, "
              f"{len(k['memory_before_wait'])} touch memory before it")
    if out:
        pathlib.Path(out).write_text(json.dumps({"kernels": kernels, "memory_before_wait": bad}, indent=1))
    return 1 if bad or not kernels else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

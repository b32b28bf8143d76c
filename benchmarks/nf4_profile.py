"""One launch each, compiled and warmed first, of dense cuBLAS, the register-operand NF4 forward
(its default, its steps one at a time, and both without the decode), the warp-specialized one,
then the input gradient (dense, the register-operand kernel through the transposed copy, without
its decode), 4096 x 4096 at 2048 tokens (or N K M from the command line), for Nsight Compute to
profile (the profiler started around these launches only; `gpu_run.sh ncu`):

    ncu --clock-control none --profile-from-start off --set full -o rep python benchmarks/nf4_profile.py

`--summary RAW SASS OUT` reads that report's raw page and SASS source page (as CSV) and writes
OUT (JSON): for each launch its duration, instructions, the tensor pipe's active share, and, by
opcode, instructions executed, shared-memory wavefronts (and the ideal count) and the sampled
warp stalls, each a share of the launch's samples; and its most sampled SASS lines, each with
its stalls. Needs no GPU.

With NF4_PROFILE=absmax (both steps) the launches are the input gradient's only: dense, the
kernel, and `nf4_rs_partial`'s runs "amhalf" and "amone" (each lookup's multiplies by 4 or 1 of
its 8 absmax: timing only), which of a step's absmax loads and multiplies cost.
"""
import collections
import csv
import json
import os
import re
import sys

ABSMAX = os.environ.get("NF4_PROFILE") == "absmax"
LABELS = (["dense input gradient", "nf4_rs input gradient", "nf4_rs input gradient, amhalf",
           "nf4_rs input gradient, amone"] if ABSMAX else
          ["dense forward", "nf4_rs forward", "nf4_rs forward, steps one at a time", "nf4_rs forward without the decode",
           "nf4_rs forward without the decode, steps one at a time", "nf4_ws forward", "dense input gradient",
           "nf4_rs input gradient", "nf4_rs input gradient without the decode"])
RAW = {"us": "gpu__time_duration.sum", "instructions": "smsp__inst_executed.sum",
       "tensor_pipe_active_pct": "sm__pipe_shared_cycles_active.avg.pct_of_peak_sustained_elapsed",
       "shared_load_wavefronts": "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum"}


def launches():
    import torch

    from aner.kernels.nf4_rs import nf4_rs_matmul
    from aner.kernels.nf4_ws import nf4_ws_matmul

    import nf4_ws           # benchmarks/nf4_ws.py: the weights

    N, K, M = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 4096, 2048)
    p, Wd = nf4_ws.packed(N, K)
    wd = Wd.bfloat16()
    x, g = torch.randn(M, K, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
    if ABSMAX:
        return [lambda: g @ wd, lambda: nf4_rs_matmul(g, p, True), _fewer_absmax(4, g, p), _fewer_absmax(1, g, p)]
    return [lambda: x @ wd.t(), lambda: nf4_rs_matmul(x, p), lambda: nf4_rs_matmul(x, p, in_flight=1),
            lambda: nf4_rs_matmul(x, p, skip=True), lambda: nf4_rs_matmul(x, p, skip=True, in_flight=1),
            lambda: nf4_ws_matmul(x, p, False),
            lambda: g @ wd, lambda: nf4_rs_matmul(g, p, True), lambda: nf4_rs_matmul(g, p, True, skip=True)]


def _fewer_absmax(used: int, g, p):
    """The input gradient with `nf4_rs_partial.fewer_absmax(used)`'s lookup, the kernel's restored after."""
    from aner.kernels import nf4_rs
    from aner.kernels.nf4_rs import nf4_rs_matmul

    import nf4_rs_partial

    def launch():
        lookup = nf4_rs._shuffle_lookup_asm
        nf4_rs_partial.fewer_absmax(used)
        try:
            return nf4_rs_matmul(g, p, True)
        finally:
            nf4_rs._shuffle_lookup_asm = lookup
    return launch


def profile():
    import torch

    runs = launches()
    for f in runs * 20:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for f in runs:
        f()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def _sass(path: str) -> list[list[dict]]:
    """Each launch's SASS lines as dicts, in launch order."""
    out, header = [], None
    with open(path) as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] == "Kernel Name":
                out.append([])
            elif row[0] == "Address":
                header = row
            elif header:
                out[-1].append(dict(zip(header, row)))
    return out


def _stalls(line: dict) -> dict:
    """A SASS line's sampled stalls by reason (its `stall_*` columns, not the per-pipe breakdowns)."""
    return {name[6:]: _number(v) for name, v in line.items() if name.startswith("stall_") and "(" not in name}


def _samples(line: dict) -> float:
    return _number(line["Warp Stall Sampling (All Samples)"])


def summary(raw_path: str, sass_path: str) -> dict:
    with open(raw_path) as f:
        raw = list(csv.reader(f))
    columns = {name: i for i, name in enumerate(raw[0])}
    kernels = {}
    for label, row, lines in zip(LABELS, raw[2:], _sass(sass_path), strict=True):
        entry = {key: _number(row[columns[metric]]) for key, metric in RAW.items()}
        entry["kernel"] = row[columns["Kernel Name"]]
        samples = sum(_samples(line) for line in lines)
        ops = collections.defaultdict(collections.Counter)      # by opcode: instructions, wavefronts
        stalls = collections.defaultdict(collections.Counter)   # by opcode: sampled stalls by reason
        for line in lines:
            op = re.sub(r"^@!?U?P\w+\s+", "", line["Source"].strip()).split(" ")[0]
            ops[op]["executed"] += _number(line["Instructions Executed"])
            ops[op]["shared_wavefronts"] += _number(line.get("L1 Wavefronts Shared", "0"))
            ops[op]["shared_wavefronts_ideal"] += _number(line.get("L1 Wavefronts Shared Ideal", "0"))
            stalls[op].update(_stalls(line))
        entry["samples"] = samples
        top = sorted(range(len(lines)), key=lambda i: -_samples(lines[i]))[:100]
        entry["lines"] = [{"address": line["Address"], "source": line["Source"].strip(),
                           "samples_pct": round(100 * _samples(line) / samples, 2),
                           "stalls_pct": {k: round(100 * v / samples, 2) for k, v in _stalls(line).items() if v}}
                          for line in (lines[i] for i in sorted(top))]
        entry["opcodes"] = {}
        for op, counts in sorted(ops.items(), key=lambda kv: -stalls[kv[0]].total()):
            pct = {k: round(100 * v / samples, 2) for k, v in stalls[op].most_common() if v}
            if sum(pct.values()) < 0.5 and not counts["shared_wavefronts"]:
                continue
            entry["opcodes"][op] = {**counts, "samples_pct": round(sum(pct.values()), 2), "stalls_pct": pct}
        kernels[label] = entry
    return {"what": "Nsight Compute (--clock-control none --set full) of benchmarks/nf4_profile.py's launches: "
                    "each launch's duration, instructions, tensor pipe share; by opcode its instructions, shared-memory "
                    "wavefronts (and ideal) and sampled warp stalls as a share of the launch's samples; its 100 most "
                    "sampled SASS lines by address",
            "kernels": kernels}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summary"]:
        raw_path, sass_path, out = sys.argv[2:5]
        json.dump(summary(raw_path, sass_path), open(out, "w"), indent=1)
    else:
        profile()

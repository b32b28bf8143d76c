"""How the register-operand products' time falls with the decode each MMA warp does (timing only:
wrong values). Of the four code words a thread decodes in one lookup, the first `d` are decoded
as always and the rest handed to the MMA undecoded (no shift, shuffle, multiply or rounding):
d = 4 (the kernel), 3, 2 and 0; and "one": the first warpgroup decodes all its words, the second
none (a copy of the source with the second partition's lookup left out). Each in a process of its
own, alternated twice; each times the forward and the input gradient against dense cuBLAS as
`nf4_rs_barriers.py --run plain` does (launches queued behind the GPU).

What it says: the two warpgroups take each ring slot in step, so the pace is the slower one's.
With "one" the multiprocessor runs half the shuffles while the first warpgroup's decode is what it
was: if "one" is as slow as d = 4, a warp's own latency sets the pace, and a part of each step
decoded by other warps (through shared memory) would gain about what d = 3 gains; if "one" is
much faster, the shuffles' throughput across the multiprocessor sets it, and moving them to other
warps gains nothing. Runs "shared1", "shared2" and "shared4" read the last 1, 2 or 4 words' values
from shared memory instead of shuffling them (`through_shared`): whether the two share that limit.
Runs "amconst", "amone" and "amhalf" ask why the input gradient's decode costs more than the
forward's (~12 against ~8 us at 4096 x 4096 x 2048 on an H100, when the forward still decoded its
double-quantized absmax and shuffled it to a row's lanes): "amconst" multiplies every code
by 1.0 in place of its column's absmax, so the 16 absmax of a thread's step are never read from
shared memory or held; "amone" and "amhalf" multiply each lookup's 8 codes by 1 or 4 of its 8
absmax, so that 2 or 8 of a step's 16 are read and held.

    python benchmarks/nf4_rs_partial.py results/<date>-h200-nf4-rs-partial.json [run ...]   (GPU machine)
"""
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

RUNS = ["4", "3", "2", "0", "one"]


# the lane's bank from the start of shared memory; a pair's two shuffles; the pair read from there instead
LANE_BANK = ".reg .b32 lb, gs, al, ah;\nmov.u32 lb, %laneid;\nmov.u32 gs, global_smem;\nshl.b32 lb, lb, 2;\n" \
            "add.u32 lb, lb, gs;"
SHUFFLES = r"shfl\.sync\.idx\.b32 vl, \$28, lo, 0x100f, -1;\nshfl\.sync\.idx\.b32 vh, \$28, hi, 0x100f, -1;"
READS = "and.b32 al, lo, 15;\nshl.b32 al, al, 7;\nadd.u32 al, al, lb;\nld.shared.f32 vl, [al];\n" \
        "and.b32 ah, hi, 15;\nshl.b32 ah, ah, 7;\nadd.u32 ah, ah, lb;\nld.shared.f32 vh, [ah];"


def edit_lookup(edit):
    """`_shuffle_lookup_asm` with edit(text) applied to the PTX it makes (a run of its own)."""
    from aner.kernels import nf4_rs
    lookup = nf4_rs._shuffle_lookup_asm
    nf4_rs._shuffle_lookup_asm = lambda *args: edit(lookup(*args))


def through_shared(n: int):
    """`_shuffle_lookup_asm` with the last n words of each lookup read from shared memory instead of
    shuffled: lane l reads bank l at (code << 7) + 4 l from the start of the kernel's shared memory
    (whatever is there: timing only), so that a warp's 32 reads are one conflict-free wavefront, as
    a codebook copied once for each bank would be. Whether a shuffle and a shared-memory read
    share what sets the pace: if these are as slow as the shuffles, they do."""
    def shared(text):
        text = text.replace(".reg .f32 vl, vh;", ".reg .f32 vl, vh;\n" + LANE_BANK)
        for i in range(4 - n, 4):
            text, k = re.subn(rf"((shr|mov)\.b32 lo, \${4 + 2 * i}[^;]*;\nshr\.b32 hi, [^;]*;\n){SHUFFLES}",
                              rf"\1{READS}", text)
            assert k == 1, (i, text)
        return text
    edit_lookup(shared)


def undecoded(d: int):
    """`_shuffle_lookup_asm` with words d .. 3 of each lookup passed through undecoded."""
    def partial(text):
        for i in range(d, 4):
            text, n = re.subn(rf"(shr|mov)\.b32 lo, \${4 + 2 * i}[^;]*;.*?\${i}, vl, vh;",
                              f"mov.b32 ${i}, ${4 + 2 * i};", text, flags=re.S)
            assert n == 1, (i, text)
        return text
    edit_lookup(partial)


# the runs that take an edited copy of the package, the text of nf4_rs.py that they name (found once)
# replaced: "one", the second warpgroup's decode left out; "amconst", the input gradient's absmax
# never read (1.0)
EDITS = {"one": ('GROUP, LOOKUP, COLS, U, 64)', 'GROUP, "", COLS, U, 64)'),
         "amconst": ("am = gl.expand_dims(am, 0)",
                     "am = gl.expand_dims(gl.full([2, 4, 4, 2], 1.0, gl.float32, am_l), 0)")}


def edited(root: str, old: str, new: str) -> str:
    """A copy of the package under root whose nf4_rs.py has old's one occurrence replaced by new."""
    import aner
    src = os.path.dirname(os.path.dirname(aner.__file__))
    shutil.copytree(os.path.join(src, "aner"), os.path.join(root, "aner"))
    path = os.path.join(root, "aner", "kernels", "nf4_rs.py")
    text = open(path).read()
    assert text.count(old) == 1, old
    open(path, "w").write(text.replace(old, new))
    return root


def fewer_absmax(used: int):
    """`_shuffle_lookup_asm` with each multiply of a lookup by one of the first `used` (1 or 4) of its
    8 absmax ($20 + 2 i + e, for word i and element e): $20, or $20 + 4 (i // 2) + e."""
    def edit(text):
        def absmax(m):
            i, e = divmod(int(m.group(2)) - 20, 2)
            return f"{m.group(1)}${20 + (4 * (i // 2) + e if used == 4 else 0)};"
        return re.sub(r"(mul\.rn\.f32 v[lh], v[lh], )\$(2[0-7]);", absmax, text)
    edit_lookup(edit)


def main():
    if sys.argv[1] == "--run":
        import nf4_rs_barriers
        run = sys.argv[2]
        if run.startswith("shared"):
            through_shared(int(run[len("shared"):]))
        elif run in ("amone", "amhalf"):
            fewer_absmax(1 if run == "amone" else 4)
        elif run not in EDITS:
            undecoded(int(run))
        print(json.dumps(dict(nf4_rs_barriers.run(f"decoded {run}"), decoded=run)))
        return
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("PYTHONPATH", "")
    runs = sys.argv[2:] or RUNS
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        package = {run: edited(os.path.join(tmp, run), *EDITS[run]) for run in set(runs) & EDITS.keys()}
        for _ in range(2):
            for run in runs:
                first = [package[run]] if run in package else []
                env = dict(os.environ, PYTHONPATH=os.pathsep.join(first + [here, path]))
                done = subprocess.run([sys.executable, __file__, "--run", run], text=True, capture_output=True,
                                      env=env)
                sys.stderr.write(done.stderr[-2500:])
                rows.append(json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else
                            {"decoded": run, "error": done.stderr[-1500:]})
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()

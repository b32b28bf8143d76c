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


def one_decodes(root: str) -> str:
    """A copy of the package under root whose kernel's second warpgroup leaves its decode out."""
    import aner
    src = os.path.dirname(os.path.dirname(aner.__file__))
    shutil.copytree(os.path.join(src, "aner"), os.path.join(root, "aner"))
    path = os.path.join(root, "aner", "kernels", "nf4_rs.py")
    text, n = re.subn(r"DQ, LOOKUP, COLS, U, 64\)", 'DQ, "", COLS, U, 64)', open(path).read())
    assert n == 1
    open(path, "w").write(text)
    return root


def main():
    if sys.argv[1] == "--run":
        import nf4_rs_barriers
        run = sys.argv[2]
        if run.startswith("shared"):
            through_shared(int(run[len("shared"):]))
        elif run != "one":
            undecoded(int(run))
        print(json.dumps(dict(nf4_rs_barriers.run(f"decoded {run}"), decoded=run)))
        return
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.environ.get("PYTHONPATH", "")
    one = one_decodes(tempfile.mkdtemp())
    rows = []
    for _ in range(2):
        for run in sys.argv[2:] or RUNS:
            first = [one] if run == "one" else []
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(first + [here, path]))
            done = subprocess.run([sys.executable, __file__, "--run", run], text=True, capture_output=True, env=env)
            sys.stderr.write(done.stderr[-2500:])
            rows.append(json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else
                        {"decoded": run, "error": done.stderr[-1500:]})
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()

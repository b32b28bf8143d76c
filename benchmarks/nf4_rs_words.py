"""What a code layout read once a thread would gain the register-operand products (timing only:
wrong values). Each thread decodes byte t (its lane in the row's 4) of each of its rows' 8 code
words a step, yet reads all 8 words of both rows from shared memory (4 x 16 bytes, the 4 lanes of
a row reading the same): a layout in which each thread's 16 bytes (byte t of its two rows' words)
lie together would need one 16-byte read a thread, 4 wavefronts a warp. Here each step's four
reads in the kernel's PTX become one, at 16 bytes a lane apart (512 consecutive bytes a warp, as
that layout would read), its registers copied for the other three; the edited PTX goes in through
Triton's IR override in processes of their own, alternated with the kernel as compiled, each timed
as `nf4_rs_barriers.py` times it (launches queued behind the GPU, dense cuBLAS in the same process).

What it says: whether the shared-memory pipe's traffic (wgmma's operand reads, the shuffles and
these reads: `ld.shared` and `shfl` cost alike, forty-second session) is worth a new layout of the
code words.

    python benchmarks/nf4_rs_words.py results/<date>-h200-nf4-rs-words.json     (GPU machine)
"""
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

# a step's code words: rows r and r + 8 (256 bytes on) of two bases (words 0-3 and 4-7), from the
# ring's slots or from the program's first slot
LOAD = re.compile(r"ld\.shared\.v4\.b32 \t\{([^}]*)\}, \[(%r\d+)\+(\d+)\];")
WORDS = (196608, 212992)
SPREAD = ("{{\n.reg .b32 %wl, %wt;\nmov.u32 %wl, %laneid;\nand.b32 %wt, %wl, 3;\nshl.b32 %wt, %wt, 4;\n"
          "shr.u32 %wl, %wl, 2;\nshl.b32 %wl, %wl, 5;\nadd.u32 %wt, %wt, %wl;\nadd.u32 %wt, %wt, {base};\n"
          "ld.shared.v4.b32 {{{regs}}}, [%wt+{off}];\n}}")


def one_read(ptx: str) -> tuple[str, int]:
    """The PTX with each step's four word reads as one (see above) -> (PTX, steps edited)."""
    loads = [m for m in LOAD.finditer(ptx) if int(m[3]) in WORDS or int(m[3]) - 256 in WORDS]
    assert len(loads) % 4 == 0, len(loads)
    out, at, steps = [], 0, 0
    for i in range(0, len(loads), 4):
        first, *rest = loads[i:i + 4]
        assert sorted(int(m[3]) for m in loads[i:i + 4]) == [int(first[3])] * 2 + [int(first[3]) + 256] * 2
        regs = [r.strip() for r in first[1].split(",")]
        out += [ptx[at:first.start()], SPREAD.format(base=first[2], regs=first[1], off=first[3])]
        at = first.end()
        for m in rest:
            out += [ptx[at:m.start()], "\n".join(f"mov.b32 {d.strip()}, {s};" for d, s in zip(m[1].split(","), regs))]
            at = m.end()
        steps += 1
    return "".join(out + [ptx[at:]]), steps


def main():
    import nf4_rs_barriers
    if sys.argv[1] == "--run":
        print(json.dumps(nf4_rs_barriers.run(sys.argv[2])))
        return
    here = os.path.dirname(os.path.abspath(__file__))
    work = tempfile.mkdtemp()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    dump, override = os.path.join(work, "dump"), os.path.join(work, "one-read")
    done = subprocess.run([sys.executable, __file__, "--run", "dump"], capture_output=True, text=True,
                          env=dict(env, TRITON_KERNEL_DUMP="1", TRITON_DUMP_DIR=dump,
                                   TRITON_CACHE_DIR=os.path.join(work, "c")))
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    edits = {}
    for h in os.listdir(dump):
        for f in os.listdir(os.path.join(dump, h)):
            if f.startswith("_nf4_rs_kernel") and f.endswith(".ptx"):
                ptx, edits[h] = one_read(open(os.path.join(dump, h, f)).read())
                os.makedirs(os.path.join(override, h), exist_ok=True)
                open(os.path.join(override, h, f), "w").write(ptx)
    print("steps edited", edits, file=sys.stderr, flush=True)
    rows = []
    for i, run in enumerate(["plain", "one-read"] * 2):
        extra = dict(TRITON_KERNEL_OVERRIDE="1", TRITON_OVERRIDE_DIR=override) if run != "plain" else {}
        done = subprocess.run([sys.executable, __file__, "--run", run], text=True, capture_output=True,
                              env=dict(env, TRITON_CACHE_DIR=os.path.join(work, f"c{i}"), **extra))
        sys.stderr.write(done.stderr[-2500:])
        rows.append(dict(json.loads(done.stdout.splitlines()[-1]), overridden="Overriding kernel" in done.stdout)
                    if done.returncode == 0 else {"without": run, "error": done.stderr[-1500:]})
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "steps_edited": edits, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()

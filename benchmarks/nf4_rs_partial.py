"""How the register-operand products' time falls with the decode each MMA warp does (timing only:
wrong values). Of the four code words a thread decodes in one lookup, the first `d` are decoded
as always and the rest handed to the MMA undecoded (no shift, shuffle, multiply or rounding);
d = 4 (the kernel), 3, 2 and 0, each in a process of its own, alternated twice; each times the
forward and the input gradient against dense cuBLAS as `nf4_rs_barriers.py --run plain` does
(launches queued behind the GPU). If a quarter less decode a warp brings the products near the
MMA's pace, a part of each step decoded by other warps through shared memory could too; if the
time falls with the decode only slowly, the shuffles' throughput, not a warp's latency, sets it.

    python benchmarks/nf4_rs_partial.py results/<date>-h200-nf4-rs-partial.json     (GPU machine)
"""
import json
import os
import re
import subprocess
import sys

import torch

DECODED = [4, 3, 2, 0]


def undecoded(d: int):
    """`_shuffle_lookup_asm` with words d .. 3 of each lookup passed through undecoded."""
    from aner.kernels import nf4_rs
    lookup = nf4_rs._shuffle_lookup_asm

    def partial(cvt, columns):
        text = lookup(cvt, columns)
        for i in range(d, 4):
            text, n = re.subn(rf"shr\.b32 lo, \${4 + 2 * i}, sh;.*?\${i}, vl, vh;", f"mov.b32 ${i}, ${4 + 2 * i};",
                              text, flags=re.S)
            assert n == 1, (i, text)
        return text
    nf4_rs._shuffle_lookup_asm = partial


def main():
    if sys.argv[1] == "--run":
        import nf4_rs_barriers
        d = int(sys.argv[2])
        undecoded(d)
        print(json.dumps(dict(nf4_rs_barriers.run(f"decoded {d} of 4"), decoded=d)))
        return
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    rows = []
    for _ in range(2):
        for d in DECODED:
            done = subprocess.run([sys.executable, __file__, "--run", str(d)], text=True, capture_output=True, env=env)
            sys.stderr.write(done.stderr[-2500:])
            rows.append(json.loads(done.stdout.splitlines()[-1]) if done.returncode == 0 else
                        {"decoded": d, "error": done.stderr[-1500:]})
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()

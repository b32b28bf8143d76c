"""The GPU's energy per update, ours against the peer: what each side's time is made of when one
of them runs at the board's power limit. `nvidia-smi` samples the power draw and SM clock every
20 ms while each side trains (`throughput.ours`, then `throughput.peer` in its child process);
over each side's 40 timed updates (from the end of the last warm-up update to the end of the
last, on the host's wall clock) the mean power, the mean SM clock and the energy an update.

At the limit an update takes (its energy) / (the limit): a side that draws the limit throughout
can only go faster by spending fewer joules an update, and its ratio to a side that does not is
at most (the peer's joules / ours) x (the limit / the peer's mean power).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/energy.py OUT.json [model:method[:flag] ...]
"""
import json
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import throughput

QUERY = "timestamp,power.draw,clocks.sm,power.limit"


class Sampler:
    """`nvidia-smi`'s readings of `query` every 20 ms while the block runs: `lines`, as it prints
    them (comma-separated, no units), the first field its timestamp."""

    def __init__(self, query: str = QUERY):
        self.query = query

    def __enter__(self):
        # into a file: a pipe nobody reads fills in ~20 s of samples and stops the tool
        self.log = tempfile.TemporaryFile("w+")
        self.smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.query}", "--format=csv,noheader,nounits",
                                     "-lms", "20"], stdout=self.log, text=True)
        time.sleep(0.5)
        return self

    def __exit__(self, *exc):
        time.sleep(0.2)
        self.smi.terminate()
        self.smi.wait()
        self.log.seek(0)
        self.lines = self.log.read().splitlines()
        self.log.close()

    def window(self, t0: float, t1: float, updates: int) -> dict:
        """Mean power and SM clock, and joules an update, over the wall-clock window [t0, t1] of
        `updates` updates (QUERY's fields)."""
        inside = []
        for line in self.lines:
            stamp, *values = (f.strip() for f in line.split(","))
            try:
                when = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                if t0 <= when <= t1:
                    inside.append(tuple(map(float, values)))
            except ValueError:
                continue     # a reading the tool could not make ("[N/A]")
        watts = sum(s[0] for s in inside) / len(inside)
        return {"samples": len(inside), "seconds": t1 - t0, "mean_watts": watts,
                "mean_sm_mhz": sum(s[1] for s in inside) / len(inside), "limit_watts": inside[0][2],
                "joules_per_update": watts * (t1 - t0) / updates}


def main(out: str, combos: list[str]):
    rows = []
    for combo in combos or ["llama-3.2-1b:full:cudnn"]:
        with Sampler() as ours_smi:
            ours = throughput.ours(combo)
        ends, steps = ours["update_ends"], len(ours["step_seconds"])
        with Sampler() as peer_smi, tempfile.TemporaryDirectory() as tmp:
            peer = throughput.peer([throughput.pair(combo)], Path(tmp) / "peer.json", steps)[throughput.pair(combo)]
        peer_start = peer["step_ends"][0] - peer["step_seconds"][0]
        row = {"combo": combo,
               "ours": {"tokens_per_s": ours["tokens_per_s"], **ours_smi.window(ends[0], ends[-1], steps)},
               "peer": {"tokens_per_s": peer["tokens_per_s"],
                        **peer_smi.window(peer_start, peer["step_ends"][-1], len(peer["step_seconds"]))}}
        o, p = row["ours"], row["peer"]
        row["speedup"] = o["tokens_per_s"] / p["tokens_per_s"]
        row["joules_ratio"] = p["joules_per_update"] / o["joules_per_update"]
        rows.append(row)
        for side in ("ours", "peer"):
            s = row[side]
            print(f"{combo:28} {side} {s['tokens_per_s'] / 1e3:6.1f}k tok/s {s['mean_watts']:5.0f} W "
                  f"(limit {s['limit_watts']:.0f}) {s['mean_sm_mhz']:5.0f} MHz {s['joules_per_update']:6.1f} J/update "
                  f"({s['samples']} samples)", flush=True)
        print(f"{combo:28} x{row['speedup']:.3f}; the peer's joules an update / ours {row['joules_ratio']:.3f}",
              flush=True)
        Path(out).write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

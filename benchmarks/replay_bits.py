"""Whether one update's recorded forward and backward gives the same bits every time it replays.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/replay_bits.py OUT.json [model:method[:flag] ...]
        [--updates U] [--replays R]

Trains each combination of the throughput benchmark (`throughput.py`: its random models, batch,
profile and flags; graphs on) for U updates, and replays every update's recorded graph R more
times over the same inputs before the update uses it. The inputs, weights and kept casts do not
change between these replays, so each must give its first replay's loss and gradients to the last
bit: the kernels read nothing uninitialized, race nowhere and choose nothing by timing. Reports,
per combination, the replays that differed, the gradients that differed first and by how much;
exits 1 when any did. The training itself is the benchmark's (the replays add time, not updates).
"""
import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parent)]
import throughput  # noqa: E402
from aner.train.graphs import Graphed  # noqa: E402


def checking(replays: int, found: list):
    """Graphed.__call__ replaying `replays` more times per call, each compared with the first."""
    replay, calls = Graphed.__call__, [0]

    def call(self, inputs, targets, rows, scale):
        calls[0] += 1
        loss, grads = replay(self, inputs, targets, rows, scale)
        first = (loss.clone(), [g.clone() for g in grads])
        for r in range(replays):
            loss, grads = replay(self, inputs, targets, rows, scale)
            bad = [i for i, (a, b) in enumerate(zip(grads, first[1])) if not torch.equal(a, b)]
            if bad or not torch.equal(loss, first[0]):
                found.append({"update": calls[0], "replay": r + 1, "loss": [first[0].item(), loss.item()],
                              "grads_differing": len(bad), "first_grads": bad[:8],
                              "max_abs": max(((grads[i].float() - first[1][i].float()).abs().max().item()
                                              for i in bad), default=0.0)})
        return loss, grads
    return call


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("combos", nargs="*", default=["llama-3.2-1b:qlora"])
    ap.add_argument("--updates", type=int, default=4)
    ap.add_argument("--replays", type=int, default=50)
    a = ap.parse_intermixed_args()
    record = {"schema": "aner.replay_bits/1", "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": []}
    differ = False
    for combo in a.combos:
        assert "eager" not in combo.split(":"), "graphs are what is replayed"
        found = []
        Graphed.__call__, replay = checking(a.replays, found), Graphed.__call__
        t = time.perf_counter()
        try:
            result = throughput.ours(combo, steps=a.updates - 1, warmup=1)
        finally:
            Graphed.__call__ = replay
        row = {"combo": combo, "updates": a.updates, "replays_per_update": a.replays, "differing": found,
               "losses": result["losses"], "seconds": time.perf_counter() - t}
        record["rows"].append(row)
        differ |= bool(found)
        print(f"{combo:26} {a.updates} updates x {a.replays} replays: {len(found)} differed "
              f"({row['seconds']:.0f} s){'; first: ' + json.dumps(found[0]) if found else ''}", flush=True)
        Path(a.out).write_text(json.dumps(record, indent=1))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

"""Which part of a throughput run differs between processes that train other bits: one process
(`--run COMBO`) builds the run as `throughput.py` does and prints a digest of everything the first
update reads (the random base, its packed matrices, their device copies, the adapter), whether
that update's recorded graph gave other bits when replayed a second time (`replay_bits.checking`: a
process whose first replay, the graph's first execution on fresh pool memory, differs from its
second read something before it was written or raced), the update's loss, and the device copies'
digests again; the driver runs PROCESSES of them and records the first process's digests and, for
each process, its losses and what differs.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/first_update_bits.py OUT.json [COMBO] [PROCESSES (8)]
"""
import json
import subprocess
import sys

import torch

import replay_bits
import throughput
from aner.train.graphs import Graphed


def digest(t: torch.Tensor) -> int:
    """A position-weighted sum of t's bytes as 32-bit words, wrapping in int64: exact, so the same
    bytes give the same number in any summation order, and a moved or changed word another."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    b = torch.cat([b, b.new_zeros(-b.numel() % 4)]).view(torch.int32).to(torch.int64)
    return int((b * (torch.arange(b.numel(), device=b.device) % 65521 + 1)).sum())


def tensors(value) -> dict:
    """name -> digest of every tensor field of a packed weight or device copy (or of a tensor)."""
    if isinstance(value, torch.Tensor):
        return {"": digest(value)}
    return {k: digest(v) for k, v in vars(value).items() if isinstance(v, torch.Tensor)}


def one(combo: str) -> dict:
    model, method, choices = throughput.parse(combo)
    base = throughput.random_model(model)
    out = {"base": {n: digest(w) for n, w in base._weights.items()}}
    tr, va = throughput.data(base.config().vocab_size)
    src = throughput.select(base, method, choices)
    del base
    out["packed"] = {n: tensors(w) for n, w in src._weights.items()}
    out["device_copies"] = {n: tensors(p) for n, p in src._device_copies.items()}
    out["adapter"] = {n: digest(t) for n, t in src._adapter_tensors.items()}
    state, _ = src._fine_tune_start(tr, va, 1, throughput.BATCH, 1, 1e-4, 0, 1.0)
    found, replay = [], Graphed.__call__
    Graphed.__call__ = replay_bits.checking(1, found)      # each update's graph replayed once more
    try:
        m = src._train(tr, va, state, 1, progress=False)
    finally:
        Graphed.__call__ = replay
    out["second_replay_differed"] = found
    out["loss"] = m._state.losses[0]
    out["validation_loss"] = m._state.validation_loss
    out["device_copies_after"] = {n: tensors(p) for n, p in src._device_copies.items()}
    return out


def differences(a, b, where=""):
    """The keys (joined by '/') under which two nested records differ."""
    if isinstance(a, dict):
        return [d for k in a for d in differences(a[k], (b or {}).get(k), f"{where}/{k}")]
    return [] if a == b else [where]


def main():
    if sys.argv[1] == "--run":
        print(json.dumps(one(sys.argv[2])))
        return
    combo = sys.argv[2] if len(sys.argv) > 2 else "llama-3.2-1b:qlora:cudnn:fused"
    record = {"combo": combo, "first": None, "processes": []}
    for i in range(int(sys.argv[3]) if len(sys.argv) > 3 else 8):
        done = subprocess.run([sys.executable, __file__, "--run", combo], capture_output=True, text=True)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        run = json.loads(done.stdout.splitlines()[-1])
        record["first"] = record["first"] or run
        diff = differences(record["first"], run)
        record["processes"].append({"loss": run["loss"], "validation_loss": run["validation_loss"], "differ": diff})
        print(f"process {i + 1}: first loss {run['loss']!r}, {len(diff)} digests differ from process 1's"
              f"{': ' + ', '.join(diff[:20]) if diff else ''}", flush=True)
        with open(sys.argv[1], "w") as f:           # after each process: a cut call keeps what ran
            json.dump(record, f)


if __name__ == "__main__":
    main()

"""Whether PyTorch's threaded CPU cos and sin give the same bits in every process: each of
PROCESSES fresh processes (PARALLEL at once, each with cores / PARALLEL host threads; every second
one with CUDA started first) makes Llama-3.2-1B's RoPE angles for 1024 positions in float64 and
takes their cos and sin with PyTorch twice, rounded to FP32 as the tables were before the
forty-ninth session, and counts the elements of each call unequal to `llama.rope_tables` (the C
library's scalar cos and sin).

    python benchmarks/rope_bits.py OUT.json [--processes N (200)] [--parallel P (2)]
"""
import argparse
import json
import sys

import torch

import cudnn_plans
import throughput
from aner.model import llama
from aner.model.config import LlamaConfig

CONFIG = throughput.model_config("llama-3.2-1b")


def threaded(config: LlamaConfig, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The tables' cos and sin values by PyTorch's CPU kernels (T, E/2), as rope_tables made them before."""
    E = config.head_dim
    inv = config.rope_base ** (-torch.arange(0, E, 2, dtype=torch.float64) / E)
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    return angles.cos().float(), angles.sin().float()


def values(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The (T, E/2) cos and sin values of `llama.rope_tables`' (T, E) layout."""
    return cos[:, ::2], sin[:, 1::2]


def one(cuda: bool, T: int = 1024) -> dict:
    if cuda:
        torch.zeros(1, device="cuda")
    calls = [threaded(CONFIG, T), threaded(CONFIG, T)]
    want = values(*llama.rope_tables(CONFIG, T, "cpu"))
    return {"cuda": cuda, "threads": torch.get_num_threads(),
            "unequal": [[int((got != w).sum()) for got, w in zip(call, want)] for call in calls],
            "first_unequal": [int(i) for i in (calls[0][0] != want[0]).flatten().nonzero()[:1]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--processes", type=int, default=200)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--run", choices=["cpu", "cuda"])
    a = ap.parse_args()
    if a.run:
        print(json.dumps(one(a.run == "cuda")))
        return
    record = {"processes": []}
    for i, code, out, err in cudnn_plans.children(
            lambda i: [__file__, "-", "--run", ("cpu", "cuda")[i % 2]], a.processes, a.parallel):
        if code:
            sys.exit(err[-3000:])
        run = json.loads(out.splitlines()[-1])
        record["processes"].append(run)
        if any(map(any, run["unequal"])):
            print(f"process {i + 1}: {run}", flush=True)
        with open(a.out, "w") as f:           # after each process: a cut call keeps what ran
            json.dump(record, f)
        runs = record["processes"]
        if len(runs) % 10 == 0 or len(runs) == a.processes:
            print(f"{len(runs)} processes, {sum(any(r['unequal'][0]) for r in runs)} with a first call unequal, "
                  f"{sum(any(r['unequal'][1]) for r in runs)} with a second call unequal", flush=True)


if __name__ == "__main__":
    main()

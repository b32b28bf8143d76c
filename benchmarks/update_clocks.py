"""Each timed update of ours beside the GPU's SM clock, power draw, temperature and throttle
reasons (`nvidia-smi` every 20 ms, `energy.Sampler`) and the garbage collector's full passes during
the run: what makes one update slower than the rest. Two runs of 3 warm-up and 10 timed updates, the
first of the power controller's cycles (`throughput.py` times 40).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/update_clocks.py [model:method[:flag]]
"""
import gc
import sys
import time

import torch

import throughput
from energy import Sampler

WARMUP, TIMED = 3, 10
QUERY = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def wall(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"


def main():
    combo = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1b:full:cudnn"
    full_passes = []

    def collected(phase, info):
        if phase == "start" and info["generation"] == 2:
            full_passes.append(info)

    gc.callbacks.append(collected)
    for _ in range(2):
        src, tr, va, state = throughput.start(combo, WARMUP + TIMED)
        ends, walls = [], []

        def tick(state, view):
            ends.append(torch.cuda.Event(enable_timing=True))
            ends[-1].record()
            walls.append(time.time())

        with Sampler(QUERY) as smi:
            full_passes.clear()
            src._train(tr, va, state, WARMUP + TIMED, progress=False, on_update=tick)
            torch.cuda.synchronize()
        timed = ends[WARMUP - 1:]     # from the end of the last warm-up update
        print("gpu ms", " ".join(f"{a.elapsed_time(b):.1f}" for a, b in zip(timed[:-1], timed[1:])))
        print("update ends", " ".join(map(wall, walls)))
        print("full collections", len(full_passes))
        print("  ", QUERY)
        for line in smi.lines:
            print("  ", line)
        del src, tr, va, state
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

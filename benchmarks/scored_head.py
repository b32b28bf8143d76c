"""The head over the scored positions alone against the head over every position, in one process.

SmolLM2-135M LoRA (all seven projections, rank 8) on the example question/answer data, 10 timed
updates after one, alternated ROUNDS times between the two: `scored` is the library's
(`train.loss.batch` hands the head the scored rows), `every` sets `loss.scored_rows` to return
None, the head reading every position as before. Both must train the same losses to FP32
summation order; the record holds each round's seconds, their medians' ratio, the scored share
of the positions and the largest relative difference of the losses.

    python benchmarks/scored_head.py OUT.json [--device cuda:0] [--micro-batch 4] [--rounds 3]
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

from aner import gen  # noqa: E402
from aner.embedded import ensure_default_model  # noqa: E402
from aner.model.names import ALIASES  # noqa: E402
from aner.train import loss  # noqa: E402

STEPS, CONTEXT = 10, 128


def timed(model, tr, va, micro_batch: int, every: bool) -> tuple[float, tuple]:
    rows = loss.scored_rows
    loss.scored_rows = (lambda targets, multiple: None) if every else rows
    try:
        kw = dict(micro_batch=micro_batch, accumulation=max(1, 4 // micro_batch), rate=1e-3, seed=1)
        model.fine_tune(tr, va, steps=1, **kw)                      # warm-up
        start = time.perf_counter()
        trained = model.fine_tune(tr, va, steps=STEPS, **kw)
        return time.perf_counter() - start, trained._state.losses
    finally:
        loss.scored_rows = rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    base = gen.import_model(ensure_default_model(), device=a.device)
    model = base.lora(list(ALIASES), rank=8, alpha=16.0, seed=1)
    tr, va = (gen.supervised_csv(model, ROOT / "examples" / "data" / f"{role}.csv", role=role, context=CONTEXT)
              for role in ("training", "validation"))
    seconds, losses = {"scored": [], "every": []}, {}
    for _ in range(a.rounds):
        for name in seconds:
            s, losses[name] = timed(model, tr, va, a.micro_batch, name == "every")
            seconds[name].append(s)
            print(f"{name:7} {s:.2f} s", flush=True)
    scored = sum(e.scored for e in tr.items) / sum(len(e.tokens) - 1 for e in tr.items)
    record = {"device": a.device, "micro_batch": a.micro_batch, "updates": STEPS, "seconds": seconds,
              "every_over_scored": statistics.median(seconds["every"]) / statistics.median(seconds["scored"]),
              "scored_share": scored, "losses": losses,
              "max_relative_loss_difference": max(abs(x - y) / abs(y) for x, y in zip(*losses.values()))}
    Path(a.out).write_text(json.dumps(record, indent=1))
    print(json.dumps({k: v for k, v in record.items() if k != "losses"}))


if __name__ == "__main__":
    main()

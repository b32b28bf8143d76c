"""Following a training job from the command line: progress bar, metrics log, loss plot, Ctrl-C.

`follow(job, folder)` waits for a job and, at every committed update it observes in
`job.history()`, appends one JSON line to `folder/metrics.jsonl`:

    {"update": 7, "loss": 2.4811, "scored_tokens": 52, "tokens_per_s": 391.2, "elapsed_s": 1.08}

(`update` is the model's cumulative counter, so a resumed run continues the numbering;
`scored_tokens` are the update's own; tokens/s and elapsed count from the job's start.) The last
line records how the job ended: `{"status": ..., "updates": ..., "validation_loss": ...}`, or the
error of a failed job. Then `loss.png` plots the training loss over updates and the validation loss.
On a terminal a progress bar shows updates, loss, tokens/s and the ETA. Ctrl-C (SIGINT) asks the
job to stop at its next update boundary; the caller then has a stopped result to checkpoint.
"""
import json
import signal
import sys
from pathlib import Path

from .jobs import JobTimeoutError

POLL_SECONDS = 0.2


def follow(job, folder: Path, bar: bool | None = None):
    """Wait for `job` while logging it into `folder`; return its PretrainedResult."""
    log = _Log(folder / "metrics.jsonl", job.progress().steps, sys.stderr.isatty() if bar is None else bar)

    def stop(signum, frame):
        print("\naner: stopping at the next update boundary (Ctrl-C)", file=sys.stderr, flush=True)
        job.stop()

    previous = signal.signal(signal.SIGINT, stop)
    try:
        while True:
            try:
                result = job.wait(timeout=POLL_SECONDS)
            except JobTimeoutError:
                result = None
            log.add(job.history(log.count))
            if result is not None:
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    log.finish(result)
    plot(folder / "metrics.jsonl", folder / "loss.png")
    return result


class _Log:
    def __init__(self, path: Path, steps: int, bar: bool):
        self.file = open(path, "x", encoding="utf-8")      # a run folder is fresh: never overwrite
        self.count, self.tokens = 0, 0
        self.bar = None
        if bar:
            from tqdm import tqdm
            self.bar = tqdm(total=steps, unit="update", desc="training", dynamic_ncols=True, file=sys.stderr)

    def add(self, records) -> None:
        for r in records:
            self.count += 1
            self.tokens += r.scored_tokens
            rate = self.tokens / max(r.seconds, 1e-9)
            self._write({"update": r.update, "loss": r.loss, "scored_tokens": r.scored_tokens,
                         "tokens_per_s": round(rate, 3), "elapsed_s": round(r.seconds, 3)})
            if self.bar is not None:
                self.bar.set_postfix(loss=f"{r.loss:.4f}", tok_s=f"{rate:.0f}", refresh=False)
                self.bar.update(1)

    def finish(self, result) -> None:
        if self.bar is not None:
            self.bar.close()
        end = {"status": result.status(), "updates": result.updates()}
        if result.status() == "failed":
            end["error"] = result.error()
        elif result.updates() > 0:
            end["validation_loss"] = result.validation_loss()
        self._write(end)
        self.file.close()

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()


def read(path) -> tuple[list[dict], dict | None]:
    """(update lines, final line or None) of a metrics.jsonl."""
    lines = [json.loads(s) for s in Path(path).read_text(encoding="utf-8").splitlines() if s.strip()]
    updates = [x for x in lines if "update" in x]
    final = next((x for x in lines if "status" in x), None)
    return updates, final


def plot(metrics_path, png_path) -> None:
    """Training loss over updates and the final validation loss, as a PNG (matplotlib, Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator
    updates, final = read(metrics_path)
    fig = Figure(figsize=(6.4, 4.0), layout="tight")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot([x["update"] for x in updates], [x["loss"] for x in updates], marker="." if len(updates) < 50 else None,
            label="training loss (per update)")
    if final and final.get("validation_loss") is not None and updates:
        ax.plot([updates[-1]["update"]], [final["validation_loss"]], "s", color="tab:red",
                label=f"validation loss {final['validation_loss']:.4f}")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("update")
    ax.set_ylabel("token-weighted cross-entropy")
    ax.set_title(f"{Path(metrics_path).parent.name}: {final['status'] if final else 'running'}")
    ax.grid(alpha=0.3)
    ax.legend()
    with open(png_path, "xb") as f:
        fig.savefig(f, format="png", dpi=100)

"""CPU comparison on SmolLM2-135M: a QLoRA update against a LoRA update on the FP32 base.

Both variants train the same targets (all seven projection aliases of every layer) at the same
rank, on the same data, micro-batch and seeds. Each runs in its own subprocess so that their
memory peaks do not mix:

    lora_fp32   gen.import_model(f16 gguf)               -> .lora(...)   FP32 base, Dense projections
    qlora       gen.import_nf4(f16 gguf, double_quant)   -> .qlora(...)  packed base, nf4_linear tiles

Per variant: import, select, then one optimizer run of 1 + 3 updates. The first update is the
warmup (module build, first allocations); the median of the other three is reported. Update
times are taken between committed updates (the training loop's update boundary), so they exclude
import, selection and the final validation pass. Both wall and process CPU seconds are recorded;
with one torch thread (the default here) CPU seconds stay meaningful on a shared, busy host.

Memory: peak RSS (VmHWM, /proc/self/status) of the import phase, then reset (clear_refs 5) and
measured again over selection + training; ru_maxrss is the whole subprocess. The import peak
includes the memory-mapped source GGUF pages it touched (about 258 MiB of F16 for SmolLM2, both
variants alike). Owned bytes are `memory_summary()`: tensor buffers, not RSS.

Usage:  python benchmarks/qlora_cpu.py   ->  prints JSON and writes benchmarks/results/<date>-cpu-qlora.json
"""
import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "examples" / "data"
TARGETS = ["attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
RANK, ALPHA, SEED = 8, 16.0, 0
MICRO_BATCH, CONTEXT, RATE = 4, 128, 1e-4
WARMUP, TIMED = 1, 3
VARIANTS = ("lora_fp32", "qlora")


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")   # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def run_variant(variant: str, threads: int) -> dict:
    import torch
    from aner import gen
    from aner.embedded import ensure_default_model

    torch.set_num_threads(threads)

    path = ensure_default_model()
    t0 = time.perf_counter()
    base = gen.import_nf4(path, double_quant=True) if variant == "qlora" else gen.import_model(path)
    import_s = time.perf_counter() - t0
    rss_after_import = _status_kib("VmRSS") * 1024
    peak_import = _status_kib("VmHWM") * 1024
    reset = _reset_peak()

    tr = gen.supervised_csv(base, DATA / "training.csv", role="training", context=CONTEXT)
    va = gen.supervised_csv(base, DATA / "validation.csv", role="validation", context=CONTEXT)
    select = base.qlora if variant == "qlora" else base.lora
    model = select(targets=TARGETS, rank=RANK, alpha=ALPHA, seed=SEED)
    # fine_tune(...) split in two so that each committed update can be timed (benchmark-only use
    # of the private hooks; the numerics are fine_tune's).
    state, steps = model._fine_tune_start(tr, va, WARMUP + TIMED, MICRO_BATCH, 1, RATE, SEED, 1.0)
    marks, cpu = [time.perf_counter()], [time.process_time()]

    def mark(s, view):
        marks.append(time.perf_counter())
        cpu.append(time.process_time())

    load_before = os.getloadavg()[0]
    trained = model._train(tr, va, state, steps, progress=False, on_update=mark)
    updates = [b - a for a, b in zip(marks, marks[1:])]
    cpu_updates = [b - a for a, b in zip(cpu, cpu[1:])]
    mem = trained.memory_summary()
    return {
        "variant": variant, "storage": trained.storage(), "method": trained.method(),
        "source_sha256": base.source_sha256(),
        "trainable_parameters": trained.trainable_parameters(),
        "scored_tokens": trained.scored_tokens(), "losses": list(trained._state.losses),
        "validation_loss": trained.validation_loss(),
        "import_seconds": import_s,
        "warmup_update_seconds": updates[:WARMUP],
        "timed_update_seconds": updates[WARMUP:],
        "median_update_seconds": statistics.median(updates[WARMUP:]),
        # CPU seconds of the whole process (all threads) per update: less sensitive than wall time
        # to other processes on a shared host.
        "timed_update_cpu_seconds": cpu_updates[WARMUP:],
        "median_update_cpu_seconds": statistics.median(cpu_updates[WARMUP:]),
        "load_average_1min_before_after": [load_before, os.getloadavg()[0]],
        "rss_after_import_bytes": rss_after_import,
        "peak_rss_import_bytes": peak_import,
        "peak_rss_training_bytes": _status_kib("VmHWM") * 1024 if reset else None,
        "ru_maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "owned": mem.as_dict(),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variant", choices=VARIANTS, help="run one variant in this process (internal)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads per variant (default 1: on a shared host, several OpenMP "
                         "threads spin at barriers when descheduled, which inflates wall and CPU time)")
    ap.add_argument("--out", type=Path, default=None, help="result file (default: benchmarks/results/<date>-cpu-qlora.json)")
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant, args.threads)))
        return
    started, load_at_start = datetime.datetime.now(), os.getloadavg()
    results = {}
    for variant in VARIANTS:
        proc = subprocess.run([sys.executable, __file__, "--variant", variant, "--threads", str(args.threads)],
                              capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
        if proc.returncode != 0:
            sys.exit(f"variant {variant} failed:\n{proc.stderr}")
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    lora, qlora = results["lora_fp32"], results["qlora"]
    report = {
        "benchmark": "cpu-qlora", "date": started.date().isoformat(),
        "model": "SmolLM2-135M-Instruct F16 GGUF", "source_sha256": lora["source_sha256"],
        "host": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                 "cpus": os.cpu_count(), "load_average_at_start": load_at_start,
                 "load_average_at_end": os.getloadavg()},
        "setup": {"targets": TARGETS, "rank": RANK, "alpha": ALPHA, "micro_batch": MICRO_BATCH,
                  "accumulation": 1, "context": CONTEXT, "rate": RATE, "seed": SEED,
                  "warmup_updates": WARMUP, "timed_updates": TIMED, "torch_threads": args.threads,
                  "data": "examples/data/training.csv, validation.csv"},
        "time_ratio_qlora_over_lora": qlora["median_update_seconds"] / lora["median_update_seconds"],
        "cpu_time_ratio_qlora_over_lora": qlora["median_update_cpu_seconds"] / lora["median_update_cpu_seconds"],
        "owned_weight_bytes": {"lora_fp32": lora["owned"]["weight_bytes"], "qlora": qlora["owned"]["weight_bytes"]},
        "peak_rss_training_bytes": {v: results[v]["peak_rss_training_bytes"] for v in VARIANTS},
        "ru_maxrss_bytes": {v: results[v]["ru_maxrss_bytes"] for v in VARIANTS},
        "variants": results,
        "notes": "CPU FP32, default 4 MiB decoded tile for NF4. Peak RSS is per subprocess; the import "
                 "peak includes the memory-mapped source pages. Owned bytes are tensor buffers, not RSS.",
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"{report['date']}-cpu-qlora.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main()

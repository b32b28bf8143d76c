"""GPU qualification of the training profiles on random-weight models of real shapes.

For each storage x method x precision x optimizer x NF4 kernel combination on a SmolLM2-135M-shaped
model: one warm-up update, then three timed updates (synchronised, without evaluation), the Torch
allocator peak, the validation loss, and exact resume (1 update + checkpoint + reload + 1 update
== 2 updates, bitwise).
Writes a JSON record in the spirit of the seed's qualification record.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/gpu_profiles.py OUT.json [KEY-PARTS]
KEY-PARTS (e.g. "nf4,tinylora") keeps the combinations whose storage/method/precision/optimizer/
kernel key contains one of them, for a run split over several calls.
Needs ANER_TOKENIZER_GGUF (a metadata-only GGUF with SmolLM2's tokenizer) or the cached model.
"""
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from aner import gen  # noqa: E402
from fixtures import SMOLLM2, tokenizer_fields, write_random_llama  # noqa: E402

DEV = "cuda:0"
EXAMPLES = ROOT / "examples" / "data"


def tokenizer_source():
    carried = os.environ.get("ANER_TOKENIZER_GGUF")
    if carried:
        return carried
    from aner.embedded import ensure_default_model
    return ensure_default_model()


def select(base, method):
    return base if method == "full" else getattr(base, {"rslora": "rs_lora"}.get(method, method))(rank=16, seed=3)


def equal(a, b):
    pairs = [(a._adapter_tensors[k], b._adapter_tensors[k]) for k in a._adapter_tensors]
    pairs += [(x, b._weights[k]) for k, x in a._weights.items() if isinstance(x, torch.Tensor)]
    pairs += [(m, b._state.moments[k][0]) for k, (m, _) in a._state.moments.items()]
    pairs += [(v, b._state.moments[k][1]) for k, (_, v) in a._state.moments.items()]
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in pairs) and a.scored_tokens() == b.scored_tokens()


def run_one(base, tr, va, storage, method, precision, optimizer, kernel, work):
    src = select(base, method).with_training_profile(precision=precision, optimizer=optimizer,
                                                              nf4_kernel=kernel)
    kw = dict(micro_batch=4, accumulation=1, rate=1e-4, seed=5)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model = src.fine_tune(tr, va, steps=1, **kw)  # warm-up update (and evaluation)
    ticks = []

    def tick(state, view):
        torch.cuda.synchronize()
        ticks.append(time.perf_counter())

    model = model._train(tr, va, model._state, 4, progress=False, on_update=tick)
    times = [b - a for a, b in zip(ticks[:-1], ticks[1:])]  # three updates between four boundaries
    peak = torch.cuda.max_memory_allocated()
    two = src.fine_tune(tr, va, steps=2, **kw)
    one = src.fine_tune(tr, va, steps=1, **kw)
    ck = Path(work) / f"{storage}-{method}-{precision}-{optimizer}-{kernel}"
    one.checkpoint(ck)
    resumed = gen.load_pretrained_checkpoint(ck, device=DEV, max_memory_bytes=64 << 30).resume(tr, va, steps=1)
    mem = model.memory_summary().as_dict()
    mem.pop("scope")
    return {"storage": storage, "method": method, "precision": precision, "optimizer": optimizer,
            "nf4_kernel": kernel, "exact_resume": equal(two, resumed), "update_seconds": times,
            "median_update_seconds": statistics.median(times), "torch_allocated_peak_bytes": peak,
            "validation_loss": model.validation_loss(), "trainable_parameters": model.trainable_parameters(),
            "training_profile": model.training_profile(), "memory": mem}


def main(out, only=""):
    work = tempfile.mkdtemp()
    path = write_random_llama(Path(work) / "smollm2-shape.gguf", SMOLLM2, tokenizer_fields(tokenizer_source()), "f32")
    cpu = gen.import_model(path, max_memory_bytes=64 << 30)
    tr = gen.supervised_csv(cpu, EXAMPLES / "training.csv", role="training", context=128)
    va = gen.supervised_csv(cpu, EXAMPLES / "validation.csv", role="validation", context=128)
    gpu = gen.import_model(path, device=DEV, max_memory_bytes=64 << 30)
    toks = list(range(100, 164))
    a, b = cpu.logits(toks), gpu.logits(toks)
    record = {
        "schema": "aner.gpu-profile-qualification/1",
        "date": time.strftime("%Y-%m-%d"),
        "environment": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                        "cuda": torch.version.cuda, "python": platform.python_version(),
                        "backend": gen.training_backend(),
                        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG")},
        "model": {"shape": "SmolLM2-135M (random weights)", "parameters": cpu.parameters()},
        "data": {"training": tr.summary(), "validation": va.summary(), "micro_batch": 4},
        "cuda_fp32_vs_cpu_logits": {"values": int(a.size), "max_abs_error": float(abs(a - b).max()),
                                    "max_scaled_error": float(abs(a - b).max() / abs(a).max())},
        "combinations": [],
    }
    # Floating bases: every method under every precision and optimizer. Packed bases: LoRA under
    # every profile with the fused kernels, the other methods under one, LoRA with the decoded
    # products under BF16; host tiling (about 3 s an update at this size) under FP32 and BF16.
    # tests/test_gpu.py runs the full cross product on a tiny model.
    profiles = [(p, o) for p in ("float32", "float16", "bfloat16") for o in ("adamw", "paged_adamw")]
    combos = [("float32", m, p, o, "host_tiled") for m in ("full", "lora", "rslora", "lora_fa", "tinylora")
              for p, o in profiles]
    combos += [("nf4_double_quant", "lora", p, o, "fused") for p, o in profiles]
    combos += [("nf4", "lora", "bfloat16", "adamw", "fused"), ("nf4_double_quant", "rslora", "bfloat16", "adamw", "fused"),
               ("nf4_double_quant", "lora_fa", "float16", "adamw", "fused"),
               ("nf4_double_quant", "tinylora", "bfloat16", "paged_adamw", "fused"),
               ("nf4_double_quant", "lora", "bfloat16", "adamw", "decoded"),
               ("nf4_double_quant", "lora", "float32", "adamw", "host_tiled"),
               ("nf4_double_quant", "lora", "bfloat16", "adamw", "host_tiled")]
    if only:  # a split run: "nf4,tinylora" keeps combinations whose s/m/p/o/k key contains either
        combos = [c for c in combos if any(part in "/".join(c) for part in only.split(","))]
    # Handles are immutable and training never changes its source: one base per storage serves all.
    bases = {"float32": gpu, "nf4": gpu.nf4(double_quant=False), "nf4_double_quant": gpu.nf4()}
    for storage, method, precision, optimizer, kernel in combos:
        try:
            r = run_one(bases[storage], tr, va, storage, method, precision, optimizer, kernel, work)
        except Exception as e:  # recorded, not hidden: the record says what failed and why
            r = {"storage": storage, "method": method, "precision": precision, "optimizer": optimizer,
                 "nf4_kernel": kernel, "error": f"{type(e).__name__}: {e}"}
        record["combinations"].append(r)
        print(f"{storage:17} {method:9} {precision:9} {optimizer:12} {kernel:10} "
              + (f"exact={r['exact_resume']} median={r['median_update_seconds'] * 1e3:8.1f} ms "
                 f"peak={r['torch_allocated_peak_bytes'] / 2**20:8.0f} MiB loss={r['validation_loss']:.4f}"
                 if "error" not in r else r["error"][:150]), flush=True)
        Path(out).write_text(json.dumps(record, indent=1))  # kept current: a cut-off run still records
    record["passed"] = all(r.get("exact_resume") for r in record["combinations"])
    Path(out).write_text(json.dumps(record, indent=1))
    print(f"wrote {out}; all exact: {record['passed']}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

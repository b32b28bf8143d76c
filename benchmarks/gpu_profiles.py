"""GPU qualification of the training profiles on random-weight models of real shapes.

For each storage x method x precision x optimizer combination on a SmolLM2-135M-shaped model:
one warm-up update, then three timed updates (synchronised), the Torch allocator peak, the
validation loss, and exact resume (1 update + checkpoint + reload + 1 update == 2 updates, bitwise).
Writes a JSON record in the spirit of the seed's qualification record.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/gpu_profiles.py OUT.json [STORAGE-PREFIX]
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


def select(base, storage, method):
    if storage != "float32":
        base = base.nf4(double_quant=storage == "nf4_double_quant")
    return base if method == "full" else getattr(base, {"rslora": "rs_lora"}.get(method, method))(rank=16, seed=3)


def equal(a, b):
    pairs = [(a._adapter_tensors[k], b._adapter_tensors[k]) for k in a._adapter_tensors]
    pairs += [(x, b._weights[k]) for k, x in a._weights.items() if isinstance(x, torch.Tensor)]
    pairs += [(m, b._state.moments[k][0]) for k, (m, _) in a._state.moments.items()]
    pairs += [(v, b._state.moments[k][1]) for k, (_, v) in a._state.moments.items()]
    return all(torch.equal(x.cpu(), y.cpu()) for x, y in pairs) and a.scored_tokens() == b.scored_tokens()


def run_one(path, tr, va, storage, method, precision, optimizer, work):
    base = gen.import_model(path, device=DEV, max_memory_bytes=64 << 30)
    src = select(base, storage, method).with_training_profile(precision=precision, optimizer=optimizer)
    kw = dict(micro_batch=4, accumulation=1, rate=1e-4, seed=5)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model = src.fine_tune(tr, va, steps=1, **kw)  # warm-up update (and evaluation)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        model = model.resume(tr, va, steps=1)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    peak = torch.cuda.max_memory_allocated()
    two = src.fine_tune(tr, va, steps=2, **kw)
    one = src.fine_tune(tr, va, steps=1, **kw)
    ck = Path(work) / f"{storage}-{method}-{precision}-{optimizer}"
    one.checkpoint(ck)
    resumed = gen.load_pretrained_checkpoint(ck, device=DEV, max_memory_bytes=64 << 30).resume(tr, va, steps=1)
    mem = model.memory_summary().as_dict()
    mem.pop("scope")
    return {"storage": storage, "method": method, "precision": precision, "optimizer": optimizer,
            "exact_resume": equal(two, resumed), "update_seconds": times,
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
    # Floating bases: every method under every precision and optimizer. Packed bases decode on the
    # host (about 3 s an update at this size), so they get LoRA under every profile and the other
    # methods under the default one: the tests/test_gpu.py matrix covers them all on a tiny model.
    combos = [(s, m, p, o) for s, m in [("float32", "full"), ("float32", "lora"), ("float32", "rslora"),
                                        ("float32", "lora_fa"), ("float32", "tinylora"), ("nf4_double_quant", "lora")]
              for p in ("float32", "float16", "bfloat16") for o in ("adamw", "paged_adamw")]
    combos += [("nf4", "lora", "float32", "adamw"), ("nf4_double_quant", "lora_fa", "float32", "adamw"),
               ("nf4_double_quant", "tinylora", "float32", "adamw")]
    if only:  # e.g. "nf4": run the combinations whose storage starts with it (a split run)
        combos = [c for c in combos if c[0].startswith(only)]
    for storage, method, precision, optimizer in combos:
        try:
            r = run_one(path, tr, va, storage, method, precision, optimizer, work)
        except Exception as e:  # recorded, not hidden: the record says what failed and why
            r = {"storage": storage, "method": method, "precision": precision, "optimizer": optimizer,
                 "error": f"{type(e).__name__}: {e}"}
        record["combinations"].append(r)
        print(f"{storage:17} {method:9} {precision:9} {optimizer:12} "
              + (f"exact={r['exact_resume']} median={r['median_update_seconds'] * 1e3:8.1f} ms "
                 f"peak={r['torch_allocated_peak_bytes'] / 2**20:8.0f} MiB loss={r['validation_loss']:.4f}"
                 if "error" not in r else r["error"][:150]), flush=True)
        Path(out).write_text(json.dumps(record, indent=1))  # kept current: a cut-off run still records
    record["passed"] = all(r.get("exact_resume") for r in record["combinations"])
    Path(out).write_text(json.dumps(record, indent=1))
    print(f"wrote {out}; all exact: {record['passed']}")


if __name__ == "__main__":
    main(*sys.argv[1:3])

"""Where one training update's time goes, on a SmolLM2-shaped random model (GPU).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/profile_step.py
"""
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
from aner import gen  # noqa: E402
from aner.train.loop import summed_loss, evaluate  # noqa: E402
from fixtures import SMOLLM2, tokenizer_fields, write_random_llama  # noqa: E402

DEV = "cuda:0"


def timed(label, fn, n=5):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    print(f"{label:40} {(time.perf_counter() - t) / n * 1e3:9.2f} ms")


def main():
    work = tempfile.mkdtemp()
    path = write_random_llama(Path(work) / "m.gguf", SMOLLM2, tokenizer_fields(os.environ["ANER_TOKENIZER_GGUF"]), "f32")
    cpu = gen.import_model(path)
    ex = ROOT / "examples" / "data"
    tr = gen.supervised_csv(cpu, ex / "training.csv", role="training", context=128)
    va = gen.supervised_csv(cpu, ex / "validation.csv", role="validation", context=128)
    base = gen.import_model(path, device=DEV).lora(rank=16)
    model = base.module()
    for t in base._adapter_tensors.values():
        t.requires_grad_(True)
    batch = list(tr.items[:4])
    timed("forward (no grad), micro-batch 4", lambda: torch.no_grad()(summed_loss)(model, batch, DEV))
    timed("forward+backward, micro-batch 4", lambda: summed_loss(model, batch, DEV).backward())
    timed("evaluate (6 examples)", lambda: evaluate(model, va, DEV))
    m = base.fine_tune(tr, va, steps=1, micro_batch=4)
    timed("resume 1 update (incl. evaluation)", lambda: m.resume(tr, va, steps=1), n=3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        m.resume(tr, va, steps=1)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=50))
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=50))


if __name__ == "__main__":
    main()

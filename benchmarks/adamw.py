"""One AdamW update of a full fine-tuning's FP32 parameters: ours against torch.optim.AdamW.

    python benchmarks/adamw.py OUT.json [--device cpu|cuda:0] [--models smollm2-135m ...] [--updates N]

Every weight of a model of the real shape (`throughput.MODELS`) is trainable, with a fixed random
gradient. Each optimizer updates its own copy: ours (`aner.train.optim.AdamW`: on CUDA our
kernel, on the CPU torch's fused one), and the peer's two settings, torch.optim.AdamW with
foreach=True (the multi-tensor ops) and with fused=True; ours and fused=True again with a
clipping divisor (1.0: the gradients stay what they are, the division is still made; torch's
kernel then writes them back); and ours with the divisor writing each matrix's BF16 cast as
full fine-tuning under BF16 does, against fused=True with the divisor followed by those casts
(what the forward made before). Each warms up with one update, then N timed updates (device
synchronised); the record gives the median seconds per update, the ratios, and whether ours
equals fused=True bit for bit after all updates, in each setting (the casts too).

On CUDA each row also times clipping's norm over the same gradients: the float64 sum of squares by
our kernel (`kernels.adamw.squares`, at its default chunk and warps and at others) against torch's
float64 multi-tensor norm (`torch._foreach_norm`, each tensor's norm squared and summed: what the
clipping made before), with each one's bandwidth and relative difference from the float64 sum.
"""
import argparse
import datetime
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from throughput import MODELS, model_config  # (it also puts src/ on the path)

from aner.model import names  # noqa: E402
from aner.train.optim import AdamW  # noqa: E402

RATE, DECAY = 1e-4, 0.01


def shapes(model: str) -> list[tuple[int, ...]]:
    return [shape for _, _, shape in names.expected(model_config(model)).values()]


def timed(update, device: str, n: int) -> list[float]:
    update()                                                   # warmup: allocations, first launch
    out = []
    for _ in range(n):
        if device != "cpu":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        update()
        if device != "cpu":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return out


def measure(model: str, device: str, n: int) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    made = [(torch.randn(s, device=device, generator=g), torch.randn(s, device=device, generator=g))
            for s in shapes(model)]
    grads = {f"w{i}": gr for i, (_, gr) in enumerate(made)}
    adamw, one = AdamW(RATE, weight_decay=DECAY), torch.ones((), device=device)
    seconds, ours, peers = {}, {}, {}
    cast = device != "cpu"                             # the CPU refuses a BF16 policy
    for divided, with_casts in ((False, False), (True, False)) + (((True, True),) if cast else ()):
        params = {f"w{i}": p.clone() for i, (p, _) in enumerate(made)}
        moments, t = adamw.init_moments(params), [0]
        casts = {n: p.bfloat16() for n, p in params.items() if p.dim() == 2} if with_casts else None

        def step_ours():
            t[0] += 1
            adamw.step(params, grads, moments, t[0], one if divided else None, casts)

        key = "ours" + "_divided" * divided + "_casts" * with_casts
        seconds[key] = timed(step_ours, device, n)
        ours[key] = params, casts
    for setting, divided, with_casts in (("foreach", False, False), ("fused", False, False), ("fused", True, False)) \
            + ((("fused", True, True),) if cast else ()):
        params = [p.clone().requires_grad_(True) for p, _ in made]
        for p, (_, gr) in zip(params, made):
            p.grad = gr.clone()
        opt = torch.optim.AdamW(params, lr=RATE, weight_decay=DECAY, **{setting: True})
        if divided:
            opt.grad_scale = one                      # what GradScaler hands a fused optimizer
        casts = [p.detach().bfloat16() for p in params if p.dim() == 2] if with_casts else None

        def step_peer():
            opt.step()
            if casts is not None:
                torch._foreach_copy_(casts, [p.detach() for p in params if p.dim() == 2])

        key = setting + "_divided" * divided + "_casts" * with_casts
        seconds[key] = timed(step_peer, device, n)
        peers[key] = params, casts

    def same(key):
        (mine, my_casts), (theirs, their_casts) = ours[key.replace("fused", "ours")], peers[key]
        return all(torch.equal(mine[f"w{i}"], p.detach()) for i, p in enumerate(theirs)) and \
            (my_casts is None or all(torch.equal(a, b) for a, b in zip(my_casts.values(), their_casts)))
    median = {k: statistics.median(v) for k, v in seconds.items()}
    return {"model": model, "parameters": sum(p.numel() for p in ours["ours"][0].values()),
            "seconds_per_update": median, "all_seconds": seconds,
            "foreach_over_ours": median["foreach"] / median["ours"],
            **{f"{k}_over_{k.replace('fused', 'ours')}": median[k] / median[k.replace("fused", "ours")]
               for k in peers if k.startswith("fused")},
            **{f"ours{k[5:]}_equals_{k}_bitwise": same(k) for k in peers if k.startswith("fused")}}


def queued(f, n: int, calls: int = 10) -> list[float]:
    """Seconds a call of f, the GPU's time over `calls` calls queued back to back (the host's work
    between them hidden as in training), n times."""
    f()
    out = []
    for _ in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            f()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / 1e3 / calls)
    return out


def clipping_norm(model: str, device: str, n: int) -> dict:
    from aner.kernels.adamw import squares
    g = torch.Generator(device=device).manual_seed(1)
    grads = [torch.randn(s, device=device, generator=g) for s in shapes(model)]
    exact = sum(float(t.double().pow(2).sum()) for t in grads)
    variants = {"foreach": lambda: torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float64)).pow(2).sum(),
                "ours": lambda: squares(grads)}
    for chunk, warps in ((4096, 4), (4096, 8), (16384, 4), (16384, 8), (16384, 16), (32768, 8), (32768, 16)):
        variants[f"ours {chunk}x{warps}"] = lambda c=chunk, w=warps: squares(grads, c, w)
    nbytes = 4 * sum(t.numel() for t in grads)
    out = {}
    for name, f in variants.items():
        median = statistics.median(queued(f, n))
        out[name] = {"ms": median * 1e3, "tb_per_s": nbytes / median / 1e12,
                     "relative_difference": abs(float(f()) - exact) / exact, "same_bits_twice": bool(f() == f())}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", nargs="+", default=["smollm2-135m"], choices=sorted(MODELS))
    ap.add_argument("--updates", type=int, default=5)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = [measure(m, args.device, args.updates) for m in args.models]
    if args.device != "cpu":
        for r in rows:
            r["clipping_norm"] = clipping_norm(r["model"], args.device, 4 * args.updates)
    record = {"benchmark": "adamw", "date": datetime.date.today().isoformat(), "device": args.device,
              "host": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "gpu": torch.cuda.get_device_name(args.device) if args.device != "cpu" else None,
              "rate": RATE, "weight_decay": DECAY, "timed_updates": args.updates, "rows": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    for r in rows:
        ms = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in r["seconds_per_update"].items())
        equal = ", ".join(f"{k}: {v}" for k, v in r.items() if k.endswith("_bitwise"))
        print(f"{r['model']}: {ms}; {equal}")
        for name, c in r.get("clipping_norm", {}).items():
            print(f"  clipping norm {name:18} {c['ms']:6.3f} ms {c['tb_per_s']:5.2f} TB/s "
                  f"relative difference {c['relative_difference']:.1e} same bits twice {c['same_bits_twice']}")


if __name__ == "__main__":
    main()

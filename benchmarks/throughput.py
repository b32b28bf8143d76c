"""Training throughput on the GPU: this library against the peer, measured in one run.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/throughput.py OUT.json [model:method[:flag] ...]
        [--steps N] [--rounds R] [--no-peer]
    ... --profile model:method[:flag]   where one update's GPU time goes (no JSON)
    python benchmarks/throughput.py --table RECORD.json[@model:method[:flag]] ...
        the README's table of those records' rows (each record's every row, or the one named)

Both sides train random-weight models of the real shapes (SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B)
on batches of 8 x 1024 tokens: BF16 operation policy, LoRA rank 16 / alpha 32 on all seven
projections, AdamW. Ours runs in this process under the library's default deterministic policy
(`CUBLAS_WORKSPACE_CONFIG`, deterministic algorithms, TF32 off); the peer (`benchmarks/peer.py`:
transformers + PEFT + bitsandbytes) runs in a child process in its usual mode. Each side warms up,
then times N updates (40 by default) over the same fixed batch of 8 sequences, so "the loss falls"
is checkable. At the H200's power limit an update's time swings with the power controller's cycle of
about a second (Llama-3.2-1B full, ours: 116-126 ms, the first dip deepest): ten updates sample
about one cycle, and their ratio to the peer's moved 1.48-1.51x with where the window began in one
run; forty sample five. Each side reports tokens/s (8 x 1024 input positions per update, over the
sum of the timed updates' seconds) and the Torch allocator peak. The peer synchronises after each
update and times it on the host; ours records a CUDA event at each update's end, so the GPU's waits
for our loop's host work stay in the figure. Ours clips the gradient norm at 1.0 (the library's
default); the peer's loop does not clip. Methods: full (FP32 masters), lora (FP32 base), qlora (NF4
double-quantized base; its products decode each weight whole on the GPU and multiply it with cuBLAS,
nf4_kernel="decoded", as the peer's bitsandbytes does). Ours records each micro-batch shape's
kernels as a CUDA graph (profile cuda_graphs=True, the same bits as eager), runs the adapters'
products through the fused kernels (adapter_kernel="fused") and RMSNorm, RoPE and the head's
cross-entropy through theirs (layer_kernel="fused"); the flag `:eager` measures the eager loop
instead, `:torch` the adapters' torch ops, `:torch-layers` the layers' torch ops, `:fused` QLoRA's
products through the fused NF4 kernels (nf4_kernel="fused", no decoded weight), `:kept` each decoded
weight kept from the forward for the backward (nf4_kernel="decoded_kept"), `:microN` N sequences a
micro-batch (8 / N micro-batches an update; 8 by default), `:promptN` the first N positions of
each sequence unscored, as a question's are (ours alone, with --no-peer), `:noclip` no clipping of
the gradient norm (ours clips at 1.0 by default; the peer's loop never clips: with `:noclip` both
sides do the same work), `:cudnn` attention through cuDNN's deterministic kernels
(attention_kernel="cudnn"). The record holds both sides and their ratios.
`--rounds R` measures both sides R times in one call, alternated (the peer before ours in odd
rounds, after in even ones: the peer's figures move with the machine's host far more than
ours), and each row reports each side's median round (of an even count the middle worse for ours:
ours' slower, the peer's faster), their ratio and every round's figures.
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "src")]

from aner import gen  # noqa: E402
from aner.data.supervised import Example, TrainingData  # noqa: E402
from aner.model import names  # noqa: E402
from aner.model.config import LlamaConfig  # noqa: E402
from aner.model.handle import PretrainedModel, Source, check_device  # noqa: E402

DEV = "cuda:0"
BATCH, SEQ = 8, 1024
TARGETS = ["attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
# (layers, width, heads, kv heads, feed-forward width, vocabulary, tied head, rope base)
MODELS = {
    "smollm2-135m": (30, 576, 9, 3, 1536, 49152, True, 100000.0),
    "llama-3.2-1b": (16, 2048, 32, 8, 8192, 128256, True, 500000.0),
    "llama-3.1-8b": (32, 4096, 32, 8, 14336, 128256, False, 500000.0),
}
DEFAULT = ["smollm2-135m:full", "smollm2-135m:lora", "smollm2-135m:qlora",
           "llama-3.2-1b:full", "llama-3.2-1b:lora", "llama-3.2-1b:qlora", "llama-3.1-8b:qlora"]


def model_config(name: str) -> LlamaConfig:
    """The configuration of `name`'s shape (context 8192, RMSNorm eps 1e-5)."""
    n_layer, dim, n_head, n_kv, ffn, vocab, tied, rope = MODELS[name]
    return LlamaConfig(n_layer, dim, n_head, n_kv, ffn, vocab, 8192, 1e-5, rope, tied)


def random_model(name: str, layers: int = 0) -> PretrainedModel:
    """A random-weight model of `name`'s shape on the GPU (std 0.02 matrices, unit norms), placed
    as `gen.import_model` places one: under the library's deterministic CUDA policy. With `layers`:
    its first `layers` layers only."""
    device = check_device(DEV)
    config = model_config(name)
    if layers:
        config = dataclasses.replace(config, n_layer=layers)
    g = torch.Generator(device=device).manual_seed(0)
    weights = {}
    for tensor, (_, role, shape) in names.expected(config).items():
        weights[tensor] = torch.ones(shape, device=device) if role == "norm" else \
            torch.randn(shape, device=device, generator=g) * 0.02
    source = Source(path=f"random {name}", sha256="0" * 64, canonical_sha256="0" * 64,
                    tokenizer_sha256="random", config=config, fields=(), metadata_path="")
    return PretrainedModel(source=source, weights=weights, device=device, budget=64 << 30)


def data(vocab: int, prompt: int = 0):
    """8 random sequences of SEQ + 1 tokens, every position after the first `prompt` + 1 scored, and
    a one-example validation set (evaluated once per call, a negligible share of the time)."""
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, vocab, (BATCH + 1, SEQ + 1), generator=g).tolist()
    items = tuple(Example(tuple(r), 1 + prompt) for r in rows)
    tr = TrainingData("training", items[:BATCH], "random", SEQ + 1, "random")
    va = TrainingData("validation", items[BATCH:], "random", SEQ + 1, "random")
    return tr, va


def parse(combo: str) -> tuple[str, str, dict]:
    """'model:method[:eager][:torch][:torch-layers][:fused][:kept][:microN][:promptN][:noclip][:cudnn]' ->
    (model, method, profile choices besides the BF16 policy); microN is read by `micro_batch`,
    promptN by `prompt`, noclip by `clip_norm`."""
    model, method, *flags = combo.split(":")
    assert {f for f in flags if not f.startswith(("micro", "prompt"))} <= {
        "eager", "torch", "torch-layers", "fused", "kept", "noclip", "cudnn"}, combo
    choices = {"cuda_graphs": "eager" not in flags,
               "adapter_kernel": "torch" if "torch" in flags or method == "full" else "fused",
               "layer_kernel": "torch" if "torch-layers" in flags else "fused"}
    if "cudnn" in flags:
        choices["attention_kernel"] = "cudnn"
    if method == "qlora":
        choices["nf4_kernel"] = "fused" if "fused" in flags else "decoded_kept" if "kept" in flags else "decoded"
    return model, method, choices


def _number(combo: str, flag: str, default: int) -> int:
    """N of `combo`'s flag `flag`N, or `default` without one."""
    found = [int(f[len(flag):]) for f in combo.split(":")[2:] if f.startswith(flag)]
    return found[0] if found else default


def micro_batch(combo: str) -> int:
    """The micro-batch of `combo`: the whole batch of 8 sequences, or N of them (flag microN,
    the update then accumulates 8 / N micro-batches)."""
    return _number(combo, "micro", BATCH)


def prompt(combo: str) -> int:
    """Positions of each sequence that are not scored (flag promptN: the first N, as a question's
    are; 0 by default). Ours only: the peer's loop makes every position's logits whatever its labels,
    so a row with it is timed with --no-peer."""
    return _number(combo, "prompt", 0)


def clip_norm(combo: str) -> float:
    """The gradient norm `combo` clips at: the library's default 1.0, or 0 (none) with flag noclip."""
    return 0.0 if "noclip" in combo.split(":")[2:] else 1.0


def select(base, method, choices):
    """The method on `base` under the BF16 policy and `choices` (QLoRA with the GPU's NF4 kernels)."""
    profile = dict(precision="bfloat16", **choices)
    if method == "full":
        return base.with_training_profile(**profile)
    if method == "qlora":
        from aner.kernels import fused_available
        if not fused_available():
            raise RuntimeError("the NF4 GPU kernels are not available here (host tiling is not a throughput path)")
        base = base.nf4(double_quant=True)
    return base.lora(targets=TARGETS, rank=16, alpha=32.0).with_training_profile(**profile)


def start(combo: str, updates: int):
    """(source model, training data, validation data, the start of a run of `updates` updates):
    the random base released and the allocator's peak reset before the run's private copies."""
    model, method, choices = parse(combo)
    base = random_model(model)
    tr, va = data(base.config().vocab_size, prompt(combo))
    src = select(base, method, choices)
    del base
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    micro = micro_batch(combo)
    state, _ = src._fine_tune_start(tr, va, updates, micro, BATCH // micro, 1e-4, 0, clip_norm(combo))
    return src, tr, va, state


def ours(combo: str, steps=40, warmup=3) -> dict:
    model, method, _ = parse(combo)
    src, tr, va, state = start(combo, warmup + steps)
    ends, walls = [], []

    def tick(state, view):
        ends.append(torch.cuda.Event(enable_timing=True))
        ends[-1].record()
        walls.append(time.time())     # the host's clock as it commits the update (`energy.py`'s window)

    # One run of warmup + steps updates, timed from the end of the last warm-up update to the end
    # of the last one: the call's start (private copies of the trainable tensors, the moments,
    # recording the graph) stays out of the figure, and no second run's copies stay alive. Each
    # update's end is an event on the GPU's stream, so timing adds no wait of its own: the GPU's
    # idle time between updates (the loop's own waits for the host) stays in the figure.
    admitted = src._training_bytes(state.run.micro_batch, SEQ + 1)   # the estimate training is admitted by
    m = src._train(tr, va, state, warmup + steps, progress=False, on_update=tick)
    torch.cuda.synchronize()
    ends = ends[warmup - 1:]
    step_seconds = [a.elapsed_time(b) / 1e3 for a, b in zip(ends[:-1], ends[1:])]
    losses = list(m._state.losses[warmup:])
    result = {"side": "ours", "model": model, "method": method,
              "tokens_per_s": steps * BATCH * SEQ / sum(step_seconds),
              "peak_bytes": torch.cuda.max_memory_allocated(), "admitted_bytes": admitted, "step_seconds": step_seconds,
              "update_ends": walls[warmup - 1:], "warmup_losses": list(m._state.losses[:warmup]),
              "losses": losses, "finite": all(map(math.isfinite, losses)),
              "loss_fell": losses[-1] < losses[0], "parameters": m.parameters(), "micro_batch": state.run.micro_batch,
              "clip_norm": state.run.clip_norm,
              "trainable_parameters": m.trainable_parameters(), "training_profile": m.training_profile()}
    del m, src
    gc.collect()
    torch.cuda.empty_cache()
    return result


def peer(combos: list[str], out: Path, steps: int) -> dict:
    """The peer's results, run in a child process in its own (non-deterministic) default mode."""
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer.py"), str(out), *combos, "--steps", str(steps)],
                   env=env)
    if not out.exists():
        return {}
    rows = json.loads(out.read_text()).get("results", [])
    return {f"{r['model']}:{r['method']}": r for r in rows}


def profile(combo: str, updates=2, warmup=2):
    """Where the GPU time of `updates` updates goes, recorded after `warmup` updates: the call's
    start (private copies, moments, recording graphs) and the final validation pass stay out.
    Each update's end waits for the GPU here (the profiler's step), so the gap after it is the
    profile's own."""
    src, tr, va, state = start(combo, warmup + updates + 1)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    schedule = torch.profiler.schedule(wait=warmup, warmup=0, active=updates, repeat=1)
    with torch.profiler.profile(activities=acts, record_shapes=True, schedule=schedule) as prof:
        src._train(tr, va, state, warmup + updates + 1, progress=False,
                   on_update=lambda s, view: (torch.cuda.synchronize(), prof.step()))
    print(f"# {combo}: {updates} updates after {warmup}")
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30, max_name_column_width=70))
    # the copies, additions and products by operand shapes: which tensors the casts and adds are
    ops = ("aten::copy_", "aten::add_", "aten::mm", "aten::addmm", "aten::add", "aten::mul")
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in ops]
    for e in sorted(rows, key=lambda e: -e.self_device_time_total)[:25]:
        print(f"{e.key:12} {e.count:6} {e.self_device_time_total / 1e3:9.1f} ms  {str(e.input_shapes)[:110]}")
    idle(prof)


def idle(prof, top=12):
    """Where the GPU waits and what each kernel holds it for, over the recorded updates (one
    timeline of kernels, copies and memsets). A kernel's exposed time is its end less the later of
    its start and the end of the work before it: under programmatic dependent launch a kernel
    starts while the one before it finishes and waits, so its own recorded duration counts that
    wait, and the durations add up to more than the timeline; the exposed times add up to it, less
    the gaps. Then the gaps (their total and the largest, each with the work on either side) and
    what comes before and after the memsets (whose launches these are)."""
    import collections
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.loads(Path(f.name).read_text())["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"])
    gaps, end, prev = [], gpu[0]["ts"], gpu[0]
    exposed, count = collections.Counter(), collections.Counter()
    before_memset, after_memset = collections.Counter(), collections.Counter()
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, prev["name"][:60], e["name"][:60]))
        name = e["name"][:70]
        exposed[name] += max(0.0, e["ts"] + e["dur"] - max(e["ts"], end))
        count[name] += 1
        if prev is not e and prev.get("cat") == "gpu_memset":
            after_memset[name] += 1
        if prev is not e and e.get("cat") == "gpu_memset":
            before_memset[prev["name"][:70]] += 1
        if e["ts"] + e["dur"] >= end:
            end = e["ts"] + e["dur"]
        prev = e
    span = end - gpu[0]["ts"]
    total = sum(g for g, _, _ in gaps)
    print(f"GPU timeline {span / 1e3:.1f} ms, exposed time by kernel (ms, launches):")
    for name, t in exposed.most_common(30):
        print(f"  {t / 1e3:8.2f} {count[name]:6}  {name}")
    print(f"idle {total / 1e3:.1f} ms in {len(gaps)} gaps; largest:")
    for g, a, b in sorted(gaps, reverse=True)[:top]:
        print(f"  {g / 1e3:7.2f} ms  after {a}  before {b}")
    for where, seen in (("before", before_memset), ("after", after_memset)):
        print(f"{where} a memset:", ", ".join(f"{n} {name[:50]}" for name, n in seen.most_common(6)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?")
    ap.add_argument("combos", nargs="*")
    ap.add_argument("--profile")
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=1, help="ours and the peer alternated; medians reported")
    ap.add_argument("--table", nargs="+", metavar="RECORD[@COMBO]")
    a = ap.parse_intermixed_args()
    if a.profile:
        return profile(a.profile)
    if a.table:
        return print(table(a.table))
    combos = a.combos or DEFAULT
    out = Path(a.out)
    record = {"schema": "aner.throughput/1", "date": time.strftime("%Y-%m-%d"),
              "environment": {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                              "cuda": torch.version.cuda, "python": platform.python_version(),
                              "backend": gen.training_backend(),
                              "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG")},
              "setup": {"batch": BATCH, "sequence": SEQ, "lora_rank": 16, "lora_alpha": 32,
                        "targets": TARGETS, "precision": "bfloat16", "steps": a.steps,
                        "rounds": a.rounds},
              "rows": []}
    peer_combos = list(dict.fromkeys(map(pair, combos)))   # in order, once each
    if not a.no_peer and any(map(prompt, combos)):
        raise SystemExit("promptN times ours alone (the peer makes every position's logits): add --no-peer")

    def run_peer():
        return {} if a.no_peer else peer(peer_combos, out.with_name(out.stem + "-peer.json"), a.steps)

    rounds = {combo: [] for combo in combos}      # combo -> [(ours, peer)], one pair a round
    for k in range(a.rounds):
        # the peer before ours in the first, third, ... round, after in the others: a drift of the
        # machine weighs on both sides
        peers = run_peer() if k % 2 == 0 else {}
        mine = {}
        for combo in combos:
            try:
                mine[combo] = ours(combo, steps=a.steps)
            except Exception as e:  # recorded, not hidden
                model, method, _ = parse(combo)
                mine[combo] = {"side": "ours", "model": model, "method": method, "error": f"{type(e).__name__}: {e}"}
                gc.collect()
                torch.cuda.empty_cache()
            print(f"{combo:26} ours {fmt(mine[combo])}", flush=True)
        peers = run_peer() if k % 2 else peers
        for combo in combos:
            p = peers.get(pair(combo), {})
            rounds[combo].append((mine[combo], p))
            if not a.no_peer:
                print(f"{combo:26} peer {fmt(p)}", flush=True)
        record["rows"] = [row(combo, rounds[combo]) for combo in combos]
        out.write_text(json.dumps(record, indent=1))
    if a.rounds > 1:
        print(f"medians over {a.rounds} rounds (min-max):")
    for r in record["rows"]:
        print(f"{r['combo']:26} ours {fmt(r['ours'])} ({spread(r['ours_tokens_per_s'])}) | "
              f"peer {fmt(r['peer'])} ({spread(r['peer_tokens_per_s'])}) | x{r.get('speedup', float('nan')):.2f}",
              flush=True)


def pair(combo: str) -> str:
    """'model:method' of `combo`: the peer's row it is compared with."""
    return ":".join(combo.split(":")[:2])


def fmt(side: dict) -> str:
    return (f"{side['tokens_per_s'] / 1e3:7.1f}k tok/s {side['peak_bytes'] / 2**30:6.1f} GiB"
            if "tokens_per_s" in side else str(side.get("error", "-"))[:60])


def spread(figures: list) -> str:
    return "-".join(f"{x / 1e3:.1f}" for x in (min(figures), max(figures))) if figures else "-"


def row(combo: str, rounds: list) -> dict:
    """A combination's record over its rounds: each side's round of median tokens/s, their ratio,
    and every round's figures. Of an even count the middle that is worse for ours: ours' slower
    one, the peer's faster one."""
    model, method, choices = parse(combo)

    def median(side, upper):
        done = sorted((r for r in side if "tokens_per_s" in r), key=lambda r: r["tokens_per_s"])
        return done[len(done) // 2 if upper else (len(done) - 1) // 2] if done else side[-1]

    o, p = median([r for r, _ in rounds], upper=False), median([q for _, q in rounds], upper=True)
    out = {"combo": combo, "model": model, "method": method, **choices, "clip_norm": clip_norm(combo), "ours": o, "peer": p,
           "ours_tokens_per_s": [r["tokens_per_s"] for r, _ in rounds if "tokens_per_s" in r],
           "peer_tokens_per_s": [q["tokens_per_s"] for _, q in rounds if "tokens_per_s" in q]}
    if "tokens_per_s" in o and "tokens_per_s" in p:
        out["speedup"] = o["tokens_per_s"] / p["tokens_per_s"]
        out["memory_ratio"] = o["peak_bytes"] / p["peak_bytes"]
    if len(rounds) > 1:
        out["rounds"] = [{"ours": r, "peer": q} for r, q in rounds]
    return out


def target(model: str, method: str) -> float:
    """The ratio to the peer that the row must reach: QLoRA 2x (Llama-3.1-8B 1.4x), else 1.5x."""
    return (1.4 if model == "llama-3.1-8b" else 2.0) if method == "qlora" else 1.5


def table(records: list[str]) -> str:
    """Markdown rows of records' rows, `RECORD@COMBO` naming one: each side's figures as `row` chose
    them, every round's ratio, whether both sides' losses were finite and fell in every round, the
    device, and whether the ratio reaches the target."""
    lines = ["| model | method and flags | ours tokens/s | ours peak | peer tokens/s | peer peak | ours / peer "
             "(rounds) | both train | device | target |", "| --- " * 10 + "|"]
    for spec in records:
        path, _, only = spec.partition("@")
        record = json.loads(Path(path).read_text())
        rows = [r for r in record["rows"] if only in ("", r["combo"])]
        if not rows:
            raise SystemExit(f"{path} has no row {only!r}: it has {[r['combo'] for r in record['rows']]}")
        for r in rows:
            flags = ":".join(r["combo"].split(":")[1:])
            if "speedup" not in r:        # a side without figures: its error, or none measured (--no-peer)
                side = "ours" if "tokens_per_s" not in r["ours"] else "peer"
                lines.append(f"| {r['model']} | {flags} | {side}: {str(r[side].get('error', 'not measured'))[:80]} |"
                             + " |" * 7)
                continue
            rounds = r.get("rounds", [{"ours": r["ours"], "peer": r["peer"]}])
            ratios = ", ".join(f"{q['ours']['tokens_per_s'] / q['peer']['tokens_per_s']:.3f}"
                               if "tokens_per_s" in q["ours"] and "tokens_per_s" in q["peer"] else "-" for q in rounds)
            trains = all(q[side].get("finite") and q[side].get("loss_fell")
                         for q in rounds for side in ("ours", "peer"))
            goal = target(r["model"], r["method"])
            lines.append(" | ".join([
                "", r["model"], flags,
                f"{r['ours']['tokens_per_s'] / 1e3:.1f}k", f"{r['ours']['peak_bytes'] / 2**30:.1f} GiB",
                f"{r['peer']['tokens_per_s'] / 1e3:.1f}k", f"{r['peer']['peak_bytes'] / 2**30:.1f} GiB",
                f"**{r['speedup']:.3f}x** ({ratios})", "yes" if trains else "**no**",
                record["environment"]["device"].removeprefix("NVIDIA ").split()[0],
                f"{goal:g}x: {'met' if r['speedup'] >= goal else '**not met**'}", ""]).strip())
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Training throughput of the peer stack: Hugging Face transformers + PEFT (+ bitsandbytes).

This file is the record of the peer's configuration. What is measured, per (model, method):

Models: random-weight `LlamaForCausalLM` built from a `LlamaConfig` of the real shapes (nothing
is downloaded), `attn_implementation="sdpa"`, `use_cache=False` (training, no KV cache), default
transformers init (normal std 0.02), after `torch.manual_seed(0)`:

    smollm2-135m  hidden 576,  intermediate 1536,  30 layers,  9 heads, 3 kv heads, vocab 49152,
                  tied embeddings, rope_theta 100000, rms_norm_eps 1e-5, max positions 8192
    llama-3.2-1b  hidden 2048, intermediate 8192,  16 layers, 32 heads, 8 kv heads, vocab 128256,
                  tied embeddings, rope_theta 500000, rms_norm_eps 1e-5, max positions 131072
    llama-3.1-8b  hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 kv heads, vocab 128256,
                  untied,          rope_theta 500000, rms_norm_eps 1e-5, max positions 131072

(plain rope, no llama3 frequency scaling: it changes only the inverse frequencies, not the cost).

Methods (all: forward + loss under `torch.autocast(device, dtype=torch.bfloat16)`, backward
outside it, `torch.optim.AdamW(params, lr=1e-4, fused=True)`, `zero_grad(set_to_none=True)`):

    full   FP32 master weights; AdamW over all parameters.
    lora   base model in BF16; PEFT LoRA r=16, alpha=32, dropout 0, bias "none", on q_proj, k_proj,
           v_proj, o_proj, gate_proj, up_proj, down_proj (adapter weights FP32, PEFT's default);
           AdamW over the trainable (adapter) parameters.
    qlora  the BF16 random model with every nn.Linear inside the decoder layers replaced by a
           bitsandbytes Linear4bit (nf4, double quant i.e. compress_statistics=True, compute
           dtype bf16), quantized in memory from the BF16 weights (Params4bit moved to the device);
           embeddings, norms and lm_head stay BF16. Then the same PEFT LoRA. No gradient
           checkpointing, no prepare_model_for_kbit_training.

Training: batch 8 x 1024 tokens, uniform random token ids (seeded generator), labels = input_ids
(the model's own shifted causal-LM loss, `model(input_ids=..., labels=...).loss`), one optimizer
step per batch. 3 warm-up steps on fresh random batches, then N (default 40) timed steps on ONE
fixed batch repeated, so that the loss must fall (`loss_fell`: last timed loss < first). Each
timed step ends with a device synchronisation; tokens/s = N * batch * seq / (sum of timed step
seconds); `step_ends` are their ends on the wall clock. `peak_bytes` =
torch.cuda.max_memory_allocated() with the peak reset after the model (and adapter) are built,
before warm-up, so it includes the first step's optimizer state.
`model_bytes` = memory allocated at that reset. `losses` are the timed steps' losses (each is the
loss of the forward before that step's update). Parameter counts come from PEFT's
`get_nb_trainable_parameters()` for lora/qlora (4-bit weights counted unpacked) and from the
unique parameters for full. Defaults are left alone: no deterministic algorithms, TF32 settings
untouched, no torch.compile.

Usage:
    python benchmarks/peer.py OUT.json [model:method ...] [--steps N] [--warmup N]
    python benchmarks/peer.py /tmp/peer.json --device cpu --tiny     # path check, tiny shapes
Default combinations: smollm2-135m full/lora/qlora, llama-3.2-1b full/lora/qlora, llama-3.1-8b
qlora. Each runs in turn in this process; an exception is recorded as {"error": ...}; OUT.json
is rewritten after every combination. `--tiny` replaces the shape with 2 layers, hidden 64,
intermediate 128, 4 heads, 2 kv heads, vocab 512, batch 2 x 32 (CPU autocast is bf16 too).
On CPU, qlora uses bitsandbytes' CPU backend.
"""
import argparse
import gc
import json
import sys
import time
import traceback

import torch

MODELS = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0,
                         max_position_embeddings=8192),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=True, rope_theta=500000.0,
                         max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         tie_word_embeddings=False, rope_theta=500000.0,
                         max_position_embeddings=131072),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512)
METHODS = ("full", "lora", "qlora")
DEFAULT_RUNS = ["smollm2-135m:full", "smollm2-135m:lora", "smollm2-135m:qlora",
                "llama-3.2-1b:full", "llama-3.2-1b:lora", "llama-3.2-1b:qlora",
                "llama-3.1-8b:qlora"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
RANK, ALPHA, LR, SEED = 16, 32, 1e-4, 0


def versions() -> dict:
    import peft
    import transformers
    try:
        import bitsandbytes
        bnb = bitsandbytes.__version__
    except Exception:  # not installed / no usable backend
        bnb = None
    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "peft": peft.__version__, "bitsandbytes": bnb}


def llama_config(model: str, tiny: bool = False):
    from transformers import LlamaConfig
    shape = dict(MODELS[model])
    if tiny:
        shape.update(TINY)
    theta = shape.pop("rope_theta")
    return LlamaConfig(**shape, rms_norm_eps=1e-5, use_cache=False,
                       rope_parameters={"rope_type": "default", "rope_theta": theta})


def quantize_decoder_linears(model, device):
    """Replace every nn.Linear inside the decoder layers by an nf4 double-quant Linear4bit."""
    import bitsandbytes as bnb
    for layer in model.model.layers:
        for name, lin in list(layer.named_modules()):
            if type(lin) is not torch.nn.Linear:
                continue
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  compute_dtype=torch.bfloat16, compress_statistics=True,
                                  quant_type="nf4", device="meta")
            q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, quant_type="nf4",
                                         compress_statistics=True).to(device)  # quantizes
            if lin.bias is not None:
                q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
            parent_name, _, child = name.rpartition(".")
            setattr(layer.get_submodule(parent_name) if parent_name else layer, child, q)
            del lin
    model.is_loaded_in_4bit = True  # what transformers' bnb loader sets; PEFT dispatches on it


def build(model: str, method: str, device: torch.device, tiny: bool = False):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")
    torch.manual_seed(SEED)
    dtype = torch.float32 if method == "full" else torch.bfloat16
    with torch.device(device):
        net = AutoModelForCausalLM.from_config(llama_config(model, tiny), dtype=dtype,
                                               attn_implementation="sdpa")
    if method == "qlora":
        quantize_decoder_linears(net, device)
    if method == "full":
        net.train()
        params = list(net.parameters())  # unique (tied embeddings counted once)
        n = sum(p.numel() for p in params)
        return net, params, n, n
    lora = LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, bias="none",
                      target_modules=TARGETS, task_type="CAUSAL_LM")
    net = get_peft_model(net, lora)
    net.train()
    trainable, total = net.get_nb_trainable_parameters()
    params = [p for p in net.parameters() if p.requires_grad]
    return net, params, total, trainable


def train_step(net, opt, ids):
    """One optimizer step: bf16-autocast forward + causal-LM loss, backward, fused AdamW."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16):
        loss = net(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model: str, method: str, steps=40, warmup=3, batch=8, seq=1024, device="cuda",
        tiny=False) -> dict:
    device = torch.device(device)
    cuda = device.type == "cuda"
    net, params, n_params, n_trainable = build(model, method, device, tiny)
    opt = torch.optim.AdamW(params, lr=LR, fused=True)
    vocab = net.config.vocab_size
    gen = torch.Generator(device=device).manual_seed(SEED)
    fixed = torch.randint(0, vocab, (batch, seq), generator=gen, device=device)

    _sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model_bytes = torch.cuda.memory_allocated(device) if cuda else None
    for _ in range(warmup):
        train_step(net, opt, torch.randint(0, vocab, (batch, seq), generator=gen, device=device))
    _sync(device)
    seconds, ends, losses = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(train_step(net, opt, fixed))
        _sync(device)
        seconds.append(time.perf_counter() - t0)
        ends.append(time.time())
    losses = [float(x) for x in losses]
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    result = {
        "side": "peer", "model": model, "method": method,
        "tokens_per_s": steps * batch * seq / sum(seconds),
        "peak_bytes": peak, "model_bytes": model_bytes,
        "step_seconds": seconds, "step_ends": ends, "losses": losses,
        "loss_fell": losses[-1] < losses[0],
        "finite": all(x == x and abs(x) != float("inf") for x in losses),
        "loss_batch": "timed steps repeat one fixed random batch; warm-up uses fresh batches",
        "parameters": n_params, "trainable_parameters": n_trainable,
        "batch": batch, "seq": seq, "steps": steps, "warmup": warmup, "tiny": tiny,
        "device": torch.cuda.get_device_name(device) if cuda else str(device),
        "versions": versions(),
    }
    del net, opt, params, fixed, gen
    free(cuda)
    return result


def free(cuda: bool):
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("runs", nargs="*", help="model:method (default: the standard matrix)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, batch 2 x 32 (path check)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_intermixed_args(argv)
    batch, seq = (2, 32) if args.tiny else (8, 1024)
    results = []
    for spec in args.runs or DEFAULT_RUNS:
        model, _, method = spec.partition(":")
        try:
            if model not in MODELS:
                raise ValueError(f"unknown model {model!r}; expected one of {list(MODELS)}")
            r = run(model, method, steps=args.steps, warmup=args.warmup, batch=batch, seq=seq,
                    device=args.device, tiny=args.tiny)
            peak = "n/a" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
            line = (f"{model:13s} {method:5s} {r['tokens_per_s']:10.0f} tok/s  peak {peak}  "
                    f"loss {r['losses'][0]:.4f} -> "
                    f"{r['losses'][-1]:.4f}  fell={r['loss_fell']} finite={r['finite']}")
        except Exception as e:
            r = {"side": "peer", "model": model, "method": method,
                 "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            line = f"{model:13s} {method:5s} ERROR {r['error']}"
        free(torch.device(args.device).type == "cuda")
        results.append(r)
        print(line, flush=True)
        with open(args.out, "w") as f:
            json.dump({"side": "peer", "argv": sys.argv[1:], "results": results}, f, indent=1)
    return results


if __name__ == "__main__":
    main()

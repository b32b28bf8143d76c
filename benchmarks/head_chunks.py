"""The head's products over a batch of 8 x 1024 positions, a chunk of positions at a time as
`train/loss.py` makes them: logits = h @ W^T (chunk, V) and the input gradient dlogits @ W, BF16,
for several chunk sizes (1046: 256 MiB of BF16 logits of a 128,256-token vocabulary; 1024: the
same rounded down to whole tiles of 128 rows), at Llama-3.2-1B's head (2048 wide) and
Llama-3.1-8B's (4096). GPU time of the whole batch's chunks under a CUDA graph, medians of
repeats in which the chunk sizes take turns (`joint_gemms.timed`).

    python benchmarks/head_chunks.py OUT.json
"""
import json
import sys

import torch

from joint_gemms import timed

POSITIONS, VOCAB = 8 * 1024, 128256
CHUNKS = (1046, 1024, 896, 768, 512, 1152, 2048)


def head(dim: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(POSITIONS, dim, device="cuda", dtype=torch.bfloat16, generator=g)
    w = torch.randn(VOCAB, dim, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
    logits = torch.empty(max(CHUNKS), VOCAB, device="cuda", dtype=torch.bfloat16)
    dh = torch.empty(POSITIONS, dim, device="cuda", dtype=torch.bfloat16)

    def chunked(step, forward, backward):
        def run():
            for s in range(0, POSITIONS, step):
                n = min(step, POSITIONS - s)
                if forward:
                    torch.mm(h[s:s + n], w.t(), out=logits[:n])
                if backward:
                    torch.mm(logits[:n], w, out=dh[s:s + n])
        return run

    flops = 2 * POSITIONS * VOCAB * dim
    out = {}
    for part, fwd, bwd in (("forward", True, False), ("input_grad", False, True)):
        us = timed({step: chunked(step, fwd, bwd) for step in CHUNKS}, calls=3)
        out[part] = {str(step): {"us": t, "tflops": flops / t / 1e6} for step, t in us.items()}
    return out


def main(path):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.use_deterministic_algorithms(True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "positions": POSITIONS,
              "vocab": VOCAB, "llama-3.2-1b": head(2048), "llama-3.1-8b": head(4096)}
    for model in ("llama-3.2-1b", "llama-3.1-8b"):
        for part, rows in result[model].items():
            print(model, part, " ".join(f"{step}:{r['us']:.0f}us/{r['tflops']:.0f}TF" for step, r in rows.items()))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

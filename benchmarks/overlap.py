"""Whether memory-bound work hides under the GEMMs when it runs on a second stream: Llama-3.2-1B
full fine-tuning's AdamW over its layers (973M FP32 parameters, each with a BF16 cast) beside the
forward GEMMs of its 16 layers at 8 x 1024 tokens, and the clipping norm's squares beside the
weight-gradient GEMMs. Each pair timed on one stream (one after the other) and on two, where
layer i's forward waits only for layer i's AdamW (the next update's forward could start while the
optimizer runs) and each layer's squares start once its weight gradients are written. GPU time of
each variant, medians of repeats in which the variants take turns; eager (AdamW copies its table
from pinned host memory each call, which a graph could not replay), so the squares' 16 small calls
alone are bound by the host; the pairs are queued well ahead of the GPU.

    python benchmarks/overlap.py OUT.json
"""
import json
import sys

import torch

from aner.kernels.adamw import adamw_, squares
from joint_gemms import in_turn

LAYERS, TOKENS, D, F, QKV = 16, 8192, 2048, 8192, 3072


def main(out: str):
    torch.manual_seed(0)
    cuda = torch.device("cuda")
    shapes = [(QKV, D), (D, D), (2 * F, D), (D, F)]              # per layer: qkv, o, gate|up, down
    params = [[torch.randn(s, device=cuda) * 0.02 for s in shapes] for _ in range(LAYERS)]
    grads = [[torch.randn_like(p) * 1e-3 for p in layer] for layer in params]
    ms = [[torch.zeros_like(p) for p in layer] for layer in params]
    vs = [[torch.zeros_like(p) for p in layer] for layer in params]
    casts = [[p.to(torch.bfloat16) for p in layer] for layer in params]
    step = torch.ones((), device=cuda)
    x = torch.randn(TOKENS, D, device=cuda, dtype=torch.bfloat16)
    a = torch.randn(TOKENS, F, device=cuda, dtype=torch.bfloat16)
    gqkv, gd = (torch.randn(TOKENS, n, device=cuda, dtype=torch.bfloat16) for n in (QKV, D))
    ggu = torch.randn(TOKENS, 2 * F, device=cuda, dtype=torch.bfloat16)
    norm = torch.zeros((), dtype=torch.float64, device=cuda)

    def adam(i):
        adamw_(params[i], grads[i], ms[i], vs[i], step, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.0,
               eps=1e-8, casts=casts[i])

    def forward(i):
        wqkv, wo, wgu, wd = casts[i]
        torch.mm(x, wqkv.t()), torch.mm(x, wo.t()), torch.mm(x, wgu.t()), torch.mm(a, wd.t())

    def weight_grads(i):
        # the FP32 weight gradients g^T x written over this layer's gradient buffers
        torch.mm(gqkv.t(), x, out_dtype=torch.float32, out=grads[i][0])
        torch.mm(gd.t(), x, out_dtype=torch.float32, out=grads[i][1])
        torch.mm(ggu.t(), x, out_dtype=torch.float32, out=grads[i][2])
        torch.mm(gd.t(), a, out_dtype=torch.float32, out=grads[i][3])

    side = torch.cuda.Stream()

    def beside(first, then):
        """first(i) on the side stream, then(i) on this one once first(i) is done, i = 0..15."""
        side.wait_stream(torch.cuda.current_stream())
        done = []
        with torch.cuda.stream(side):
            for i in range(LAYERS):
                first(i)
                done.append(torch.cuda.Event())
                done[-1].record()
        for i in range(LAYERS):
            torch.cuda.current_stream().wait_event(done[i])
            then(i)
        torch.cuda.current_stream().wait_stream(side)

    def after(first, then):
        """then(i) on the side stream once first(i) is done on this one, i = 0..15."""
        side.wait_stream(torch.cuda.current_stream())
        for i in range(LAYERS):
            first(i)
            ready = torch.cuda.Event()
            ready.record()
            side.wait_event(ready)
            with torch.cuda.stream(side):
                then(i)
        torch.cuda.current_stream().wait_stream(side)

    def squares_of(i):
        norm.add_(squares(grads[i]))

    variants = {
        "forward": lambda: [forward(i) for i in range(LAYERS)],
        "adamw": lambda: [adam(i) for i in range(LAYERS)],
        "adamw_then_forward": lambda: ([adam(i) for i in range(LAYERS)], [forward(i) for i in range(LAYERS)]),
        "adamw_beside_forward": lambda: beside(adam, forward),
        "weight_grads": lambda: [weight_grads(i) for i in range(LAYERS)],
        "squares": lambda: [squares_of(i) for i in range(LAYERS)],
        "weight_grads_then_squares": lambda: ([weight_grads(i) for i in range(LAYERS)],
                                              [squares_of(i) for i in range(LAYERS)]),
        "squares_beside_weight_grads": lambda: after(weight_grads, squares_of),
    }
    for fn in variants.values():
        fn()
    median = in_turn(variants, repeats=9)
    for name, t in median.items():
        print(f"{name:30s} {t:8.3f} ms")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "ms": median,
              "adamw_hidden_ms": median["adamw_then_forward"] - median["adamw_beside_forward"],
              "squares_hidden_ms": median["weight_grads_then_squares"] - median["squares_beside_weight_grads"]}
    print(json.dumps({k: v for k, v in result.items() if k.endswith("hidden_ms")}))
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""The RoPE kernel (`layer._rope_launch`, BF16) at several program tiles (heads, elements), at
Llama-3.2-1B's and Llama-3.1-8B's attention (8 x 1024 positions): the forward over q, k and v as
one projection's output (v copied), the backward in place over q's and k's gradients, as a layer
runs them.

Each tile's outputs are compared with the default's (`ROPE_TILE`) bit for bit, then every variant
is timed under CUDA graphs, in turn (`joint_gemms.timed`): microseconds a call, the bytes moved a
second, and one update's (forward and backward, every layer).

    python benchmarks/rope_tiles.py OUT.json
"""
import json
import sys

import torch
import triton

from joint_gemms import timed
from aner.kernels.layer import ROPE_TILE, _rope_launch

MODELS = {"llama-3.2-1b": (16, 32, 8, 64), "llama-3.1-8b": (32, 32, 8, 128)}   # layers, heads, kv heads, width
TILES = [ROPE_TILE, (1, 4096), (4, 4096), (8, 4096), (16, 2048), (32, 4096), (16, 8192), (64, 8192)]
B, T = 8, 1024


def main(path):
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "tiles": [list(t) for t in TILES], "models": {}}
    for model, (layers, H, K, E) in MODELS.items():
        n, rotated = H + 2 * K, H + K
        whole = torch.randn(B, T, n, E, device="cuda", dtype=torch.bfloat16)
        cos, sin = (torch.rand(T, E, device="cuda") / 2 for _ in range(2))   # repeated calls stay finite
        outs = {t: torch.empty_like(whole) for t in TILES}
        grads = {t: whole.clone() for t in TILES}

        def forward(t):
            return _rope_launch(whole.transpose(1, 2), cos, sin, outs[t].transpose(1, 2), False, rotated, tile=t)

        def backward(t):
            g = grads[t].transpose(1, 2)[:, :rotated]
            return _rope_launch(g, cos, sin, g, True, tile=t)

        same = {}
        for t in TILES:
            forward(t)
            grads[t].copy_(whole)
            backward(t)
            same[str(t)] = torch.equal(outs[t], outs[ROPE_TILE]) and torch.equal(grads[t], grads[ROPE_TILE])
        us = timed({f"forward {t}": (lambda t=t: forward(t)) for t in TILES}
                   | {f"backward {t}": (lambda t=t: backward(t)) for t in TILES})   # in place: bits no longer compared
        moved = {"forward": 2 * whole.numel() * 2, "backward": 2 * B * T * rotated * E * 2}
        rates = {name: moved[name.split()[0]] / v / 1e6 for name, v in us.items()}
        update_ms = {str(t): layers * (us[f"forward {t}"] + us[f"backward {t}"]) / 1e3 for t in TILES}
        for name, v in us.items():
            print(f"{model} {name}: {v:.1f} us, {rates[name]:.2f} TB/s", flush=True)
        print(model, "an update's rope (ms):", {k: round(v, 3) for k, v in update_ms.items()}, "same bits:", same,
              flush=True)
        out["models"][model] = dict(same_bits=same, us=us, tb_s=rates, update_ms=update_ms)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    assert all(all(m["same_bits"].values()) for m in out["models"].values()), "a tile's bits differ"


if __name__ == "__main__":
    main(sys.argv[1])

"""The whole-weight NF4 decode (`nf4_decode`, BF16, double quantization) at several program tiles,
at every matrix shape a QLoRA update of Llama-3.2-1B and Llama-3.1-8B decodes (decodes kept for
backward: each matrix once an update), each into a buffer with 48 spare columns on either side, as
the joins' decodes have at rank 16.

Each tile's output is compared with the default's (`DECODE_TILE`) bit for bit, then every variant
is timed under CUDA graphs, in turn (`joint_gemms.timed`): microseconds a call, the bytes moved a
second (codes and scales read, BF16 written) and the decodes of one update summed over the layers.

    python benchmarks/decode_tiles.py OUT.json
"""
import json
import sys

import torch
import triton

from joint_gemms import timed
from aner.kernels import nf4 as K
from aner.quant.nf4 import NF4Weight

MODELS = {"llama-3.2-1b": (16, 2048, 512, 8192), "llama-3.1-8b": (32, 4096, 1024, 14336)}  # layers, hidden, kv, mlp
TILES = [K.DECODE_TILE, (32, 256, 4), (64, 256, 4), (32, 256, 8), (64, 256, 8), (128, 256, 8), (16, 512, 4),
         (32, 512, 8), (64, 512, 8)]
ROOM = 48                                         # columns left and right of the weight (rank 16's parts)


def shapes(d, kv, f):
    """(N, K): count a layer: q and o, k and v, gate and up, down."""
    return {(d, d): 2, (kv, d): 2, (f, d): 2, (d, f): 1}


def main(path):
    out = {"device": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "room": ROOM, "tiles": [list(t) for t in TILES], "models": {}}
    for model, (layers, d, kv, f) in MODELS.items():
        counts = shapes(d, kv, f)
        per_shape, same = {}, {}
        for N, Kin in counts:
            packed = K.DevicePacked.from_weight(NF4Weight.quantize(torch.randn(N, Kin) * 0.02, double_quant=True),
                                                "cuda")
            bufs = {t: torch.empty(N, ROOM + Kin + ROOM, device="cuda", dtype=torch.bfloat16) for t in TILES}

            def run(t, packed=packed, bufs=bufs):
                return K.nf4_decode(packed, torch.bfloat16, ROOM, ROOM, out=bufs[t], tile=t)

            ref = run(K.DECODE_TILE)[:, ROOM:ROOM + Kin].clone()
            same[f"{N}x{Kin}"] = {str(t): torch.equal(run(t)[:, ROOM:ROOM + Kin], ref) for t in TILES}
            us = timed({str(t): (lambda t=t: run(t)) for t in TILES})
            moved = packed.nbytes() + N * Kin * 2
            per_shape[f"{N}x{Kin}"] = {name: dict(us=v, tb_s=moved / v / 1e6) for name, v in us.items()}
            print(model, N, Kin, {name: f"{v:.1f} us {moved / v / 1e6:.2f} TB/s" for name, v in us.items()},
                  flush=True)
        update_ms = {str(t): layers * sum(c * per_shape[f"{N}x{Kin}"][str(t)]["us"] for (N, Kin), c in counts.items())
                     / 1e3 for t in TILES}
        print(model, "an update's decodes (ms):", {k: round(v, 3) for k, v in update_ms.items()}, flush=True)
        out["models"][model] = dict(same_bits=same, shapes=per_shape, update_ms=update_ms)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    assert all(all(v.values()) for m in out["models"].values() for v in m["same_bits"].values()), "a tile's bits differ"


if __name__ == "__main__":
    main(sys.argv[1])

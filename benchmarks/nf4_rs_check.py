"""`nf4_rs` against `nf4_ws`, bit for bit, at the shapes training calls them with: Llama-3.2-1B's and
SmolLM2-135M's projections at the benchmark's 8 x 1023 positions (forward and input gradient, each
where `nf4_rs` takes it) and their heads at the fused cross-entropy's chunks; each product twice.

    python benchmarks/nf4_rs_check.py results/<date>-h200-nf4-rs-check.json      (GPU machine)
"""
import json
import sys

import torch

import nf4_ws           # benchmarks/nf4_ws.py: the weights
from aner.kernels import nf4 as K
from aner.kernels import nf4_rs
from aner.kernels.nf4_ws import nf4_ws_matmul
from aner.train.loss import chunk_positions

TOKENS = 8 * 1023        # batch 8 x 1024: the positions that predict a next token
# (N, K, tokens): projections (q, k and v, o, gate and up apart and joined, down), then the head
SHAPES = [(2048, 2048, TOKENS), (512, 2048, TOKENS), (8192, 2048, TOKENS), (16384, 2048, TOKENS),
          (2048, 8192, TOKENS), (576, 576, TOKENS), (192, 576, TOKENS), (1536, 576, TOKENS), (3072, 576, TOKENS),
          (576, 1536, TOKENS)]
SHAPES += [(vocab, dim, m) for vocab, dim in [(128256, 2048), (49152, 576)]
           for m in (chunk_positions(vocab, 2), TOKENS % chunk_positions(vocab, 2))]


def main():
    torch.manual_seed(0)
    rows = []
    for N, Kin, M in SHAPES:
        p, _ = nf4_ws.packed(N, Kin)
        x, g = torch.randn(M, Kin, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
        row = {"N": N, "K": Kin, "tokens": M}
        for name, a, trans in (("forward", x, False), ("input_grad", g, True)):
            if nf4_rs.supported(a, p, trans):
                y = nf4_rs.nf4_rs_matmul(a, p, trans)
                row[name] = {"bits_of_ws": torch.equal(y, nf4_ws_matmul(a, p, trans, programs=K.MULTIPROCESSORS)),
                             "same_bits_twice": torch.equal(y, nf4_rs.nf4_rs_matmul(a, p, trans))}
        print(row, flush=True)
        rows.append(row)
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    if not all(all(c.values()) for r in rows for c in r.values() if isinstance(c, dict)):
        sys.exit("nf4_rs differs from nf4_ws")


if __name__ == "__main__":
    main()

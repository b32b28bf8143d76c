"""The fused NF4 products with the weight as the MMA's register operand (`aner.kernels.nf4_rs`:
the forward, and the input gradient through the transposed copy) in variants, against dense
cuBLAS and the warp-specialized kernel of `nf4_ws` (its defaults), each variant in its own process
(`nf4_ws.main`): checks against float64 at the BF16 bound of tests/test_kernels.py, twice the same
bits, the bits of `nf4_ws`; then do_bench medians.

    python benchmarks/nf4_rs.py results/<date>-h200-nf4-rs.json [V ...]    (GPU machine, ~120 s; V: the
                                                                            variants to run, in order)
"""
import sys

import torch

from aner.kernels import nf4 as K
from aner.kernels.nf4_rs import nf4_rs_matmul, supported
from aner.kernels.nf4_ws import nf4_ws_matmul

import nf4_ws           # benchmarks/nf4_ws.py: the runner of variants in processes of their own

# (ring depth, skip the decode, programs: None = one a tile, steps a group with a MMA in flight); the first is
# the default
VARIANTS = [(4, False, K.MULTIPROCESSORS, 8), (4, False, K.MULTIPROCESSORS, 4), (4, False, K.MULTIPROCESSORS, 1),
            (4, False, None, 8), (3, False, K.MULTIPROCESSORS, 8), (4, True, K.MULTIPROCESSORS, 8)]


def run_variant(v):
    stages, skip, programs, in_flight = VARIANTS[v]
    kw = dict(stages=stages, skip=skip, programs=programs, in_flight=in_flight)
    torch.manual_seed(0)
    row = {"stages": stages, "skip_decode": skip, "programs": programs or "one a tile", "in_flight": in_flight,
           "checks": {}, "problems": []}
    if not skip:
        for N, Kin, M in [(1000, 576, 300), (4096, 4096, 2048), (2048, 64, 4096), (136, 4096, 8192),
                          (576, 576, 8200), (1024, 4096, 8192)]:
            p, Wd = nf4_ws.packed(N, Kin)
            x, g = torch.randn(M, Kin, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
            for trans, a, want, scale in [(False, x, x.double() @ Wd.t(), x.double().abs() @ Wd.abs().t()),
                                          (True, g, g.double() @ Wd, g.double().abs() @ Wd.abs())]:
                if not supported(a, p, trans):
                    continue
                y = nf4_rs_matmul(a, p, trans, **kw)
                row["checks"][f"{N}x{Kin}x{M}{'-input-grad' if trans else ''}"] = {
                    "bound": bool(((y.double() - want).abs() <= 1e-2 * scale).all()),
                    "max_err_over_scale": float(((y.double() - want).abs() / scale.clamp_min(1e-30)).max()),
                    "same_bits_twice": torch.equal(y, nf4_rs_matmul(a, p, trans, **kw)),
                    "bits_of_ws": torch.equal(y, nf4_ws_matmul(a, p, trans))}
    nf4_ws.clocks_up()
    for N, Kin, M, trans, p, a, dense in nf4_ws.products():
        t = {"dense": nf4_ws.bench(dense), "ws": nf4_ws.bench(lambda: nf4_ws_matmul(a, p, trans)),
             "rs": nf4_ws.bench(lambda: nf4_rs_matmul(a, p, trans, **kw))}
        row["problems"].append({"N": N, "K": Kin, "tokens": M, "input_grad": trans, "us": t,
                                "ws_vs_dense": t["ws"] / t["dense"], "rs_vs_dense": t["rs"] / t["dense"]})
        print(VARIANTS[v], f"{'input grad' if trans else 'forward'} N{N} K{Kin} M{M}: dense {t['dense']:.1f} us,"
              f" ws {t['ws'] / t['dense']:.3f}x, rs {t['rs'] / t['dense']:.3f}x", file=sys.stderr, flush=True)
    return row


if __name__ == "__main__":
    nf4_ws.main(__file__, VARIANTS, run_variant, timeout=240)

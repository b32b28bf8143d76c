"""The warp-specialized NF4 products (`aner.kernels.nf4_ws`) in variants, against dense cuBLAS
and the Triton kernels (`aner.kernels.nf4` with their default tiles), each variant in its own
process (a variant that hangs is cut and recorded): checks against float64 at the BF16 bound of
tests/test_kernels.py and twice the same bits, then do_bench medians.

    python benchmarks/nf4_ws.py results/<date>-h200-nf4-ws.json     (GPU machine, ~90 s)
"""
import json
import subprocess
import sys

import torch
import triton

from aner.kernels import nf4 as K
from aner.kernels.nf4_ws import nf4_ws_matmul
from aner.quant.nf4 import NF4Weight

# (bm, decode warps a partition, their registers, ring depths, skip the decode, programs: None = one a tile)
VARIANTS = [(256, 4, 72, (4, 4, 8), False, None), (256, 4, 72, (4, 4, 8), False, K.MULTIPROCESSORS),
            (256, 4, 80, (3, 4, 8), False, K.MULTIPROCESSORS), (256, 4, 72, (4, 4, 8), True, None)]
PROBLEMS = [(4096, 4096, 2048), (4096, 4096, 8192), (8192, 2048, 8192), (2048, 8192, 8192)]   # N, K, tokens


def packed(N, Kin):
    """A double-quantized NF4 weight of 0.02-scaled normal values on the GPU (with the transposed
    copy of `nf4_rs`'s input gradient), and it decoded in float64."""
    w = NF4Weight.quantize(torch.randn(N, Kin) * 0.02, double_quant=True)
    return K.DevicePacked.from_weight(w, "cuda", transposed=True), w.dequantize().to("cuda", torch.float64)


def bench(fn) -> float:
    """do_bench's median, microseconds."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def products():
    """(N, K, tokens, input gradient?, the packed weight, the activations, dense cuBLAS's product)
    for each of PROBLEMS, forward then input gradient, on fresh BF16 inputs."""
    for N, Kin, M in PROBLEMS:
        p, Wd = packed(N, Kin)
        wd = Wd.bfloat16()
        x, g = torch.randn(M, Kin, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
        yield N, Kin, M, False, p, x, lambda: x @ wd.t()
        yield N, Kin, M, True, p, g, lambda: g @ wd


def clocks_up():
    """The clocks up before the first row."""
    warm = torch.randn(8192, 8192, device="cuda").bfloat16()
    triton.testing.do_bench(lambda: warm @ warm, warmup=300, rep=300)


def run_variant(v):
    bm, dw, dregs, stages, skip, programs = VARIANTS[v]
    kw = dict(bm=bm, dw=dw, dregs=dregs, stages=stages, skip=skip, programs=programs)
    torch.manual_seed(0)
    row = {"bm": bm, "programs": programs or "one a tile", "decode_warps": dw, "decode_registers": dregs,
           "stages": stages, "skip_decode": skip, "checks": {}, "problems": []}
    if not skip:        # against float64 (BF16 bound of tests/test_kernels.py), and twice the same bits
        for N, Kin, M in [(1000, 576, 300), (4096, 4096, 2048), (2048, 64, 4096), (136, 4096, 8192)]:
            p, Wd = packed(N, Kin)
            x, g = torch.randn(M, Kin, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
            for trans, a, want, scale in [(False, x, x.double() @ Wd.t(), x.double().abs() @ Wd.abs().t()),
                                          (True, g, g.double() @ Wd, g.double().abs() @ Wd.abs())]:
                y = nf4_ws_matmul(a, p, trans, **kw)
                ok = bool(((y.double() - want).abs() <= 1e-2 * scale).all()) \
                    and torch.equal(y, nf4_ws_matmul(a, p, trans, **kw))
                row["checks"][f"{N}x{Kin}x{M}{'-input-grad' if trans else ''}"] = ok
    clocks_up()
    for N, Kin, M in PROBLEMS:
        p, Wd = packed(N, Kin)
        wd = Wd.bfloat16()
        x, g = torch.randn(M, Kin, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
        t = {"dense": bench(lambda: x @ wd.t()), "dense_t": bench(lambda: g @ wd),
             "triton": bench(lambda: K.nf4_matmul(x, p, K.default_config("matmul", M, N, Kin, x.dtype))),
             "triton_t": bench(lambda: K.nf4_matmul_t(g, p, K.default_config("matmul_t", M, N, Kin, x.dtype))),
             "ws": bench(lambda: nf4_ws_matmul(x, p, False, **kw)),
             "ws_t": bench(lambda: nf4_ws_matmul(g, p, True, **kw))}
        row["problems"].append({"N": N, "K": Kin, "tokens": M, "us": t,
                                "triton_vs_dense": [t["triton"] / t["dense"], t["triton_t"] / t["dense_t"]],
                                "ws_vs_dense": [t["ws"] / t["dense"], t["ws_t"] / t["dense_t"]]})
        print(VARIANTS[v], f"N{N} K{Kin} M{M}: triton {t['triton'] / t['dense']:.2f}x"
              f"/{t['triton_t'] / t['dense_t']:.2f}x"
              f" ws {t['ws'] / t['dense']:.2f}x/{t['ws_t'] / t['dense_t']:.2f}x (forward/input gradient vs dense)",
              file=sys.stderr, flush=True)
    return row


def main(script=__file__, variants=VARIANTS, run=run_variant, timeout=120):
    """`script out.json [V ...]`: every variant (or variants V, in that order) in a process of its own
    (one that hangs is cut and recorded), the rows to out.json; `script --variant V`: variant V's row to
    stdout."""
    if sys.argv[1] == "--variant":
        print(json.dumps(run(int(sys.argv[2]))))
        return
    rows = []
    for v in [int(a) for a in sys.argv[2:]] or range(len(variants)):
        try:
            done = subprocess.run([sys.executable, script, "--variant", str(v)], capture_output=True, text=True,
                                  timeout=timeout)
            sys.stderr.write(done.stderr[-3000:])
            rows.append(json.loads(done.stdout) if done.returncode == 0
                        else {"variant": variants[v], "error": done.stderr[-1500:]})
        except subprocess.TimeoutExpired:
            rows.append({"variant": variants[v], "error": f"timed out after {timeout} s"})
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "variants": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""cuBLAS against cuBLASLt (PyTorch's `preferred_blas_library`) for the frozen matrices' products.

Under the library's deterministic policy, at Llama-3.2-1B QLoRA's GEMM shapes over a batch of
8 x 1024 tokens (each projection's forward and input gradient, the head over all 8192 positions):
the median microseconds of 30 calls with each library, two rounds alternated, the faster round
kept; whether each gives the same bits twice and the two the same bits. With `--train COMBO`, then
throughput.py's own side for COMBO in a process a library, alternated for `--rounds` (default 2).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/blas_library.py OUT.json [--train COMBO] [--rounds R]
"""
import argparse
import json
import os
import runpy
import subprocess
import sys

import torch

LIBRARIES = ("cublas", "cublaslt")
T, D = 8192, 2048
SHAPES = {"qkv forward": (T, D, 3072), "qkv input gradient": (T, 3072, D), "o forward": (T, D, D),
          "o input gradient": (T, D, D), "gate/up forward": (T, D, 16384), "gate/up input gradient": (T, 16384, D),
          "down forward": (T, 8192, D), "head forward": (T, D, 128256), "head input gradient": (T, 128256, D)}


def median_us(fn, calls=30):
    for _ in range(3):
        fn()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for s, e in zip(start, end):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) * 1e3 for s, e in zip(start, end))[calls // 2]


def gemms() -> dict:
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = {}
    for name, (m, k, n) in SHAPES.items():
        a = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
        b = (torch.randn(k, n, device="cuda", generator=gen) / k ** 0.5).bfloat16()
        us, out, twice = {lib: [] for lib in LIBRARIES}, {}, {}
        for _ in range(2):
            for lib in LIBRARIES:
                torch.backends.cuda.preferred_blas_library(lib)
                out[lib] = a @ b
                twice[lib] = torch.equal(out[lib], a @ b)
                us[lib].append(median_us(lambda: a @ b))
        best = {lib: min(t) for lib, t in us.items()}
        rows[name] = {"m_k_n": [m, k, n], "us": best, "rounds_us": us, "lt_over_cublas": best["cublaslt"] / best["cublas"],
                      "same_bits_twice": twice, "same_bits_both": torch.equal(*out.values())}
        print(f"{name:24s} cuBLAS {best['cublas']:8.1f} us  cuBLASLt {best['cublaslt']:8.1f} us"
              f"  {rows[name]['lt_over_cublas']:.3f}x  same bits {rows[name]['same_bits_both']}", flush=True)
        del a, b, out
    return rows


def main():
    if sys.argv[1] == "--run":                  # a process of throughput.py's own side under one library
        torch.backends.cuda.preferred_blas_library(sys.argv[2])
        sys.argv = [os.path.join(os.path.dirname(__file__), "throughput.py")] + sys.argv[3:]
        runpy.run_path(sys.argv[0], run_name="__main__")
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--train", help="model:method[:flag] timed by throughput.py in a process a library")
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemms": gemms(), "training": []}
    for r in range(a.rounds if a.train else 0):
        for lib in LIBRARIES:
            part = f"{a.out[:-len('.json')]}-{lib}-{r + 1}.json"
            subprocess.run([sys.executable, __file__, "--run", lib, part, "--no-peer", a.train], check=True)
            ours = json.load(open(part))["rows"][0]["ours"]
            record["training"].append({"library": lib, "round": r + 1, "tokens_per_s": ours["tokens_per_s"]})
            print(f"{lib} round {r + 1}: {a.train} {ours['tokens_per_s'] / 1e3:.1f}k tokens/s", flush=True)
    with open(a.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

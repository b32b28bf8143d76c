"""Projections that read one input, as one GEMM over their weights laid side by side against one
GEMM each (the input gradient chained through beta = 1 products), at Llama-3.2-1B's shapes of a
batch of 8 x 1024 tokens: q, k, v (2048, 512, 512 rows) and gate, up (8192, 8192 rows), each over
2048 columns. GPU time of back-to-back calls under a CUDA graph, medians of repeats.

    python benchmarks/joint_gemms.py OUT.json
"""
import json
import statistics
import sys

import torch


def timed(fn, calls=10, repeats=7):
    """Median microseconds a call over `repeats` replays of a graph of `calls` calls."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def group(M, K, rows, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(sum(rows), K, device="cuda", dtype=dtype, generator=g) * 0.02
    ws = list(w.split(rows))
    gy = torch.randn(M, sum(rows), device="cuda", dtype=dtype, generator=g)
    gs = [t.contiguous() for t in gy.split(rows, dim=1)]
    dx = torch.empty(M, K, device="cuda", dtype=dtype)
    dw = torch.empty(sum(rows), K, device="cuda", dtype=torch.float32)

    def chain():
        d = torch.mm(gs[0], ws[0])
        for gi, wi in zip(gs[1:], ws[1:]):
            d.addmm_(gi, wi)

    out = {
        "forward_each_us": timed(lambda: [torch.nn.functional.linear(x, wi) for wi in ws]),
        "forward_joint_us": timed(lambda: torch.nn.functional.linear(x, w)),
        "dx_chain_us": timed(chain),
        "dx_joint_us": timed(lambda: torch.mm(gy, w, out=dx)),
        "dx_cat_joint_us": timed(lambda: torch.mm(torch.cat(gs, dim=1), w, out=dx)),
        "dw_each_us": timed(lambda: [torch.mm(gi.t(), x, out_dtype=torch.float32) for gi in gs]),
        "dw_each_of_joint_us": timed(lambda: [torch.mm(gi.t(), x, out_dtype=torch.float32)
                                              for gi in gy.split(rows, dim=1)]),
        "dw_joint_us": timed(lambda: torch.mm(gy.t(), x, out_dtype=torch.float32)),
    }
    d_chain = torch.mm(gs[0], ws[0])
    for gi, wi in zip(gs[1:], ws[1:]):
        d_chain.addmm_(gi, wi)
    exact = (gy.double() @ w.double())
    out["dx_chain_err"] = (d_chain.double() - exact).abs().max().item()
    out["dx_joint_err"] = (torch.mm(gy, w).double() - exact).abs().max().item()
    return out


def main(path):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.use_deterministic_algorithms(True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "qkv": group(8192, 2048, [2048, 512, 512]), "gate_up": group(8192, 2048, [8192, 8192])}
    for name in ("qkv", "gate_up"):
        r = result[name]
        print(name, " ".join(f"{k}={v:.1f}" if k.endswith("us") else f"{k}={v:.3g}" for k, v in r.items()))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

"""Projections that read one input, as one GEMM over their weights laid side by side against one
GEMM each (the input gradient chained through beta = 1 products; the forward's also written into
the columns of one output), at the shapes of a batch of 8 x 1024 tokens: q, k, v and gate, up of
SmolLM2-135M (576, 192, 192 and 1536, 1536 rows over 576 columns) and Llama-3.2-1B (2048, 512,
512 and 8192, 8192 over 2048). GPU time of back-to-back calls under a CUDA graph, medians of repeats
in which the variants take turns.

    python benchmarks/joint_gemms.py OUT.json
"""
import json
import statistics
import sys

import torch


def graphed(fn, calls=10):
    """A CUDA graph of `calls` calls of fn."""
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
    return graph


def in_turn(runs: dict, repeats=7) -> dict:
    """Median milliseconds of each callable's GPU work over `repeats` calls, the callables called
    in turn within each repeat (the GPU's clock falls as it warms at the power limit: timed one
    after another, the first would run fastest)."""
    times = {name: [] for name in runs}
    torch.cuda.synchronize()
    for _ in range(repeats):
        for name, run in runs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times[name].append(start.elapsed_time(end))
    return {name: statistics.median(t) for name, t in times.items()}


def timed(variants: dict, calls=10, repeats=7) -> dict:
    """Median microseconds a call of each variant over `repeats` replays of its graph of `calls`
    calls, the variants replayed in turn (`in_turn`)."""
    ms = in_turn({name: graphed(fn, calls).replay for name, fn in variants.items()}, repeats)
    return {name: t * 1000 / calls for name, t in ms.items()}


def group(M, K, rows, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=dtype, generator=g)
    w = torch.randn(sum(rows), K, device="cuda", dtype=dtype, generator=g) * 0.02
    ws = list(w.split(rows))
    gy = torch.randn(M, sum(rows), device="cuda", dtype=dtype, generator=g)
    gs = [t.contiguous() for t in gy.split(rows, dim=1)]
    dx = torch.empty(M, K, device="cuda", dtype=dtype)

    def chain():
        d = torch.mm(gs[0], ws[0])
        for gi, wi in zip(gs[1:], ws[1:]):
            d.addmm_(gi, wi)
        return d

    ys = torch.empty(M, sum(rows), device="cuda", dtype=dtype).split(rows, dim=1)

    def into_joint():
        for wi, yi in zip(ws, ys):
            torch.mm(x, wi.t(), out=yi)

    out = timed({
        "forward_each_us": lambda: [torch.nn.functional.linear(x, wi) for wi in ws],
        "forward_each_into_joint_us": into_joint,
        "forward_joint_us": lambda: torch.nn.functional.linear(x, w),
        "dx_chain_us": chain,
        "dx_joint_us": lambda: torch.mm(gy, w, out=dx),
        "dx_cat_joint_us": lambda: torch.mm(torch.cat(gs, dim=1), w, out=dx),
        "dw_each_us": lambda: [torch.mm(gi.t(), x, out_dtype=torch.float32) for gi in gs],
        "dw_each_of_joint_us": lambda: [torch.mm(gi.t(), x, out_dtype=torch.float32) for gi in gy.split(rows, dim=1)],
        "dw_joint_us": lambda: torch.mm(gy.t(), x, out_dtype=torch.float32),
    })
    d_chain = chain()
    into_joint()
    out["forward_each_into_joint_equal"] = all(torch.equal(yi, torch.nn.functional.linear(x, wi))
                                               for wi, yi in zip(ws, ys))
    exact = (gy.double() @ w.double())
    out["dx_chain_err"] = (d_chain.double() - exact).abs().max().item()
    out["dx_joint_err"] = (torch.mm(gy, w).double() - exact).abs().max().item()
    return out


def main(path):
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    torch.use_deterministic_algorithms(True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "qkv": group(8192, 2048, [2048, 512, 512]), "gate_up": group(8192, 2048, [8192, 8192]),
              "smollm2_qkv": group(8192, 576, [576, 192, 192]), "smollm2_gate_up": group(8192, 576, [1536, 1536])}
    for name in ("qkv", "gate_up", "smollm2_qkv", "smollm2_gate_up"):
        r = result[name]
        print(name, " ".join(f"{k}={v:.1f}" if k.endswith("us") else f"{k}={v:.3g}" for k, v in r.items()))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])

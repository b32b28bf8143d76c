"""cuDNN's deterministic attention (aner.kernels.cudnn_attention) against ours, on a GPU.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src:benchmarks python3 benchmarks/attention_cudnn.py OUT.json

At the training shapes of `attention.py` (8 x 1024 positions, BF16): each checked against float64
on one sequence (`attention.error`), for the same bits over 20 forward and backward passes and in a
CUDA graph's replay, then timed as training runs it, ten calls recorded in one CUDA graph (median
of 5 rounds of replays, `attention.timed`), so the host's cost of a call does not count.
"""
import datetime
import json
import sys

import cudnn
import torch

from aner.kernels import attention as A, cudnn_attention as C
from attention import SHAPES, error, operands, record_times, timed


def graphed(fn, n=10):
    """ms a call of fn: n calls recorded in one CUDA graph, its replays timed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(n):
            fn()
    return timed(graph.replay) / n


def same_bits(fn, n=20):
    first = [t.clone() for t in fn()]
    return all(all(torch.equal(a, b) for a, b in zip(first, fn())) for _ in range(n - 1))


def main():
    out_path = sys.argv[1]
    torch.use_deterministic_algorithms(True)
    rows = []
    for model, (B, H, K, T, E) in SHAPES.items():
        q, k, v, do = operands(B, H, K, T, E)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        flop_fwd = 2 * 2 * B * H * T * T * E / 2
        for name, call in (("ours", A.attention), ("cudnn", C.attention)):
            row = {"model": model, "shape": [B, H, K, T, E], "variant": name}

            def grads():
                return torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do)
            try:
                e_out, e_dq, _, _ = error(call, q, k, v, do)
                row.update(err_out=e_out, err_dq=e_dq, same_bits_20=same_bits(grads))
                eager = [t.clone() for t in grads()]
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    replayed = grads()
                graph.replay()
                row["graph_same_bits"] = all(torch.equal(a, b) for a, b in zip(eager, replayed))
                fwd, both = graphed(lambda: call(q, k, v)), graphed(grads)
                print(f"{model:13} {name:6} {record_times(row, fwd, both, flop_fwd)}  err out {e_out:.2e} "
                      f"dq {e_dq:.2e}  same bits {row['same_bits_20']}, in a graph {row['graph_same_bits']}", flush=True)
            except Exception as ex:   # recorded, not hidden
                row["error"] = f"{type(ex).__name__}: {ex}"[:500]
                print(f"{model:13} {name:6} {row['error']}", flush=True)
            rows.append(row)
    with open(out_path, "w") as f:
        json.dump({"schema": "aner.attention-cudnn/1", "date": datetime.date.today().isoformat(),
                   "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "cudnn": cudnn.backend_version(), "cudnn_frontend": cudnn.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

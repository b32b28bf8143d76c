"""Whether cuDNN's attention picks the same plan and gives the same bits in every process: PROCESSES
fresh processes (PARALLEL at once) each build the forward and deterministic backward graphs of
`kernels.cudnn_attention` at Llama-3.2-1B's heads (8 x 1024 positions, 32 query and 8 key/value
heads of 64, each over (B, T, heads, E) memory as training lays them out) over the same seeded
operands, run them, and record each graph's candidate plans (the heuristics' order; the first that
builds runs), the frontend's log of what it chose (`plan_lines`) and a digest of every output.

    python benchmarks/cudnn_plans.py OUT.json [--processes N (96)] [--parallel P (8)]
"""
import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile

import torch

KEPT = ("Auto-selected", "Candidate", "recommendation count", "plan at index")


def logged(path: str) -> dict:
    """The environment of a child process whose cuDNN frontend logs to `path`."""
    return os.environ | {"CUDNN_FRONTEND_LOG_INFO": "1", "CUDNN_FRONTEND_LOG_FILE": path}


def children(args_of, count: int, parallel: int):
    """(i, return code, stdout, stderr) of `count` child processes of this interpreter, in order:
    process i runs with arguments args_of(i) and its frontend logging to a file of its own
    (`logged`), `parallel` at once, each with its share of the cores for PyTorch's host threads (so
    that several processes' thread pools do not contend for every core)."""
    logs, threads = tempfile.mkdtemp(), str(max(1, os.cpu_count() // parallel))
    for start in range(0, count, parallel):
        batch = [(i, subprocess.Popen([sys.executable, *args_of(i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=logged(f"{logs}/{i}.log") | {"OMP_NUM_THREADS": threads}))
                 for i in range(start, min(start + parallel, count))]
        for i, child in batch:
            out, err = child.communicate()
            yield i, child.returncode, out, err


def plan_lines() -> dict:
    """The lines of this process's frontend log (see `logged`) that say which SDPA implementation,
    candidates and plans cuDNN chose, each with its count; empty where it does not log."""
    path = os.environ.get("CUDNN_FRONTEND_LOG_FILE")
    if not path or not os.path.exists(path):
        return {}
    with open(path, errors="replace") as f:
        return dict(collections.Counter(line.strip() for line in f if any(k in line for k in KEPT)))


def one() -> dict:
    from aner.kernels import cudnn_attention
    torch.manual_seed(0)
    B, H, K, T, E = 8, 32, 8, 1024, 64
    q, k, v = (torch.randn(B, T, n, E, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
               for n in (H, K, K))
    o = cudnn_attention.attention(q, k, v)
    o.backward(torch.randn_like(o))
    torch.cuda.synchronize()
    from first_update_bits import digest    # the one digest of the bits checks (it imports this module)
    graphs = {key[0]: g for key, (g, _) in cudnn_attention._graphs.items()}
    try:
        plans = {op: [g.get_plan_name_at_index(i) for i in range(g.get_execution_plan_count())]
                 for op, g in graphs.items()}
    except Exception as e:    # the frontend's own error, kept: the digests still say whether bits differ
        plans = repr(e)
    return {"plans": plans, "log": plan_lines(),
            "digests": {n: digest(t) for n, t in (("o", o), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad))}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--processes", type=int, default=96)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--run", action="store_true", help="one process: print its record")
    a = ap.parse_args()
    if a.run:
        print(json.dumps(one()))
        return
    runs = []
    for _, code, out, err in children(lambda i: [__file__, "-", "--run"], a.processes, a.parallel):
        if code:
            print(err[-3000:], file=sys.stderr)
        runs.append(json.loads(out.splitlines()[-1]) if code == 0 else {"failed": code})
        differ = [k for k in ("digests", "plans", "log", "failed") if runs[-1].get(k) != runs[0].get(k)]
        print(len(runs), f"{', '.join(differ)} differ: {json.dumps(runs[-1])[:3000]}" if differ else "same",
              flush=True)
        with open(a.out, "w") as f:           # after each process: a cut call keeps what ran
            json.dump({"first": runs[0], "processes": len(runs),
                       "differ": {i: r for i, r in enumerate(runs) if r != runs[0]}}, f)
    print(json.dumps(runs[0])[:3000])


if __name__ == "__main__":
    main()

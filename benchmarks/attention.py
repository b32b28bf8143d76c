"""The fused causal attention against PyTorch's, forward and backward, on a GPU.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=src python3 benchmarks/attention.py OUT.json

At the training shapes (8 x 1024 positions, BF16; SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B
heads): ours at its default tiles and at variants of each kernel's tiles, PyTorch's
scaled_dot_product_attention under the deterministic policy (its flash attention) and, for
reference only, in its default mode (cuDNN: the library may not take it, it is not deterministic).
Each is first checked against float64 on one sequence (the output and dq within 2x PyTorch's own
error plus two BF16 roundings of the largest magnitude), then timed with CUDA events (median of 5
rounds of ~25 ms after two of warm-up). FLOP/s counts the causal half: 2 products forward, 5 backward.
"""
import datetime
import json
import math
import sys

import torch
import torch.nn.functional as F

from aner.kernels import attention as A

SHAPES = {"smollm2-135m": (8, 9, 3, 1024, 64), "llama-3.2-1b": (8, 32, 8, 1024, 64),
          "llama-3.1-8b": (8, 32, 8, 1024, 128)}
VARIANTS = {"fwd": [(128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
            "dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (32, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 3)],
            "dq": [(128, 64, 8, 2), (128, 32, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 32, 4, 3),
                   (128, 32, 8, 3), (64, 64, 4, 2)]}


def timed(fn, rounds=5, window_ms=25.0):
    """Median ms a call over `rounds` rounds of ~window_ms each, after ~2 windows of warm-up (the
    clocks rise out of the idle of the compiles before)."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    reps = max(1, int(window_ms / max(a.elapsed_time(b), 1e-3)))
    times = []
    for i in range(rounds + 2):
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) / reps)
    return sorted(times)[rounds // 2]


def torch_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def error(fn, q, k, v, do):
    """max |out - ref|, max |dq - ref| over one sequence against float64."""
    q, k, v, do = (t[:1] for t in (q, k, v, do))
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    s = qd @ kd.repeat_interleave(group, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    T = q.shape[2]
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    ref = torch.softmax(s, -1) @ vd.repeat_interleave(group, 1)
    (dq_ref,) = torch.autograd.grad(ref, qd, do.double())
    qq = q.detach().requires_grad_()
    out = fn(qq, k, v)
    (dq,) = torch.autograd.grad(out, qq, do)
    return ((out.double() - ref).abs().max().item(), (dq.double() - dq_ref).abs().max().item(),
            ref.abs().max().item(), dq_ref.abs().max().item())


def record_times(row, fwd, both, flop_fwd):
    """Puts the forward's and the backward's ms and TFLOP/s into row (the backward does 2.5
    forwards' products), from the forward's and the pair's ms; returns them as text."""
    row.update(fwd_ms=fwd, fwd_bwd_ms=both, bwd_ms=both - fwd,
               fwd_tflops=flop_fwd / fwd / 1e9, bwd_tflops=2.5 * flop_fwd / (both - fwd) / 1e9)
    return (f"fwd {fwd * 1e3:7.1f} us ({row['fwd_tflops']:4.0f} TFLOP/s)  "
            f"bwd {row['bwd_ms'] * 1e3:7.1f} us ({row['bwd_tflops']:4.0f})")


def operands(B, H, K, T, E):
    """q, k, v and an upstream gradient, BF16, as the model hands them over: transposed views of
    (B, T, n, E) projections (the same seed for every shape)."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def heads(n):
        return torch.randn(B, T, n, E, device="cuda", generator=g).bfloat16().transpose(1, 2)
    return heads(H), heads(K), heads(K), heads(H)


def main():
    out_path = sys.argv[1]
    torch.use_deterministic_algorithms(True)
    rows = []
    for model, (B, H, K, T, E) in SHAPES.items():
        q, k, v, do = operands(B, H, K, T, E)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        flop_fwd = 2 * 2 * B * H * T * T * E / 2
        ref_err = error(torch_attention, q, k, v, do)
        base = A.TILES[64 if E <= 64 else 128]
        candidates = [("torch (deterministic: flash)", torch_attention, True, None)]
        candidates += [("ours default", None, False, base)]
        candidates += [(f"ours {kind}={t}", None, False, {**base, kind: t})
                       for kind, ts in VARIANTS.items() for t in ts if t != base[kind]]
        candidates += [("torch (default mode: cuDNN, not deterministic)", torch_attention, False, None)]
        for name, fn, deterministic, tiles in candidates:
            torch.use_deterministic_algorithms(deterministic or tiles is not None)
            call = fn or (lambda q, k, v, tiles=tiles: A.attention(q, k, v, tiles))
            row = {"model": model, "shape": [B, H, K, T, E], "variant": name, "tiles": tiles}
            try:
                e_out, e_dq, m_out, m_dq = error(call, q, k, v, do)
                bound = lambda mine, theirs, mag: mine <= 2 * theirs + 2 * 2 ** -8 * mag  # noqa: E731
                row["ok"] = bound(e_out, ref_err[0], m_out) and bound(e_dq, ref_err[1], m_dq)
                row.update(err_out=e_out, err_dq=e_dq)
                fwd = timed(lambda: call(q, k, v))
                both = timed(lambda: torch.autograd.grad(call(qg, kg, vg), (qg, kg, vg), do))
                print(f"{model:13} {name:52} {record_times(row, fwd, both, flop_fwd)}  "
                      f"{'ok' if row['ok'] else 'WRONG'}", flush=True)
            except Exception as ex:   # recorded, not hidden
                row["error"] = f"{type(ex).__name__}: {ex}"[:300]
                print(f"{model:13} {name:52} {row['error'][:100]}", flush=True)
            rows.append(row)
    torch.use_deterministic_algorithms(True)
    with open(out_path, "w") as f:
        json.dump({"schema": "aner.attention/1", "date": datetime.date.today().isoformat(),
                   "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""The RMSNorm backward kernel's rows a step and the ordered sum of its weight-gradient parts, on a GPU.

    PYTHONPATH=src python3 benchmarks/norm_kernels.py OUT.json

At 8192 rows of SmolLM2's, Llama-3.2-1B's and Llama-3.1-8B's widths (576, 2048, 4096), the
backward as training runs it after a residual add (the stream's gradient added, y's gradient
written, the weight's parts summed) with 1, 2 and 4 rows loaded a step (`_step_rows` picks one),
and `sum_splits` of those parts in blocks of 1024 elements (as before) against the blocks it
picks now; with the weight frozen (no parts: LoRA, QLoRA), 1, 2 and 4 rows a step, each with one
step a program (`_backward_rows` now) and with the rows a program takes for the parts (before).
Every variant's dx and dy are checked against the one-row kernel's (equal bits; the weight
gradient only within FP32 accuracy, since a tile sums its rows first) and the sums' bits against
the old blocks'. Times are medians of replayed CUDA graphs (us).
"""
import datetime
import json
import sys

import torch
import triton
import triton.testing

from aner.kernels import layer as L
from aner.kernels.splits import _sum_splits_kernel, sum_splits

ROWS = 8192


def graphed_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def width(D: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(D)
    s, w = torch.randn(ROWS, D, device="cuda", generator=g), torch.randn(D, device="cuda", generator=g)
    r = torch.rand(ROWS, device="cuda", generator=g) + 0.5
    dout = torch.randn(ROWS, D, device="cuda", generator=g).bfloat16()
    ds = torch.randn(ROWS, D, device="cuda", generator=g)
    bd = triton.next_power_of_2(D)
    per, programs = L._backward_rows(ROWS, L._step_rows(bd), True)

    def backward(step):
        dx, dy = torch.empty_like(s), torch.empty(ROWS, D, device="cuda", dtype=torch.bfloat16)
        part = torch.empty(programs, D, device="cuda")
        L._rms_backward_kernel[(programs,)](dout, s, w, r, ds, dx, dy, part, ROWS, D, ROWS=per, STEP=step,
                                            HAS_DS=True, HAS_DY=True, HAS_DW=True, BD=bd, num_warps=L._warps(bd))
        return dx, dy, part

    one = backward(1)
    dw_one = one[2].double().sum(0)
    steps = {}
    for step in (1, 2, 4):
        dx, dy, part = backward(step)
        steps[step] = {"us": graphed_us(lambda: backward(step)),
                       "dx_dy_equal": torch.equal(dx, one[0]) and torch.equal(dy, one[1]),
                       "dw_max_rel_diff": ((part.double().sum(0) - dw_one).abs().max() / dw_one.abs().max()).item()}
    frozen = {}        # the weight frozen (LoRA, QLoRA): no parts; the rows a program takes
    for step in (1, 2, 4):
        for per in sorted({step, L._backward_rows(ROWS, step, True)[0]}):
            def no_dw(per=per, step=step):
                dx, dy = torch.empty_like(s), torch.empty(ROWS, D, device="cuda", dtype=torch.bfloat16)
                L._rms_backward_kernel[(triton.cdiv(ROWS, per),)](
                    dout, s, w, r, ds, dx, dy, dx, ROWS, D, ROWS=per, STEP=step, HAS_DS=True, HAS_DY=True,
                    HAS_DW=False, BD=bd, num_warps=L._warps(bd))
                return dx, dy
            dx, dy = no_dw()
            frozen[f"{step} rows a step, {per} a program"] = {
                "us": graphed_us(no_dw), "dx_dy_equal": torch.equal(dx, one[0]) and torch.equal(dy, one[1])}
    part, old = one[2], torch.empty(D, device="cuda")

    def old_sum():
        _sum_splits_kernel[(triton.cdiv(D, 1024),)](part, old, D, D, 0, D, 1, 1.0, old, 0, 0, 0, SPLIT=programs,
                                                    BLOCK=1024, PARTS=False, JOINED=False, SCALED=False, num_warps=4,
                                                    enable_fp_fusion=False)
    old_sum()
    return {"rows": ROWS, "width": D, "programs": programs, "step_rows_chosen": L._step_rows(bd),
            "bytes": ROWS * D * (2 + 4 + 4 + 4 + 2), "backward": steps, "frozen_weight": frozen,
            "sum_splits_us": {"old_blocks_of_1024": graphed_us(old_sum), "now": graphed_us(lambda: sum_splits(part))},
            "sum_splits_equal": torch.equal(sum_splits(part), old)}


def main():
    out = sys.argv[1]
    rows = [width(D) for D in (576, 2048, 4096)]
    record = {"benchmark": "norm_kernels", "date": datetime.date.today().isoformat(),
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "rows": rows}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    for r in rows:
        steps = ", ".join(f"{k} rows {v['us']:.1f} us" for k, v in r["backward"].items())
        print(f"{r['rows']} x {r['width']}: {steps} (chosen {r['step_rows_chosen']}); sum_splits "
              f"{r['sum_splits_us']['old_blocks_of_1024']:.1f} -> {r['sum_splits_us']['now']:.1f} us, "
              f"equal {r['sum_splits_equal']}; dx, dy equal {all(v['dx_dy_equal'] for v in r['backward'].values())}")
        print("  frozen weight: " + ", ".join(f"{k} {v['us']:.1f} us{'' if v['dx_dy_equal'] else ' (other bits)'}"
                                              for k, v in r["frozen_weight"].items()))


if __name__ == "__main__":
    main()

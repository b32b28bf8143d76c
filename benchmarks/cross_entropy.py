"""The fused cross-entropy kernel over one chunk of logits, on a GPU: its variants, and an earlier tree's.

    PYTHONPATH=src python3 benchmarks/cross_entropy.py OUT.json [--old DIR]

At the chunks training makes (8192 and 1046 positions of the Llama vocabulary, 128,256; 8192 of
SmolLM2's, 49,152; BF16 logits, the gradient written over them), the kernel as
`cross_entropy_grad` launches it (one program a multiprocessor, the row read once from device
memory, pass 2 from L2) and with other blocks, warps and programs a multiprocessor; with --old,
the `cross_entropy_grad` of the tree under DIR (`git archive REV src | tar -x -C DIR`). Every
variant's loss and gradient are checked against float64 on the first 64 rows (the kernel tests'
bound: loss within 1e-6 relative, gradient within half a BF16 ulp plus 1e-6 x scale), and the
default's bits against two more calls. Times are medians of replayed CUDA graphs; GB/s counts
the fewest bytes (the logits read once, the gradient written once).
"""
import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.testing

from aner.kernels import cross_entropy as CE

SHAPES = [(8192, 128256), (1046, 128256), (8192, 49152)]
SCALE = 1 / 8192


def load_old(root: Path):
    """The package under root/src/aner as `old_aner`, its cross-entropy module."""
    spec = importlib.util.spec_from_file_location("old_aner", root / "src/aner/__init__.py",
                                                  submodule_search_locations=[str(root / "src/aner")])
    sys.modules["old_aner"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return importlib.import_module("old_aner.kernels.cross_entropy")


def error(loss, grad, logits, targets) -> float:
    """The largest error over the kernel tests' bound on the first 64 rows: each row's loss (from
    the kernel's per-row buffer; None: the gradient's alone) and the gradient."""
    z = logits[:64].double().requires_grad_(True)
    want_loss = F.cross_entropy(z, targets[:64], reduction="none")
    (want,) = torch.autograd.grad(want_loss.sum(), z)
    want = want * SCALE
    fi = torch.finfo(grad.dtype)
    bound = 1e-6 * SCALE + fi.eps / 2 * (want.abs() + 1e-6 * SCALE + fi.smallest_normal)
    err = ((grad[:64].double() - want).abs() / bound).max().item()
    if loss is not None:
        err = max(err, ((loss[:64].double() - want_loss).abs() / (1e-6 * want_loss.abs())).max().item())
    return err


def shape(n: int, V: int, old) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(n + V)
    logits = (torch.randn(n, V, device="cuda", generator=g) * 2).bfloat16()
    targets = torch.randint(0, V, (n,), device="cuda", generator=g)
    scale = torch.tensor(SCALE, device="cuda")
    sms = CE._programs(logits.device)             # one program a multiprocessor: the launcher's own count
    work, loss = logits.clone(), torch.empty(n, device="cuda")

    def ours(block=None, warps=None, per_sm=1):
        return lambda: CE._launch(work, targets, scale, loss, work, -100, per_sm * sms, block, warps)

    variants = {"ours": ours()}
    for block, warps, per_sm in [(16384, 16, 1), (8192, 16, 2), (8192, 8, 2), (4096, 8, 4)]:
        if block <= triton.next_power_of_2(V):
            variants[f"ours block {block} warps {warps} {per_sm}/SM"] = ours(block, warps, per_sm)
    if old is not None:                           # its launcher returns the summed loss only
        variants["old"] = lambda: old.cross_entropy_grad(work, targets, scale, out=work)
    rows = []
    for name, fn in variants.items():
        work.copy_(logits)
        loss.fill_(float("nan"))
        fn()
        err = error(None if name == "old" else loss, work, logits, targets)
        same = None
        if name == "ours":
            first = work.clone()
            same = True
            for _ in range(2):
                work.copy_(logits)
                fn()
                same &= torch.equal(work, first)
        us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
        gbs = 2 * logits.numel() * logits.element_size() / us / 1e3
        rows.append({"n": n, "V": V, "variant": name, "us": round(us, 1), "GB/s": round(gbs), "error/bound": err,
                     "same bits thrice": same})
        print(f"{n:5d} x {V:6d}  {name:32s} {us:8.1f} us  {gbs:6.0f} GB/s  err/bound {err:.3g}", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--old", type=Path)
    args = ap.parse_args()
    old = load_old(args.old) if args.old else None
    rows = [row for n, V in SHAPES for row in shape(n, V, old)]
    record = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(0),
              "triton": triton.__version__, "torch": torch.__version__, "rows": rows}
    Path(args.out).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()

"""Whether the warpgroup barriers of `aner.kernels.nf4_rs`'s MMA partitions cost time: the kernel's
PTX as compiled, and the same PTX without the `bar.sync` before each ring-slot wait, before each
slot release, or both (the compiler puts one before every mbarrier wait of a chain and every arrive; here
neither is needed: a slot cannot be refilled before its MMA, which every warp issued, is seen to
finish). The edited PTX goes in through Triton's IR override, in processes of their own,
alternated; each checks its bits against `nf4_ws` and times the forward and the input gradient
against dense cuBLAS with the host's launches queued ahead of the GPU (no launch cost in the
figures) and with do_bench. `--run plain` alone times the tree on PYTHONPATH (two trees
alternated: an A/B of the kernel).

    python benchmarks/nf4_rs_barriers.py results/<date>-h200-nf4-rs-barriers.json   (GPU machine)
"""
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import torch

WAIT = re.compile(r"bar\.sync\s+\d+, 128;(\s*// begin inline asm\s*\{\s*\.reg \.pred complete;)")
ARRIVE = re.compile(r"bar\.sync\s+\d+, 128;(\s*// begin inline asm\s*@%p\d+ mbarrier\.arrive)")


def queued(fn, reps=50):
    """Median microseconds of fn between CUDA events, every launch queued behind a GPU sleep so the
    host's launch cost never shows; the L2 cleared before each call as do_bench does. Also the host's
    microseconds a call (launching it alone)."""
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)              # ~0.1 s of GPU time for the host to queue everything
    host = 0.0
    for i in range(reps):
        flush.zero_()
        start[i].record()
        t = time.perf_counter()
        fn()
        host += time.perf_counter() - t
        end[i].record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) * 1e3 for s, e in zip(start, end))
    return times[reps // 2], host / reps * 1e6


def run(mode):
    import nf4_ws
    from aner.kernels.nf4_rs import nf4_rs_matmul
    from aner.kernels.nf4_ws import nf4_ws_matmul
    torch.manual_seed(0)
    row = {"without": mode, "checks": {}, "problems": []}
    for N, Kin, M in [(4096, 4096, 2048), (2048, 8192, 4096), (1024, 4096, 8192)]:
        p, Wd = nf4_ws.packed(N, Kin)
        x, g = torch.randn(M, Kin, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
        for trans, a in ((False, x), (True, g)):
            y = nf4_rs_matmul(a, p, trans)
            row["checks"][f"{N}x{Kin}x{M}{'-input-grad' if trans else ''}"] = {
                "bits_of_ws": torch.equal(y, nf4_ws_matmul(a, p, trans)),
                "same_bits_twice": torch.equal(y, nf4_rs_matmul(a, p, trans))}
    if mode == "dump":                          # the kernel compiled, for its PTX
        return row
    nf4_ws.clocks_up()
    for N, Kin, M, trans, p, a, dense in nf4_ws.products():
        t = {}
        for _ in range(3):                      # alternated, each side's median of its three
            for name, fn in (("dense", dense), ("rs", lambda: nf4_rs_matmul(a, p, trans))):
                t.setdefault(name, []).append(queued(fn))
        us = {k: sorted(v)[1][0] for k, v in t.items()}
        host = {k: sorted(v)[1][1] for k, v in t.items()}
        bench = {"dense": nf4_ws.bench(dense), "rs": nf4_ws.bench(lambda: nf4_rs_matmul(a, p, trans))}
        row["problems"].append({"N": N, "K": Kin, "tokens": M, "input_grad": trans, "queued_us": us,
                                "rs_vs_dense": us["rs"] / us["dense"], "host_us_a_call": host,
                                "do_bench_us": bench, "do_bench_rs_vs_dense": bench["rs"] / bench["dense"]})
        print(mode, f"{'input grad' if trans else 'forward'} N{N} K{Kin} M{M}: dense {us['dense']:.1f} us,"
              f" rs {us['rs'] / us['dense']:.3f}x (do_bench {bench['rs'] / bench['dense']:.3f}x;"
              f" host {host['rs']:.0f} us a call)", file=sys.stderr, flush=True)
    return row


# which barriers each run's PTX goes without; runs alternate, the first and the two alone last
RUNS = [(), ("waits", "arrives"), (), ("waits", "arrives"), ("waits",), ("arrives",)]
EDITS = {"waits": WAIT, "arrives": ARRIVE}


def edit(dump, work):
    """Every dumped PTX of the kernel, without the barriers each run of RUNS leaves out, into an
    override folder of that run under work -> the barriers taken out and left, by run and kernel."""
    edits = {}
    for cut in {r for r in RUNS if r}:
        override = os.path.join(work, "-".join(cut))
        for h in os.listdir(dump):
            for f in os.listdir(os.path.join(dump, h)):
                if f.startswith("_nf4_rs_kernel") and f.endswith(".ptx"):
                    ptx = open(os.path.join(dump, h, f)).read()
                    counts = {}
                    for name in cut:
                        ptx, counts[name] = EDITS[name].subn(r"\1", ptx)
                    os.makedirs(os.path.join(override, h), exist_ok=True)
                    open(os.path.join(override, h, f), "w").write(ptx)
                    edits[f"{'-'.join(cut)} {h}"] = dict(counts, left=ptx.count("bar.sync"))
    return edits


def main():
    if sys.argv[1] == "--run":
        print(json.dumps(run(sys.argv[2])))
        return
    here = os.path.dirname(os.path.abspath(__file__))
    work = tempfile.mkdtemp()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    # the PTX of every specialization the runs compile, dumped, then edited into an override folder a run
    dump = os.path.join(work, "dump")
    done = subprocess.run([sys.executable, __file__, "--run", "dump"], capture_output=True, text=True,
                          env=dict(env, TRITON_KERNEL_DUMP="1", TRITON_DUMP_DIR=dump, TRITON_CACHE_DIR=os.path.join(work, "c")))
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    edits = edit(dump, work)
    print("edits", edits, file=sys.stderr, flush=True)
    rows = []
    for i, cut in enumerate(RUNS):
        extra = dict(TRITON_KERNEL_OVERRIDE="1", TRITON_OVERRIDE_DIR=os.path.join(work, "-".join(cut))) if cut else {}
        done = subprocess.run([sys.executable, __file__, "--run", "-".join(cut) or "plain"], text=True,
                              capture_output=True, env=dict(env, TRITON_CACHE_DIR=os.path.join(work, f"c{i}"), **extra))
        sys.stderr.write(done.stderr[-2500:])
        if done.returncode:
            rows.append({"without": cut, "error": done.stderr[-1500:]})
            continue
        rows.append(dict(json.loads(done.stdout.splitlines()[-1]), overridden="Overriding kernel" in done.stdout))
    with open(sys.argv[1], "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "edits": edits, "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()

"""Which part of a throughput run differs between processes that train other bits: one process
(`--run COMBO`) builds the run as `throughput.py` does and prints a digest of everything the first
update reads (the random base, its packed matrices, their device copies, the adapter, and the batch
and gradient's scale its graph read), whether that update's recorded graph gave other bits when
replayed a second time (`replay_bits.checking`: a process whose first replay, the graph's first
execution on fresh pool memory, differs from its second read something before it was written or
raced), a digest of every module's output in the eager pass that precedes each recording (in call
order; with --names the names of the CUDA kernels that pass runs too) and of every tensor that the
calls between them read and write there (`eager_calls`: the adapter's kernels, RoPE and cuDNN's
attention, `TRACED`), the RoPE tables' digests as made, at the end and as made again on the host
(`rope`, with the first elements where they differ from the host's, and how many values PyTorch's
threaded CPU cos and sin get wrong at that point), the cuDNN frontend's log of the SDPA
implementation and plans it chose (`cudnn_log`, `cudnn_plans.plan_lines`), the update's loss, and
the device copies' digests again;
the driver runs PROCESSES of them (PARALLEL at once) and records the first process's digests, each
process's losses and what differs from the first process of its fill, and the whole record of each
process that differs. The digests of the batch, the module outputs and the traced calls' tensors
add no wait for the GPU before the update (the second replay's comparison does). LAYERS builds the
model's first layers only: a lighter process, the same kernels.

FILLS (cycled over the processes) say what a process's new tensors hold: `none` whatever their
memory held, `nan` PyTorch's own fill of every `torch.empty` (NaN, or an integer type's largest
value; the library's policy turns it off), so that a kernel that reads memory it never wrote
gives other bits, or NaN, in those processes (`nan_filled`: a new tensor read back there).

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python benchmarks/first_update_bits.py OUT.json [--combo COMBO]
        [--layers L (all)] [--processes N (8)] [--parallel P (1)] [--updates U (1)] [--fills none nan ...]
        [--names]
"""
import argparse
import json
import sys

import torch

import cudnn_plans
import replay_bits
import rope_bits
import throughput
from aner.kernels import cudnn_attention, layer, lora
from aner.model import llama
from aner.train.graphs import Graphed

# the calls between the modules whose every tensor is digested in the eager passes: the adapter's
# kernels (u = x A^T as BF16 parts, each output's delta added to its base's), RoPE and cuDNN's attention
TRACED = ((lora, "project"), (lora, "expand"), (layer, "_rope_launch"), (cudnn_attention, "_run"))


def digest(t: torch.Tensor) -> int:
    """A position-weighted sum of t's bytes as 32-bit words, wrapping in int64: exact, so the same
    bytes give the same number in any summation order, and a moved or changed word another."""
    return int(queued_digest(t))


def queued_digest(t: torch.Tensor) -> torch.Tensor:
    """`digest` as a tensor on t's device, computed in t's stream's order without waiting for it."""
    b = t.detach().contiguous().view(-1).view(torch.uint8)
    b = torch.cat([b, b.new_zeros(-b.numel() % 4)]).view(torch.int32).to(torch.int64)
    return (b * (torch.arange(b.numel(), device=b.device) % 65521 + 1)).sum()


def tensors(value) -> dict:
    """name -> digest of every tensor field of a packed weight or device copy (or of a tensor)."""
    if isinstance(value, torch.Tensor):
        return {"": digest(value)}
    return {k: digest(v) for k, v in vars(value).items() if isinstance(v, torch.Tensor)}


def nan_fill_kept():
    """PyTorch's NaN fill of new tensors, kept on where the library's CUDA policy turns it off."""
    import aner.train.device as policy
    require = policy.require_cuda

    def require_cuda(device):
        require(device)
        torch.utils.deterministic.fill_uninitialized_memory = True
    policy.require_cuda = require_cuda


def kernels_named(kernels: list):
    """Graphed._record appending to `kernels` the name of every CUDA kernel its eager warm-up pass
    runs, in order (cuBLAS's and cuDNN's choices among them); the recording itself is not profiled."""
    record = Graphed._record

    def _record(self, inputs, targets, rows, scale):
        fn = self.fn

        def profiled(*args):
            if torch.cuda.is_current_stream_capturing():
                return fn(*args)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                result = fn(*args)
                torch.cuda.synchronize()
            ran = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            kernels.extend(e.name for e in sorted(ran, key=lambda e: e.time_range.start))
            return result
        self.fn = profiled
        try:
            return record(self, inputs, targets, rows, scale)
        finally:
            self.fn = fn
    return _record


def named_tensors(value, name: str = ""):
    """(name, tensor) for every tensor in nested dicts, tuples and lists, named by their keys and
    positions joined by dots."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (dict, tuple, list)):
        for k, v in (value.items() if isinstance(value, dict) else enumerate(value)):
            yield from named_tensors(v, f"{name}.{k}" if name else str(k))


def traced(module, name: str, calls: list):
    """module.name appending to `calls`, outside CUDA graph captures, its name and the queued digest
    of every tensor among its arguments (read after it ran: those it writes are its outputs) and
    result; returns the function it replaced."""
    fn = getattr(module, name)

    def call(*args, **kwargs):
        result = fn(*args, **kwargs)
        if not torch.cuda.is_current_stream_capturing():
            what = " ".join([name] + [a for a in args if isinstance(a, str)])     # cuDNN's op
            named = named_tensors(dict(enumerate(args)) | kwargs | {"result": result})
            calls.append((what, {n: queued_digest(t) for n, t in named}))
        return result
    setattr(module, name, call)
    return fn


def rope_kept(made: list):
    """llama.rope_tables appending to `made`, for each (cos, sin) it makes on a device: those
    tensors, the queued digests of their bits as made, the same tables made again on the host, and
    their values by PyTorch's threaded CPU cos and sin (`rope_bits.threaded`, as the tables were
    made before), at the same point of the process; returns the function it replaced."""
    tables = llama.rope_tables

    def rope_tables(config, T, device):
        cos, sin = tables(config, T, device)
        made.append(((cos, sin), (queued_digest(cos), queued_digest(sin)), tables(config, T, "cpu"),
                     rope_bits.threaded(config, T)))
        return cos, sin
    llama.rope_tables = rope_tables
    return tables


def rope_record(made: list) -> list:
    """For each table `rope_kept` saw: its digests as made, now, and made again on the host, the
    first 16 elements where it now differs from the host's (name, row, column, its value, the host's)
    and the number of cos and sin values where PyTorch's threaded ones differ from the host's."""
    out = []
    for device, queued, host, threaded in made:
        now = [t.cpu() for t in device]
        unequal = [[name, *map(int, at), float.hex(a[tuple(at)].item()), float.hex(b[tuple(at)].item())]
                   for name, a, b in zip(("cos", "sin"), now, host) for at in (a != b).nonzero()]
        out.append({"made": [int(d) for d in queued], "now": [digest(t) for t in now],
                    "host": [digest(t) for t in host], "unequal": unequal[:16],
                    "threaded_unequal": [int((t != w).sum()) for t, w in zip(threaded, rope_bits.values(*host))]})
    return out


def one(combo: str, fill: str, updates: int, names: bool = False, layers: int = 0) -> dict:
    out = {"fill": fill}
    if fill == "nan":
        nan_fill_kept()
    model, method, choices = throughput.parse(combo)
    base = throughput.random_model(model, layers)
    if fill == "nan":
        out["nan_filled"] = bool(torch.isnan(torch.empty(4, device="cuda")).all())
    out["base"] = {n: digest(w) for n, w in base._weights.items()}
    tr, va = throughput.data(base.config().vocab_size)
    src = throughput.select(base, method, choices)
    del base
    out["packed"] = {n: tensors(w) for n, w in src._weights.items()}
    out["device_copies"] = {n: tensors(p) for n, p in src._device_copies.items()}
    out["adapter"] = {n: digest(t) for n, t in src._adapter_tensors.items()}
    state, _ = src._fine_tune_start(tr, va, updates, throughput.BATCH, 1, 1e-4, 0, 1.0)
    found, replay, record, eager, kernels, graphed = [], Graphed.__call__, Graphed._record, [], [], []
    checked = replay_bits.checking(1, found)                # each update's graph replayed once more

    def call(self, inputs, targets, rows, scale):
        graphed[:] = [self]
        return checked(self, inputs, targets, rows, scale)
    Graphed.__call__ = call
    if names:
        Graphed._record = kernels_named(kernels)
    # module outputs digested in the stream's order, read once training is done (not the capture's)
    hook = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: None if torch.cuda.is_current_stream_capturing() else eager.append(
            (type(module).__name__, queued_digest(output) if isinstance(output, torch.Tensor) else None)))
    calls, made = [], []
    replaced = [traced(module, name, calls) for module, name in TRACED]
    tables = rope_kept(made)
    try:
        m = src._train(tr, va, state, updates, progress=False)
    finally:
        Graphed.__call__, Graphed._record, llama.rope_tables = replay, record, tables
        for (module, name), fn in zip(TRACED, replaced):
            setattr(module, name, fn)
        hook.remove()
    # the tables and calls first: the driver's line names the first that differ, in call order
    out["rope"] = rope_record(made)
    out["eager_calls"] = {f"{i} {what}": {n: int(d) for n, d in ds.items()} for i, (what, ds) in enumerate(calls)}
    out["eager_module_outputs"] = {str(i): name if d is None else f"{name} {int(d)}"
                                   for i, (name, d) in enumerate(eager)}
    out["cudnn_log"] = cudnn_plans.plan_lines()
    if names:
        out["eager_kernels"] = {str(i): k for i, k in enumerate(kernels)}
    # each recorded shape's graph inputs as its last replay read them: the batch and the gradient's
    # scale (none in an eager run)
    out["graph_inputs"] = {str(key): [digest(t) for t in rec[:3]] for g in graphed for key, rec in g.recorded.items()}
    out["second_replay_differed"] = found
    out["losses"] = list(m._state.losses)
    out["validation_loss"] = m._state.validation_loss
    out["device_copies_after"] = {n: tensors(p) for n, p in src._device_copies.items()}
    return out


def differences(a, b, where=""):
    """The keys (joined by '/') under which two nested records differ."""
    if isinstance(a, dict):
        return [d for k in a for d in differences(a[k], (b or {}).get(k), f"{where}/{k}")]
    return [] if a == b else [where]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--combo", default="llama-3.2-1b:qlora:cudnn:fused")
    ap.add_argument("--layers", type=int, default=0, help="the model's first LAYERS layers only (0: all)")
    ap.add_argument("--processes", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=1, help="processes at once")
    ap.add_argument("--updates", type=int, default=1)
    ap.add_argument("--fills", nargs="+", default=["none"], choices=["none", "nan"])
    ap.add_argument("--names", action="store_true", help="record the eager pass's kernel names too")
    ap.add_argument("--run", action="store_true", help="one process: print its record")
    a = ap.parse_args()
    if a.run:
        print(json.dumps(one(a.combo, a.fills[0], a.updates, a.names, a.layers)))
        return
    record = {"combo": a.combo, "layers": a.layers, "updates": a.updates, "first": None, "processes": [],
              "differing": {}}            # process number -> its whole record, where it differs
    firsts = {}     # fill -> its first process, which the others of it meet

    def args(i):    # the fills cycle over the processes
        return [__file__, "-", "--run", "--combo", a.combo, "--fills", a.fills[i % len(a.fills)],
                "--updates", str(a.updates), "--layers", str(a.layers)] + ["--names"] * a.names
    for i, code, out, err in cudnn_plans.children(args, a.processes, a.parallel):
        if code:
            sys.exit(err[-3000:])
        run = json.loads(out.splitlines()[-1])
        fill = run["fill"]
        record["first"] = record["first"] or run
        diff = differences(firsts.setdefault(fill, run), run)
        record["processes"].append({k: run.get(k) for k in ("fill", "nan_filled", "losses", "validation_loss")}
                                   | {"differ": diff})
        if diff:
            record["differing"][i + 1] = run
        print(f"process {i + 1} (fill {fill}): losses {run['losses']!r}, {len(diff)} digests differ from the first "
              f"process of its fill{': ' + ', '.join(diff[:20]) if diff else ''}", flush=True)
        with open(a.out, "w") as f:           # after each process: a cut call keeps what ran
            json.dump(record, f)


if __name__ == "__main__":
    main()

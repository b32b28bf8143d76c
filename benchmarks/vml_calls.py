"""Which of MKL's vector math functions (VML: vmsExp, vmdCos, ...) the library's CPU path calls, and
on how many values: PyTorch sends contiguous float unary ops (cos, sin, exp, log, sqrt, tanh, ...)
to VML, whose first call of a function on several threads at once can run one thread's part with a
low-accuracy kernel (MKL 2024.2, the one PyTorch 2.13 bundles; PyTorch issue 188792). A call on a
single chunk runs on one thread and is safe. The driver runs this file's workload under gdb with a
breakpoint on every VML function libtorch_cpu exports, and counts the calls of each stage: import,
dequantization, NF4 packing, training by every method, checkpoint and resume, merge, q4_0,
adapter exports, on the embedded SmolLM2 at context 64.

    python benchmarks/vml_calls.py OUT.json          (needs gdb)
"""
import collections
import json
import os
import subprocess
import sys
import tempfile

import torch


def workload():
    from aner import gen
    from aner.embedded import ensure_default_model
    d = tempfile.mkdtemp()

    def stage(name):
        print(f"STAGE {name}", flush=True)
    stage("dequantize")
    gen.dequantize_model(ensure_default_model(), f"{d}/f16.gguf", dtype="f16")
    stage("import")
    base = gen.import_model(f"{d}/f16.gguf", device="cpu")
    stage("import_nf4")
    gen.import_nf4(f"{d}/f16.gguf", double_quant=True)
    stage("data")
    tr, va = (gen.supervised_csv(base, f"examples/data/{r}.csv", input="question", target="answer", role=r,
                                 context=64) for r in ("training", "validation"))
    for name in ("full", "rs_lora", "lora_fa", "tinylora", "qlora", "lora"):
        stage(f"train {name}")
        src = base if name == "full" else getattr(base, name)()
        lora = src.fine_tune(tr, va, steps=2, micro_batch=2, accumulation=1)     # the last: LoRA
    stage("checkpoint and resume")
    lora.checkpoint(f"{d}/ck")
    resumed = gen.load_pretrained_checkpoint(f"{d}/ck", device="cpu").resume(tr, va, steps=1)
    stage("merge")
    resumed.save_model(f"{d}/m.gguf")
    stage("q4_0")
    gen.quantize_model(f"{d}/m.gguf", f"{d}/q4.gguf", format="q4_0")
    stage("adapter exports")
    resumed.save_adapter(f"{d}/adapter")
    resumed.save_peft_adapter(f"{d}/peft")
    stage("end")


def main():
    if sys.argv[1:] == ["--workload"]:
        workload()
        return
    out = sys.argv[1]
    lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    symbols = [line.split() for line in subprocess.run(["nm", "-D", lib], capture_output=True, text=True,
                                                        check=True).stdout.splitlines()]
    names = sorted({s[2] for s in symbols if len(s) == 3 and s[1] == "T" and s[2][:3] in ("vms", "vmd")})
    script = ["set pagination off", "set breakpoint pending on", "set print thread-events off"]
    for n in names:      # each hit prints the function and the count of values (its first argument)
        script += [f"break {n}", "commands", "silent", f'printf "VML {n} %d\\n", (int) $rdi', "continue", "end"]
    script += ["run", "quit"]
    with tempfile.NamedTemporaryFile("w", suffix=".gdb", delete=False) as f:
        f.write("\n".join(script) + "\n")
    run = subprocess.run(["gdb", "-q", "-batch", "-x", f.name, "--args", sys.executable, __file__, "--workload"],
                         capture_output=True, text=True)
    stages, stage = {}, "start"
    for line in run.stdout.splitlines():
        if line.startswith("STAGE "):
            stage = line[6:]
            stages[stage] = collections.Counter()
        elif line.startswith("VML "):
            _, fn, n = line.split()
            stages.setdefault(stage, collections.Counter())[f"{fn} of {n}"] += 1
    record = {"torch": torch.__version__, "functions": len(names), "gdb_exit": run.returncode,
              "calls": {s: dict(c) for s, c in stages.items()}}
    with open(out, "w") as f:
        json.dump(record, f, indent=1)
    for s, c in stages.items():
        print(f"{s}: {dict(c) or 'none'}")
    if run.returncode or "end" not in stages:
        sys.exit(run.stdout[-2000:] + run.stderr[-2000:])


if __name__ == "__main__":
    main()

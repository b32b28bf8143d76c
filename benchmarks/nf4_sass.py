"""What one K step of a fused NF4 kernel issues, without a GPU: compile for sm_90a, count SASS.

    PYTHONPATH=src python3 benchmarks/nf4_sass.py [M N K]      (default 8192 2048 2048, BF16)
    PYTHONPATH=src python3 benchmarks/nf4_sass.py --ws         (the warp-specialized kernels)
    PYTHONPATH=src python3 benchmarks/nf4_sass.py --rs         (the forward with the register operand)

Needs Triton (its wheel carries ptxas and cuobjdump), not a GPU. For the default configuration
of both kernels at that shape and a few alternatives (BF16, then FP32 operands with and without
the tensor cores) it prints registers, stack (spills) and the instructions of the main loop (the
longest backward branch around an HGMMA) by opcode.
The loop's length times the warps over the 4 schedulers of a multiprocessor, against the
tensor-core cycles of bm x bn x bk MACs (~2048 BF16 MACs a cycle on an H100/H200 SM), says
whether a variant is decode-bound before any GPU time is spent. With --ws: the warp-specialized
kernels (`aner.kernels.nf4_ws`, defaults), their partitions' register counts (setmaxnreg) and
the loops of the decode partitions (around the shared-memory stores) and of the MMA partition.
"""
import collections
import dataclasses
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aner.kernels import nf4 as K

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def compile_kernel(op: str, cfg: K.TileConfig, M: int, N: int, Kin: int, dtype="bf16", double_quant=True):
    """The cubin the launcher would build for (op, cfg, shape), specialized the same way."""
    kernel = K._nf4_matmul_kernel if op == "matmul" else K._nf4_matmul_t_kernel
    reduced, tile = (Kin, cfg.bk) if op == "matmul" else (N, cfg.bn)
    steps = -(-reduced // tile)
    per = -(-steps // cfg.split)
    consts = dict(STEPS_PER_SPLIT=per, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
                  SPLIT=-(-steps // per), FAST=Kin % 64 == 0 and cfg.bk % 64 == 0, DQ=double_quant,
                  LUT=cfg.lut, SWAP=cfg.swap, TC=cfg.tc)
    pointers = {"x": dtype, "y": dtype, "g": dtype, "dx": dtype, "part": "fp32", "codes": "u8",
                "absmax": "u8" if double_quant else "fp32", "acodes": "u8",
                "ascales": "fp32" if double_quant else "u8", "aoffset": "fp32" if double_quant else "u8",
                "nf4cb": "fp32", "dyncb": "fp32"}
    ints = dict(M=M, N=N, K=Kin)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in pointers:
            signature[name] = "*" + pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]            # the launcher's 16-byte alignment
        elif name in ints:
            signature[name] = "i32"
            if ints[name] % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "constexpr"
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts, attrs=attrs)
    options = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]


def disassemble(cubin: bytes) -> tuple[str, str, list[list[str]], str]:
    """(registers, stack bytes, every loop's body from a backward branch's target to it, the SASS)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
    at = {int(a, 16): text for a, text in re.findall(r"/\*([0-9a-f]{4,5})\*/\s+([^;]*);", sass)}
    loops = []
    for addr, text in at.items():
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append([at[a] for a in sorted(at) if int(m.group(1), 16) <= a <= addr])
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return regs.group(1), regs.group(2), loops, sass


def opcodes(body: list[str], n: int) -> str:
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body)
    return f"{len(body)} instrs: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(n))


def loop_report(cubin: bytes) -> str:
    """Registers, stack and the main loop (the longest around an HGMMA) of a Triton NF4 kernel."""
    regs, stack, loops, _ = disassemble(cubin)
    loop = max((body for body in loops if any("HGMMA" in b for b in body)), key=len, default=[])
    return f"regs {regs} stack {stack} | loop {opcodes(loop, 10)}"


def gluon_compile(kernel, descs: dict, const: dict, options: dict, pointers: dict):
    """The cubin of a Gluon kernel for sm_90a, its arguments typed as the launcher would."""
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    names = kernel.arg_names
    signature = {**{k: mangle_type(d) for k, d in descs.items()}, **{k: "*" + v for k, v in pointers.items()},
                 **{k: "i32" for k in names if k not in descs and k not in pointers and k not in const},
                 **{k: "constexpr" for k in const}}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in pointers}
    src = GluonASTSource(kernel, signature, {(names.index(k),): v for k, v in const.items()}, attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def loops_and_head(kernel) -> tuple[list[list[str]], str]:
    """(every loop of its SASS, the report's head: registers, stack, shared memory, the partitions'
    setmaxnreg)."""
    regs, stack, loops, sass = disassemble(kernel.asm["cubin"])
    part = sorted({int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)", sass)})
    return loops, f"regs {regs} stack {stack}, shared {kernel.metadata.shared} B, setmaxnreg {part}"


POINTERS = {"absmax": "fp32", "acodes": "u8", "ascales": "fp32", "aoffset": "fp32", "dyncb": "fp32"}


def ws_report(trans: bool, M=2048, N=4096, Kin=4096) -> str:
    """The same for the warp-specialized kernel at its defaults: its partitions' registers, and the
    innermost loop of the decode partitions (shared-memory stores) and of the MMA partition."""
    from aner.kernels import nf4_ws as W

    a = torch.empty(M, N if trans else Kin, dtype=torch.bfloat16)
    a_desc, c_desc, const, options = W.specialization(a, torch.empty(N, Kin // 64, 8, dtype=torch.int32), trans)
    const = dict(const, DQ=True, num_warps=options["num_warps"])
    kernel = gluon_compile(W._nf4_ws_kernel, {"a_desc": a_desc, "c_desc": c_desc}, const, options,
                           {"out": "bf16", **POINTERS})
    loops, head = loops_and_head(kernel)
    out = [head]
    for kind, has, lacks in (("decode", "STS.128", "HGMMA"), ("mma", "HGMMA", "STS.128")):
        inner = [body for body in loops if any(has in b for b in body) and not any(lacks in b for b in body)]
        if inner:
            out.append(f"{kind} loop {opcodes(min(inner, key=len), 8)}")
    return " | ".join(out)


def operand_writes(sass: str) -> list[str]:
    """The instructions, in address order, that write a register an issued HGMMA reads as its
    first operand before a WARPGROUP.DEPBAR has seen that MMA finish (a group ends at the HGMMA
    marked gsb0; DEPBAR.LE gsb0, n leaves the newest n). Branches are read as straight code: the
    groups of a kernel whose waits all come before its branches are checked exactly."""
    pending, group, found = [], set(), []
    for text in re.findall(r"/\*[0-9a-f]{4,5}\*/\s+([^;]*);", sass):
        op, _, rest = re.sub(r"^@!?U?P\w+\s+", "", text.strip()).partition(" ")
        args = [a.strip() for a in rest.split(",")]
        if op.startswith("HGMMA"):
            if re.fullmatch(r"R\d+", args[1]):
                group |= {int(args[1][1:]) + i for i in range(4)}
            if "gsb0" in rest:
                pending, group = pending + [group], set()
        elif op.startswith("WARPGROUP.DEPBAR"):
            pending = pending[len(pending) - int(args[-1], 16):] if int(args[-1], 16) else []
        elif not re.match(r"(ST|RED|BRA|BAR|SYNCS|WARPGROUP|NOP|EXIT|RET|CALL|FENCE|MEMBAR|DEPBAR|U)", op):
            dst = next((a for a in args[:2] if re.fullmatch(r"R\d+", a)), None)
            width = 4 if ".128" in op else 2 if ".64" in op or ".WIDE" in op else 1
            if dst and {int(dst[1:]) + i for i in range(width)} & set().union(*pending):
                found.append(text.strip())
    return found


def rs_report(trans=False, M=2048, N=4096, Kin=4096) -> str:
    """The same for the forward with the weight as the MMA's register operand (`trans`: the input
    gradient through the transposed copy): the registers, the instructions from each MMA of a
    warpgroup's group of steps to the next (one WARPGROUP.ARRIVE to the next: a step's decode), and
    the writes into the operand registers of a MMA that may still be running (none is allowed)."""
    from aner.kernels import nf4_rs as R

    rows, red = (Kin, N) if trans else (N, Kin)
    x_desc, c_desc, a_desc, o_desc, const, options = R.specialization(
        torch.empty(M, red, dtype=torch.bfloat16), torch.empty(rows, red // 8, dtype=torch.int32),
        torch.empty(M, rows, dtype=torch.bfloat16), torch.empty(Kin // 64, N, dtype=torch.float32), trans)
    descs = {"x_desc": x_desc, "c_desc": c_desc, "a_desc": a_desc, "o_desc": o_desc}
    kernel = gluon_compile(R._nf4_rs_kernel, descs, const, options, {"nf4cb": "fp32"})
    loops, head = loops_and_head(kernel)
    sass = disassemble(kernel.asm["cubin"])[3]
    at = [int(a, 16) for a in re.findall(r"/\*([0-9a-f]{4,5})\*/\s+WARPGROUP\.ARRIVE", sass)]
    group = at[1:const["U"] + 1]          # the first ARRIVE is the code of the steps short of a group
    steps = [(b - a) // 16 for a, b in zip(group, group[1:])]
    return (f"{head} | instructions from a MMA to the next in a group {steps}"
            f" | operand registers written early: {operand_writes(sass)}")


def main():
    if sys.argv[1:] == ["--ws"]:
        for trans in (False, True):
            print("input grad" if trans else "forward", ws_report(trans), flush=True)
        return
    if sys.argv[1:] == ["--rs"]:
        for trans in (False, True):
            print("input grad" if trans else "forward", "register operand", rs_report(trans), flush=True)
        return
    M, N, Kin = map(int, sys.argv[1:4]) if len(sys.argv) > 3 else (8192, 2048, 2048)
    for op in ("matmul", "matmul_t"):
        default = K.default_config(op, M, N, Kin, torch.bfloat16)
        for name, cfg in (("default", default), ("select tree", dataclasses.replace(default, lut=1)),
                          ("operand B", dataclasses.replace(default, swap=False))):
            w = cfg.bn * cfg.bk // (32 * cfg.num_warps)
            print(f"{op:8} {name:12} {cfg.bm}x{cfg.bn}x{cfg.bk} w{cfg.num_warps} s{cfg.num_stages}: "
                  f"{w} weight elements a thread a step | {loop_report(compile_kernel(op, cfg, M, N, Kin))}",
                  flush=True)
        default = K.default_config(op, M, N, Kin, torch.float32)
        for name, cfg in (("FP32", default), ("FP32 FMA", dataclasses.replace(default, tc=False))):
            print(f"{op:8} {name:12} {cfg.bm}x{cfg.bn}x{cfg.bk} w{cfg.num_warps} s{cfg.num_stages}: "
                  f"{loop_report(compile_kernel(op, cfg, M, N, Kin, dtype='fp32'))}", flush=True)


if __name__ == "__main__":
    main()

"""What one K step of a fused NF4 kernel issues, without a GPU: compile for sm_90a, count SASS.

    PYTHONPATH=src python3 benchmarks/nf4_sass.py [M N K]      (default 8192 2048 2048, BF16)
    PYTHONPATH=src python3 benchmarks/nf4_sass.py --ws         (the warp-specialized kernels)

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


def loop_report(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
    at = {int(a, 16): text for a, text in re.findall(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)}
    loop = []
    for addr, text in at.items():
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [at[a] for a in sorted(at) if int(m.group(1), 16) <= a <= addr]
            if any("HGMMA" in b for b in body) and len(body) > len(loop):
                loop = body
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in loop)
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return (f"regs {regs.group(1)} stack {regs.group(2)} | loop {len(loop)} instrs: "
            + ", ".join(f"{k} {v}" for k, v in ops.most_common(10)))


def ws_report(trans: bool, M=2048, N=4096, Kin=4096) -> str:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    from aner.kernels import nf4_ws as W

    bm, dw, dregs, stages = 256, 4, 72, (4, 4, 8)       # nf4_ws_matmul's defaults
    a = torch.empty(M, N if trans else Kin, dtype=torch.bfloat16)
    a_desc = TensorDescriptor.from_tensor(a, [bm, W.STEP],
                                          gl.NVMMASharedLayout.get_default_for([bm, W.STEP], gl.bfloat16))
    rows, grps = (W.STEP, W.BO // 64) if trans else (W.BO, 1)
    words = torch.empty(N, Kin // 64, 8, dtype=torch.int32)
    c_desc = TensorDescriptor.from_tensor(words, [rows, grps, 8],
                                          gl.NVMMASharedLayout.get_default_for([rows, grps, 8], gl.int32))
    names = W._nf4_ws_kernel.arg_names
    signature = {"a_desc": mangle_type(a_desc), "c_desc": mangle_type(c_desc), "out": "*bf16", "absmax": "*fp32",
                 "acodes": "*u8", "ascales": "*fp32", "aoffset": "*fp32", "dyncb": "*fp32",
                 "M": "i32", "N": "i32", "K": "i32", "O": "i32", "steps": "i32"}
    const = dict(W_LAYOUT=gl.NVMMASharedLayout.get_default_for([rows, grps * 64], gl.bfloat16), W_ROWS=rows,
                 W_COLS=grps * 64, TRANS=trans, DQ=True, GROUP=W.GROUP_M, AS=stages[0], WS=stages[1],
                 CS=stages[2], DW=dw, DREGS=dregs, SKIP=False, num_warps=bm // 32)
    signature.update({k: "constexpr" for k in const})
    pointers = ("out", "absmax", "acodes", "ascales", "aoffset", "dyncb")
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k in pointers}
    src = GluonASTSource(W._nf4_ws_kernel, signature, {(names.index(k),): v for k, v in const.items()}, attrs)
    options = dict(num_warps=bm // 32, maxnreg=65536 // (32 * (bm // 32 + 2 * dw)) // 8 * 8, enable_fp_fusion=False)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True,
                               text=True).stdout.strip().splitlines()[-1]
    at = {int(a, 16): text for a, text in re.findall(r"/\*([0-9a-f]{4,5})\*/\s+([^;]*);", sass)}
    loops = {}
    for addr, text in at.items():                       # the innermost loop around each kind of work
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [at[b] for b in sorted(at) if int(m.group(1), 16) <= b <= addr]
            stores, mmas = any("STS.128" in b for b in body), any("HGMMA" in b for b in body)
            kind = "decode" if stores and not mmas else "mma" if mmas and not stores else None
            if kind and (kind not in loops or len(body) < len(loops[kind])):
                loops[kind] = body
    regs = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    part = sorted({int(v, 16) for v in re.findall(r"USETMAXREG\.\w+\.CTAPOOL (?:UP0, )?(0x[0-9a-f]+)", sass)})
    out = [f"regs {regs.group(1)} stack {regs.group(2)}, shared {kernel.metadata.shared} B, setmaxnreg {part}"]
    for kind, body in sorted(loops.items()):
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0] for b in body)
        out.append(f"{kind} loop {len(body)} instrs: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(8)))
    return " | ".join(out)


def main():
    if sys.argv[1:] == ["--ws"]:
        for trans in (False, True):
            print("input grad" if trans else "forward", ws_report(trans), flush=True)
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

"""FP32-accurate matrix products on the BF16 tensor cores, shared by the kernels whose policy
wants FP32 products (adapter contractions, FP32 operands of the fused NF4 kernels). No TF32."""
import triton
import triton.language as tl

from .launch import INTERPRETED


@triton.jit
def scaled(w, scale):
    """w * scale in FP32, rounded on its own (never fused with an operation after it, e.g. the
    subtraction that splits it into parts) and without flushing subnormals (libdevice's `mul_rn`
    compiles to mul.rn.ftz here): the bits of torch's product of an FP32 tensor and that float."""
    if INTERPRETED:       # no PTX there; numpy's product is rounded on its own anyway
        return w * scale
    else:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [w, scale], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def bf16_parts(x):
    """FP32 x -> BF16 (hi, mid, lo) with hi + mid + lo == x: each part rounds what is left."""
    hi = x.to(tl.bfloat16)
    rest = x - hi.to(tl.float32)                    # exact
    mid = rest.to(tl.bfloat16)
    lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def fp32_dot(a, b, acc, A_BF16: tl.constexpr, TC: tl.constexpr):
    """acc + a (X, Y) @ b (Y, Z) to FP32 accuracy; b holds FP32 values, a FP32/FP16 values, or
    BF16 values when A_BF16.

    TC 0: FP32 fused multiply-adds (tl.dot "ieee"). TC 1: on the BF16 tensor cores, through b's
    parts (`parts_dot`).
    """
    if TC:
        b_hi, b_mid, b_lo = bf16_parts(b)
        return parts_dot(a, b_hi, b_mid, b_lo, acc, A_BF16)
    else:
        return tl.dot(a.to(tl.float32), b, acc, input_precision="ieee", out_dtype=tl.float32)


@triton.jit
def parts_dot(a, b_hi, b_mid, b_lo, acc, A_BF16: tl.constexpr):
    """acc + a @ (b_hi + b_mid + b_lo) on the BF16 tensor cores, for b given by its exact BF16
    parts (`bf16_parts`) and a as in `fp32_dot`. a is split the same way unless it is BF16; a
    product of two BF16 parts is exact in FP32, and the tensor cores sum them in FP32. The six
    products of weight >= 2^-16 of the leading one are summed, smallest first (three when a is
    BF16: every product); the three left out are below 2^-24 of it, FP32's own rounding. Several
    times the FMA throughput, and no TF32 anywhere."""
    if A_BF16:
        acc = tl.dot(a, b_lo, acc, out_dtype=tl.float32)
        acc = tl.dot(a, b_mid, acc, out_dtype=tl.float32)
        return tl.dot(a, b_hi, acc, out_dtype=tl.float32)
    else:
        a_hi, a_mid, a_lo = bf16_parts(a.to(tl.float32))
        return six_dot(a_hi, a_mid, a_lo, b_hi, b_mid, b_lo, acc)


@triton.jit
def six_dot(a_hi, a_mid, a_lo, b_hi, b_mid, b_lo, acc):
    """acc + a @ b for both operands given by their BF16 parts: the six products of `parts_dot`,
    smallest first."""
    acc = tl.dot(a_lo, b_hi, acc, out_dtype=tl.float32)
    acc = tl.dot(a_mid, b_mid, acc, out_dtype=tl.float32)
    acc = tl.dot(a_hi, b_lo, acc, out_dtype=tl.float32)
    acc = tl.dot(a_mid, b_hi, acc, out_dtype=tl.float32)
    acc = tl.dot(a_hi, b_mid, acc, out_dtype=tl.float32)
    return tl.dot(a_hi, b_hi, acc, out_dtype=tl.float32)

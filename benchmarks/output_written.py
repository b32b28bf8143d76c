"""Whether the register-operand NF4 product writes every element of its output, and what
compute-sanitizer's initcheck makes of memory written by TMA stores.

    python benchmarks/output_written.py                       (GPU machine: the NaN block)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool initcheck python benchmarks/output_written.py

Under the caching allocator the product's output is allocated in a block just filled with NaN and
freed: NaN left in it is an element the kernel never wrote. Without the caching allocator (every
tensor an allocation of its own, as initcheck tracks them) it reads the product's output and a
cuBLAS product's back: the sanitizer reports the reads of the first, written by TMA stores, as
reads of uninitialized memory, where the NaN block shows every element written.
"""
import os
import sys

import torch

sys.path[:0] = ["benchmarks"]
import nf4_ws  # noqa: E402  (benchmarks/nf4_ws.py: the weights)
from aner.kernels import nf4_rs  # noqa: E402

p, _ = nf4_ws.packed(2048, 2048)
x = torch.randn(1024, 2048, device="cuda").bfloat16()
cached = not os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")
if cached:
    block = torch.full((1024, 2048), float("nan"), device="cuda", dtype=torch.bfloat16)
    at = block.data_ptr()
    del block
y = nf4_rs.nf4_rs_matmul(x, p)
if cached:
    print("nf4_rs output in the NaN block:", y.data_ptr() == at, "NaN left:", torch.isnan(y).sum().item())
print("nf4_rs output sum", y.float().sum().item(), flush=True)
w = torch.randn(2048, 2048, device="cuda").bfloat16()
print("cuBLAS output sum", (x @ w.t()).float().sum().item(), flush=True)

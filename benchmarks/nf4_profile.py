"""One launch each, compiled and warmed first, of dense cuBLAS, the register-operand NF4 forward
(its default, its steps one at a time, and both without the decode), the warp-specialized one,
then the input gradient (dense, the register-operand kernel through the transposed copy, without
its decode), 4096 x 4096 at 2048 tokens (or N K M from the command line), for Nsight Compute to
profile (the profiler started around these nine launches only; `gpu_run.sh ncu`):

    ncu --clock-control none --profile-from-start off --set full -o rep python benchmarks/nf4_profile.py
"""
import sys

import torch

from aner.kernels.nf4_rs import nf4_rs_matmul
from aner.kernels.nf4_ws import nf4_ws_matmul

import nf4_ws           # benchmarks/nf4_ws.py: the weights

N, K, M = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 4096, 2048)
p, Wd = nf4_ws.packed(N, K)
wd = Wd.bfloat16()
x, g = torch.randn(M, K, device="cuda").bfloat16(), torch.randn(M, N, device="cuda").bfloat16()
launches = [lambda: x @ wd.t(), lambda: nf4_rs_matmul(x, p), lambda: nf4_rs_matmul(x, p, in_flight=1),
            lambda: nf4_rs_matmul(x, p, skip=True), lambda: nf4_rs_matmul(x, p, skip=True, in_flight=1),
            lambda: nf4_ws_matmul(x, p, False),
            lambda: g @ wd, lambda: nf4_rs_matmul(g, p, True), lambda: nf4_rs_matmul(g, p, True, skip=True)]
for f in launches * 20:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for f in launches:
    f()
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()

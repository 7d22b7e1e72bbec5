"""Launches of the register-fed skinny GEMM (kernels/gemm_mma.py) at M = 1 for Nsight Compute:
    ncu --kernel-name regex:_splitk_kernel --launch-skip 2 python benchmarks/ncu_mma.py [K N]"""
import sys

import torch

import nvfp4_inductor as nv
from nvfp4_inductor import tiled as tiled_layout
from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

k, n = (int(v) for v in sys.argv[1:3]) if len(sys.argv) > 2 else (4096, 14336)
q = nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
w = (*tiled_layout.tile(q.data, q.scale.view(torch.uint8)), q.global_scale)
x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
for _ in range(4):
    gemm_splitk(x, w[0], w[1], w[2], None, torch.bfloat16, False, tiled_n=n)
torch.cuda.synchronize()

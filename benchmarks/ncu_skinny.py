"""One launch each of the skinny kernel (default and 'bare' variants of probe_skinny.py) at M = 1 on
a 4096 x 14336 (K x N) tiled weight, for Nsight Compute:
    ncu --kernel-name regex:_splitk_kernel --launch-skip 2 python benchmarks/ncu_skinny.py"""
import torch
from probe_skinny import VARIANTS, variant_module

import nvfp4_inductor as nv
from nvfp4_inductor import tiled as tiled_layout
from nvfp4_inductor.kernels import gemm_splitk as gs

k, n = 4096, 14336
q = nv.quantize(torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
p = (*tiled_layout.tile(q.data, q.scale.view(torch.uint8)), q.global_scale)
x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
bare = variant_module("bare", VARIANTS["bare"])
for module in (gs, gs, gs, bare, bare, bare):
    module.gemm_splitk(x, *p, None, torch.bfloat16, False, tiled_n=n)
torch.cuda.synchronize()

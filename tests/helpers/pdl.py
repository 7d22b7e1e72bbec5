"""A programmatic-dependent-launch producer for the GPU tests: it releases the next kernel at once
and writes its output only ~0.5 ms later, so a kernel launched with PDL that read before waiting
would see the old contents."""

import triton
import triton.language as tl


@triton.jit
def _late_writer_kernel(src_ptr, dst_ptr, n, spins, BLOCK: tl.constexpr):
    """Lets the next kernel launch at once (PDL), then spins, then copies src to dst."""
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK], tl.float32)
    for _ in range(spins):
        acc = acc * 0.5 + 1.0
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs, mask=offs < n)
    tl.store(dst_ptr + offs, x + (acc * 0.0).to(x.dtype), mask=offs < n)


def late_copy(src, dst, spins: int = 200_000):
    """dst.copy_(src), contiguous tensors of one dtype, by a kernel that releases the next launch first."""
    assert src.dtype == dst.dtype and src.shape == dst.shape and src.is_contiguous() and dst.is_contiguous()
    src, dst = src.view(-1), dst.view(-1)
    _late_writer_kernel[(triton.cdiv(src.numel(), 1024),)](src, dst, src.numel(), spins, BLOCK=1024,
                                                            launch_pdl=True)

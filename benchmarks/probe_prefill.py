"""Prefill (large M) on the extern path: what the fp32 product + separate epilogue costs against
one cuBLAS call that applies the weight's global scale as alpha (a Python float: the scale of a
frozen weight is a compile-time constant) and the bias as beta * C, bf16 output, one rounding;
and against one cuBLASLt call that reads alpha from the device (kernels/cublaslt.py: no host
float needed, so eager calls and W4A4's dynamic scale can use it too).

    python benchmarks/probe_prefill.py
    python benchmarks/probe_prefill.py --no-bias   # a linear without bias: how cuBLAS gets alpha
"""
import torch
import triton
from bench_quantize import stream_us

import nvfp4_inductor as nv
from nvfp4_inductor import tiled
from nvfp4_inductor.kernels.dequantize import dequantize
from nvfp4_inductor.kernels.cublaslt import scaled_mm
from nvfp4_inductor.kernels.gemm import scaled_mm_tiled

SHAPES = [(4096, 4096), (4096, 14336), (14336, 4096), (8192, 28672)]  # (K, N)


def addmm_tiled(x2, w_data, w_scale, bias, n: int, alpha: float):
    """W tiled, dequantized (exact in bf16), then one cuBLAS addmm with alpha = the global scale as
    a host float (the backend's prefill extern until session 23, when it became scaled_mm_tiled:
    Inductor's FX graph cache does not key the inlined constant alpha came from)."""
    w = dequantize(w_data, w_scale, None, False, torch.bfloat16, tiled_nk=(n, x2.shape[1]))
    return torch.addmm(bias if bias is not None else x2.new_zeros(n), x2, w.T, alpha=alpha)


def main() -> None:
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    m = 4096
    print("| K | N | bf16 x @ W.T | dequantize | mm fp32 out | + epilogue | addmm alpha=g bf16 | rel err fp32 path "
          "| rel err addmm | tiled dequantize, generic kernel (fp16 out) | tiled, tile kernel (bf16) | addmm_tiled "
          "| Lt alpha on device | rel err Lt | same bits as addmm | Lt tiled (dequantize + Lt) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k, n in SHAPES:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        bias = torch.randn(n, dtype=torch.bfloat16, device="cuda")
        q = nv.quantize(w)
        wd = dequantize(q.data, q.scale.view(torch.uint8), None, False, torch.bfloat16)
        g_dev, g = q.global_scale, q.global_scale.item()
        ref = (x.double() @ (wd.double() * g).T + bias.double())

        def fp32_path(_):
            y = torch.mm(x, wd.T, out_dtype=torch.float32)
            return torch.addcmul(bias.float(), y, g_dev).to(torch.bfloat16)

        def addmm(_):
            return torch.addmm(bias, x, wd.T, alpha=g)

        def lt(_):
            return scaled_mm(x, wd, g_dev, bias, torch.bfloat16)

        errs = [((f(0).double() - ref).norm() / ref.norm()).item() for f in (fp32_path, addmm, lt)]
        same = torch.equal(lt(0), addmm(0))
        data_t, scale_t = tiled.tile(q.data, q.scale.view(torch.uint8))
        assert torch.equal(dequantize(data_t, scale_t, None, False, torch.bfloat16, tiled_nk=(n, k)), wd)
        assert torch.equal(addmm_tiled(x, data_t, scale_t, bias, n, g), addmm(0))
        t = {
            "bf16": stream_us(lambda _: x @ w.T, [0]),
            "deq": stream_us(lambda _: dequantize(q.data, q.scale.view(torch.uint8), None, False,
                                                   torch.bfloat16), [0]),
            "mm32": stream_us(lambda _: torch.mm(x, wd.T, out_dtype=torch.float32), [0]),
            "fp32_path": stream_us(fp32_path, [0]),
            "addmm": stream_us(addmm, [0]),
            "tiled_generic": stream_us(lambda _: dequantize(data_t, scale_t, None, False, torch.float16,
                                                            tiled_nk=(n, k)), [0]),
            "tiled_tiles": stream_us(lambda _: dequantize(data_t, scale_t, None, False, torch.bfloat16,
                                                          tiled_nk=(n, k)), [0]),
            "addmm_tiled": stream_us(lambda _: addmm_tiled(x, data_t, scale_t, bias, n, g), [0]),
            "lt": stream_us(lt, [0]),
            "lt_tiled": stream_us(lambda _: scaled_mm_tiled(x, data_t, scale_t, g_dev, bias, n,
                                                            torch.bfloat16), [0]),
        }
        print(f"| {k} | {n} | {t['bf16']:.1f} | {t['deq']:.1f} | {t['mm32']:.1f} | {t['fp32_path']:.1f} | "
              f"{t['addmm']:.1f} | {errs[0]:.2e} | {errs[1]:.2e} | {t['tiled_generic']:.1f} | "
              f"{t['tiled_tiles']:.1f} | {t['addmm_tiled']:.1f} | {t['lt']:.1f} | {errs[2]:.2e} | {same} | "
              f"{t['lt_tiled']:.1f} |", flush=True)


def no_bias() -> None:
    """A linear without bias (Llama's) on the dequantized weight: alpha = g through addmm with a
    zero bias (beta = 1: cuBLASLt's bias epilogue) or beta = 0 (a plain GEMM with alpha), against
    the bf16 GEMM; both must give the same bits (fp32 alpha * acc, one rounding)."""
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    m = 4096
    print("| K | N | bf16 x @ W.T | addmm zero bias | addmm beta=0 | same bits |")
    print("|---|---|---|---|---|---|")
    for k, n in SHAPES + [(4096, 6144)]:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        q = nv.quantize(w)
        wd = dequantize(q.data, q.scale.view(torch.uint8), None, False, torch.bfloat16)
        g = q.global_scale.item()
        zero = x.new_zeros(n)
        fns = (lambda _: x @ w.T, lambda _: torch.addmm(zero, x, wd.T, alpha=g),
               lambda _: torch.addmm(zero, x, wd.T, beta=0, alpha=g))
        same = torch.equal(fns[1](0), fns[2](0))
        t = [stream_us(fn, [0]) for fn in fns]
        print(f"| {k} | {n} | {t[0]:.1f} | {t[1]:.1f} | {t[2]:.1f} | {same} |", flush=True)


if __name__ == "__main__":
    import sys

    no_bias() if "--no-bias" in sys.argv else main()

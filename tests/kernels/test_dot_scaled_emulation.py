"""The sm_100 kernels (tl.dot_scaled, e2m1 x e2m1 with e4m3 scales) computed on the CPU.

The Triton interpreter has no tl.dot_scaled: triton 3.6's semantic layer (language/semantic.py,
TritonSemantic.dot_scaled) checks the operands and calls builder.create_dot_scaled, which the
interpreter's builder lacks. The stand-in below is that builder hook: it takes what semantic.py
hands the backend and computes what Triton 3.6 documents and tests for it, in Triton's own
conventions (not this package's), so the checks and shapes run as they do when compiling:

- e2m1 operands are uint8 with two codes a byte, "the first element in lower bits"
  (language/core.py:2080, 2086); k_pack (the default, core.py:2093-2096) packs lhs (M, K/2)
  along its axis 1 and rhs (K/2, N) along its axis 0 (semantic.py:1633-1646: K = 2 * K_LHS =
  2 * K_RHS). Unpacked and decoded with triton.tools.mxfp.MXFP4Tensor (unpack_packed_tensor:
  low nibble first, mxfp.py:215; .to(float32): sign bit 3, E2M1 values), as Triton's
  test_block_scale_fp4 (python/test/unit/language/test_matmul.py) builds its reference.
- Scales: float8e4nv means a group of 16 (semantic.py:1599, 1605), lhs_scale (M, K/16) and
  rhs_scale (N, K/16), rhs_scale not transposed (core.py:2081, 2087-2089); decoded as
  torch.float8_e4m3fn (test_block_scale_fp4's "nvfp4" reference).
- out = acc + (A * sa) @ (B * sb), fp32 (core.py:2100: out_dtype float32 only). The products
  e2m1 * e4m3 * e2m1 * e4m3 are exact in fp32; the sum here is in fp64, rounded once (the tensor
  core's summation order is not specified, hence the tests' tolerances).
"""

import numpy as np
import pytest
import torch
import triton.language as tl

import nvfp4_inductor as nv
from nvfp4_inductor import tiled as nv_tiled
from nvfp4_inductor import capability
from nvfp4_inductor.kernels import gemm, plan

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's stand-in (no GPU)")


def _unpack_e2m1(packed: np.ndarray, axis: int) -> torch.Tensor:
    from triton.tools.mxfp import MXFP4Tensor

    packed = torch.from_numpy(np.ascontiguousarray(packed))
    shape = list(packed.shape)
    shape[axis] *= 2
    codes = MXFP4Tensor(size=tuple(shape)).unpack_packed_tensor(packed, axis, shape)
    t = MXFP4Tensor(size=tuple(shape))
    t.data = codes
    return t.to(torch.float32)


def _e4m3(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits)).view(torch.float8_e4m3fn).float()


def _dot_scaled_standin(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, fast_math,
                        lhs_k_pack, rhs_k_pack, acc):
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import TensorHandle

    e2m1 = ir.ScaleDotElemTypeTY.E2M1
    assert lhs_format == e2m1 and rhs_format == e2m1, "stand-in: e2m1 x e2m1 only"
    assert lhs_k_pack and rhs_k_pack, "stand-in: packed along K only"
    assert lhs.dtype == tl.uint8 and rhs.dtype == tl.uint8
    assert lhs_scale is not None and rhs_scale is not None
    assert lhs_scale.dtype == tl.float8e4nv and rhs_scale.dtype == tl.float8e4nv, "stand-in: NVFP4 scales"
    a = _unpack_e2m1(lhs.data, 1)  # (M, K)
    b = _unpack_e2m1(rhs.data, 0)  # (K, N)
    m, k = a.shape
    n = b.shape[1]
    sa, sb = _e4m3(lhs_scale.data), _e4m3(rhs_scale.data)
    assert sa.shape == (m, k // 16) and sb.shape == (n, k // 16)
    a = a * sa.repeat_interleave(16, dim=1)
    b = b * sb.repeat_interleave(16, dim=1).T
    prod = (a.double() @ b.double()).float().numpy()
    return TensorHandle((acc.data + prod).astype(np.float32), acc.dtype.scalar)


@pytest.fixture
def sm100(monkeypatch):
    """The interpreter with the dot_scaled stand-in, and the launchers told the device is sm_100."""
    from triton.language.semantic import TritonSemantic
    from triton.runtime import interpreter

    original = TritonSemantic.dot_scaled

    def dot_scaled(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, *args):
        # the interpreter passes the format strings as they are; compiled, they reach semantic.py
        # as constexpr (which it unwraps with .value)
        lhs_format, rhs_format = (f if isinstance(f, tl.constexpr) else tl.constexpr(f)
                                  for f in (lhs_format, rhs_format))
        return original(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, *args)

    monkeypatch.setattr(TritonSemantic, "dot_scaled", dot_scaled)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot_scaled", _dot_scaled_standin,
                        raising=False)
    monkeypatch.setattr(capability, "block_scaled_mma", lambda device: True)


def _rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (5, 200, 320), (16, 256, 512), (64, 136, 1040), (2, 136, 2064)])
def test_splitk_dot_scaled_matches_reference(sm100, m, n, k):
    """gemm_splitk's dot_scaled_mainloop (tiled W in 128 x 128 groups, x NVFP4 with plain scales,
    split K) against the dequantized product."""
    from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

    gen = torch.Generator().manual_seed(m * 3 + n + k)
    w = nv.quantize(torch.randn(n, k, generator=gen), per_row=m == 5)
    q = nv.quantize(torch.randn(m, k, generator=gen))
    data_t, scale_t = nv_tiled.tile(w.data, w.scale.view(torch.uint8))
    bias = torch.randn(n, generator=gen)
    y = gemm_splitk(q.data, data_t, scale_t, w.global_scale * q.global_scale, bias, torch.float32, False,
                    tiled_n=n, x_scale=q.scale.view(torch.uint8))
    want = q.dequantize(torch.float32) @ w.dequantize(torch.float32).T + bias
    assert _rel(y, want) <= 1e-6


@pytest.mark.parametrize("m", [1, 7, 96])
def test_sm100_linear_launchers_match_reference(sm100, monkeypatch, m):
    """nvfp4::linear_tiled (W4A4 at decode sizes: the dot_scaled split-K kernel) and nvfp4::linear
    (row-major weights: x's quantized values, as on sm_90) on "sm_100" against reference.linear."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 160, generator=gen)
    w = nv.quantize(torch.randn(72, 160, generator=gen))
    bias = torch.randn(72, generator=gen)
    want = nv.linear(x, w, bias, activations="nvfp4")
    if m <= plan.SPLITK_MAX_M:
        swizzled = nv.swizzle_scales(w.scale).view(torch.uint8)
        got = gemm.linear(x, w.data, swizzled, w.global_scale, bias, True, "nvfp4")
        assert _rel(got, want) <= 1e-2  # (the interpreter truncates fp32 -> bf16 operands)
    if m <= plan.SPLITK_MAX_M_TILED:
        assert plan.plan_gemm(m, 72, 160, tiled=True, activation="nvfp4", device=x.device) == (
            "splitk", "dot_scaled", "nvfp4")
        data_t, scale_t = nv_tiled.tile(w.data, w.scale.view(torch.uint8))
        got = gemm.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 72, "nvfp4")
        assert _rel(got, want) <= 1e-6


@pytest.mark.parametrize("m", [3, plan.SPLITK_MAX_M_TILED + 6])
def test_sm100_template_matches_reference(sm100, monkeypatch, m):
    """The Inductor template's DOT_SCALED mainloop (W4A4 on "sm_100": x's NVFP4 codes and scales
    from nvfp4.quantize, split K at decode, BLOCK_M-row programs above plan.SPLITK_MAX_M_TILED),
    generated by Inductor's Triton CPU backend, against the eager op (the reference on the CPU)."""
    import torch.utils._triton
    from torch import nn
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    monkeypatch.setattr(torch.utils._triton, "triton_hash_with_backend", lambda: "interpreter")
    monkeypatch.setattr(plan, "template_is_default", lambda *args, **kwargs: True)
    torch.manual_seed(m)
    linear = nn.Linear(272, 208).eval()  # fp32: the interpreter truncates fp32 -> bf16
    x = torch.randn(m, 272)
    try:
        # (no FX graph cache: its key does not see the patched block_scaled_mma, so a cached
        # DOT_SCALED graph could be served to a later test of the same model without the stand-in)
        with torch._inductor.config.patch({"cpu_backend": "triton", "compile_threads": 1,
                                           "fx_graph_cache": False}):
            y, code = run_and_get_code(nv.compile(linear, nv.Config(activations="nvfp4")), x)
    finally:
        torch._dynamo.reset()
    source = "\n".join(code)
    assert "acc = dot_scaled_mainloop(" in source and "torch.ops.nvfp4.quantize.default(" in source
    w = linear.weight.detach()
    data, scale, g = torch.ops.nvfp4.quantize(w, None, False, False)
    with torch.no_grad():
        want = nv.linear(x, nv.NVFP4(data, scale, g, w.shape), linear.bias.detach(), activations="nvfp4")
    assert _rel(y, want) <= 1e-6

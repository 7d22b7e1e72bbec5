"""A CPU stand-in for tl.dot_scaled (e2m1 x e2m1, e4m3 scales) under the Triton interpreter, and
the `sm100` fixture that installs it and tells the launchers the device is sm_100.

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

from nvfp4_inductor import capability


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


CALLS = [0]  # how many tl.dot_scaled the stand-in has computed (a test's proof that the path ran)


def _dot_scaled_standin(self, lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, fast_math,
                        lhs_k_pack, rhs_k_pack, acc):
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import TensorHandle

    CALLS[0] += 1

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

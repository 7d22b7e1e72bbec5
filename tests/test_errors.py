"""Bad input gets a TypeError / ValueError naming the argument, never a silent wrong answer."""

import math

import pytest
import torch

import nvfp4_inductor as nv

E4M3 = torch.float8_e4m3fn


def _w(n=32, k=64, **kw):
    return nv.quantize(torch.randn(n, k), **kw)


X = torch.randn(4, 64)


def _tiled(data=lambda d: d, scale=lambda t: t, g=lambda g: g):
    """nvfp4::linear_tiled on X with one part of a tiled (32, 64) weight changed."""
    w = _w()
    d, t = torch.ops.nvfp4.tile_weight(w.data, w.scale.view(torch.uint8))
    return torch.ops.nvfp4.linear_tiled(X, data(d), scale(t), g(w.global_scale), None, 32, "bf16")

CASES = [
    # quantize
    ("int input", lambda: nv.quantize(torch.ones(4, 32, dtype=torch.int32)), TypeError, "x must have dtype"),
    ("fp64 input", lambda: nv.quantize(torch.ones(4, 32, dtype=torch.float64)), TypeError, "x must have dtype"),
    ("not a tensor", lambda: nv.quantize([1.0] * 16), TypeError, "x must be a torch.Tensor"),
    ("scalar", lambda: nv.quantize(torch.tensor(1.0)), ValueError, "at least one dimension"),
    ("K not multiple of 16", lambda: nv.quantize(torch.randn(4, 40)), ValueError, "K = 40 must be a positive multiple of 16"),
    ("K zero", lambda: nv.quantize(torch.randn(4, 0)), ValueError, "K = 0"),
    ("g fp64", lambda: nv.quantize(X, torch.tensor(1.0, dtype=torch.float64)), TypeError, "global_scale must have dtype float32"),
    ("g wrong shape", lambda: nv.quantize(X, torch.ones(3)), ValueError, r"global_scale \(per tensor\) must have shape \(\)"),
    ("g per-row shape", lambda: nv.quantize(X, torch.ones(3), per_row=True), ValueError, r"global_scale \(per row\) must have shape \(4,\)"),
    ("g device", lambda: nv.quantize(X, torch.tensor(1.0, device="meta")), ValueError, "global_scale is on meta but x is on cpu"),
    ("g zero", lambda: nv.quantize(X, 0.0), ValueError, "global_scale must be finite and > 0"),
    ("g nan", lambda: nv.quantize(X, math.nan), ValueError, "global_scale must be finite and > 0"),
    ("g inf", lambda: nv.quantize(X, math.inf), ValueError, "global_scale must be finite and > 0"),
    ("g bool", lambda: nv.quantize(X, True), TypeError, "global_scale must be None, a float"),
    ("g number per row", lambda: nv.quantize(X, 1.0, per_row=True), ValueError, "per_row=True needs a global_scale tensor"),
    ("g overflows fp32", lambda: nv.quantize(X, 1e39), ValueError, r"finite and > 0 in float32; got 1e\+39 \(inf"),
    ("g overflows float", lambda: nv.quantize(X, 10**400), ValueError, r"finite and > 0 in float32; got 1000"),
    ("g underflows fp32", lambda: nv.quantize(X, 1e-46), ValueError, r"finite and > 0 in float32; got 1e-46 \(0.0"),
    ("swizzle not bool", lambda: nv.quantize(X, swizzle="yes"), TypeError, "swizzle must be a bool"),
    ("per_row not bool", lambda: nv.quantize(X, per_row=1), TypeError, "per_row must be a bool"),
    ("values: int input", lambda: torch.ops.nvfp4.quantize_values(torch.ones(4, 32, dtype=torch.int32)), TypeError, "x must have dtype"),
    ("values: K not multiple of 16", lambda: torch.ops.nvfp4.quantize_values(torch.randn(4, 40)), ValueError, "K = 40 must be a positive multiple of 16"),
    ("norm: fp32 h", lambda: torch.ops.nvfp4.rms_norm_quantize_values(torch.randn(4, 32), None, 1e-5, False), TypeError, "h must have dtype bfloat16, float16"),
    ("norm: K not multiple of 16", lambda: torch.ops.nvfp4.rms_norm_quantize_values(torch.randn(4, 40).bfloat16(), None, 1e-5, False), ValueError, "K = 40 must be a positive multiple of 16"),
    ("norm: weight shape", lambda: torch.ops.nvfp4.rms_norm_quantize_values(torch.randn(4, 32).bfloat16(), torch.ones(16), 1e-5, False), ValueError, r"weight must have shape \(32,\)"),
    ("norm: weight device", lambda: torch.ops.nvfp4.rms_norm_quantize_values(torch.randn(4, 32).bfloat16(), torch.ones(32, device="meta"), 1e-5, False), ValueError, "weight is on meta but h is on cpu"),
    ("norm: eps nan", lambda: torch.ops.nvfp4.rms_norm_quantize_values(torch.randn(4, 32).bfloat16(), None, math.nan, False), ValueError, "eps must be finite and >= 0"),
    # dequantize
    ("not NVFP4", lambda: nv.dequantize(X), TypeError, "q must be an nvfp4_inductor.NVFP4"),
    ("data dtype", lambda: nv.dequantize(_w()._replace(data=_w().data.to(torch.int16))), TypeError, "q.data must have dtype uint8"),
    ("scale dtype", lambda: nv.dequantize(_w()._replace(scale=_w().scale.float())), TypeError, "q.scale must have dtype float8_e4m3fn, uint8"),
    ("scale shape", lambda: nv.dequantize(_w()._replace(scale=_w().scale[:, :2])), ValueError, r"q.scale \(plain\) must have shape \(32, 4\)"),
    ("swizzled flag wrong", lambda: nv.dequantize(_w()._replace(swizzled=True)), ValueError, r"q.scale \(swizzled\) must have shape \(128, 4\)"),
    ("shape mismatch", lambda: nv.dequantize(_w()._replace(shape=torch.Size([32, 62]))), ValueError, r"q.shape \(32, 62\) does not match"),
    ("g shape", lambda: nv.dequantize(_w()._replace(global_scale=torch.ones(5))), ValueError, r"q.global_scale \(per row\) must have shape \(32,\)"),
    ("non-contiguous data", lambda: nv.dequantize(_w(k=64)._replace(data=torch.zeros(64, 32, dtype=torch.uint8)[::2])), ValueError, "q.data must be contiguous"),
    ("bad dtype out", lambda: nv.dequantize(_w(), torch.int32), TypeError, "dtype must be one of"),
    ("dtype a string", lambda: nv.dequantize(_w(), "float32"), TypeError, "dtype must be a torch.dtype"),
    ("dtype None", lambda: nv.dequantize(_w(), None), TypeError, "dtype must be a torch.dtype"),
    ("swizzled not bool", lambda: nv.dequantize(_w()._replace(swizzled="False")), TypeError, "q.swizzled must be a bool"),
    ("g a float", lambda: nv.dequantize(_w()._replace(global_scale=0.01)), TypeError, "q.global_scale must be a torch.Tensor"),
    ("rows: list indices", lambda: nv.dequantize_rows(_w(), [1, 2]), TypeError, "indices must be a torch.Tensor"),
    ("rows: int index", lambda: nv.dequantize_rows(_w(), 1), TypeError, "indices must be a torch.Tensor"),
    ("rows: float indices", lambda: nv.dequantize_rows(_w(), torch.ones(2)), TypeError, "indices must have dtype int32, int64"),
    # swizzle
    ("swizzle 1-D", lambda: nv.swizzle_scales(torch.zeros(8, dtype=E4M3)), ValueError, "scale must be 2-D"),
    ("swizzle fp32", lambda: nv.swizzle_scales(torch.zeros(8, 4)), TypeError, "scale must have dtype"),
    ("unswizzle shape", lambda: nv.unswizzle_scales(torch.zeros(128, 4, dtype=E4M3), 129, 4), ValueError, r"swizzled must have shape \(256, 4\)"),
    ("unswizzle float rows", lambda: nv.unswizzle_scales(torch.zeros(256, 8, dtype=E4M3), 130.0, 5), TypeError, "rows must be an int"),
    ("unswizzle negative", lambda: nv.unswizzle_scales(torch.zeros(128, 4, dtype=E4M3), -1, 4), ValueError, "rows and cols must be >= 0"),
    # linear
    ("linear K mismatch", lambda: nv.linear(torch.randn(4, 48), _w()), ValueError, r"x.shape\[-1\] = 48 does not match the weight's K = 64"),
    ("linear 3-D weight", lambda: nv.linear(X, nv.quantize(torch.randn(2, 8, 64))), ValueError, "w_q.data must be 2-D"),
    ("linear int x", lambda: nv.linear(X.int(), _w()), TypeError, "x must have dtype"),
    ("linear bias shape", lambda: nv.linear(X, _w(), torch.zeros(31)), ValueError, r"bias must have shape \(32,\)"),
    ("linear bias dtype", lambda: nv.linear(X, _w(), torch.zeros(32, dtype=torch.int64)), TypeError, "bias must have dtype"),
    ("linear activation", lambda: nv.linear(X, _w(), activations="fp8"), ValueError, "activation must be one of"),
    ("linear w not NVFP4", lambda: nv.linear(X, torch.randn(32, 64)), TypeError, "w_q must be an nvfp4_inductor.NVFP4"),
    ("linear x NVFP4", lambda: nv.linear(_w(k=64), _w()), TypeError, "x must be a torch.Tensor, got NVFP4"),
    ("linear bias a float", lambda: nv.linear(X, _w(), 1.0), TypeError, "bias must be a torch.Tensor"),
    ("linear activation not str", lambda: nv.linear(X, _w(), activations=None), TypeError, "activations must be a str"),
    ("linear device", lambda: nv.linear(X.to("meta"), _w()), ValueError, "w_q.data is on cpu but x is on meta"),
    # linear_tiled (the backend's op; its kernels read each tile as one contiguous run)
    ("tiled data strided", lambda: _tiled(data=lambda d: torch.stack([d, d], 1)[:, 0]), ValueError, "tiled w.data must be contiguous"),
    ("tiled scale strided", lambda: _tiled(scale=lambda t: torch.stack([t, t], 1)[:, 0]), ValueError, "tiled w.scale must be contiguous"),
    ("tiled g device", lambda: _tiled(g=lambda g: g.to("meta")), ValueError, "w.global_scale is on meta but x is on cpu"),
]


@pytest.mark.parametrize("name, call, exc, match", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error(name, call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_numpy_and_one_element_global_scales():
    """A numpy float32 is a number like any other; a per-tensor scale of shape (1,) is accepted by
    dequantize and linear as it is by quantize."""
    import numpy as np

    w = torch.randn(32, 64)
    q = nv.quantize(w, np.float32(0.01))
    assert torch.equal(q.global_scale, torch.tensor(0.01, dtype=torch.float32))
    flat = q._replace(global_scale=q.global_scale.reshape(1))
    assert torch.equal(nv.dequantize(flat), nv.dequantize(q))
    assert torch.equal(nv.linear(X, flat), nv.linear(X, q))


def test_ops_check_too():
    # Calling the op directly (what a traced graph does) checks the same things.
    with pytest.raises(ValueError, match="K = 24"):
        torch.ops.nvfp4.quantize(torch.randn(2, 24), None, False, False)
    with pytest.raises(TypeError, match="must have dtype uint8"):
        torch.ops.nvfp4.swizzle_scales(torch.zeros(4, 4, dtype=E4M3))


def test_linear_takes_activations_only():
    """nv.linear names the format of x `activations`, as Config and NVFP4Linear do: there is no
    other spelling (an unknown keyword is a TypeError)."""
    x = torch.randn(3, 32)
    w = nv.quantize(torch.randn(16, 32))
    with pytest.raises(TypeError, match="unexpected keyword argument 'activation'"):
        nv.linear(x, w, activation="nvfp4")

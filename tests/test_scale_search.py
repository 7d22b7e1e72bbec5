"""Weight scale search (method="mse" / "hessian"): the pruned Triton kernel and the brute-force
sweep kernel against the brute-force reference (same chosen scale bits, same fp32 error, same
codes), the error never above RTN's, H = identity giving "mse", the calibration helper, and the
API / Config / backend plumbing. Without a GPU the kernels run under the Triton interpreter."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import nvfp4_inductor as nv
from helpers.inputs import grid_blocks, sample, scalable_values, times_power_of_two
from nvfp4_inductor import reference
from nvfp4_inductor.reference import scale_search
from nvfp4_inductor.calibrate import hessian_blocks
from nvfp4_inductor.format import BLOCK_SIZE


def _weights(rows: int, k: int, seed: int) -> torch.Tensor:
    """Rows cycling through block kinds: normal, Student-t, lognormal, sparse, constant, grid
    (exact ties), tiny (the RTN scale underflows to 0), plus one all-zero and one NaN block and an
    outlier that sets the global scale."""
    gen = torch.Generator().manual_seed(seed)
    kinds = []
    for i in range(rows):
        kind = i % 7
        if kind == 0:
            row = sample("normal", (k,), gen)
        elif kind == 1:
            row = sample("heavy_tailed", (k,), gen)
        elif kind == 2:  # lognormal magnitudes, random signs
            row = torch.exp(torch.randn(k, generator=gen) * 1.5) * (torch.randint(2, (k,), generator=gen) * 2 - 1)
        elif kind == 3:  # sparse: about 3 nonzeros per block
            row = sample("normal", (k,), gen) * (torch.rand(k, generator=gen) < 0.2)
        elif kind == 4:  # constant blocks, a random value each
            row = torch.randn(k // BLOCK_SIZE, generator=gen).repeat_interleave(BLOCK_SIZE)
        elif kind == 5:
            row = grid_blocks((k,), gen) * 0.01
        else:  # tiny next to the outlier: scales in the e4m3 subnormal range or underflowing
            row = sample("normal", (k,), gen) * 10.0 ** float(torch.randint(-9, -5, (1,), generator=gen))
        kinds.append(row)
    x = torch.stack(kinds)
    x[0, 0] = 300.0  # the tensor's amax
    x[1, :BLOCK_SIZE] = 0.0
    x[2, (BLOCK_SIZE + 3) % k] = math.nan  # block 1 (block 0 when K = 16)
    return x


def _hessian(k: int, seed: int, tokens: int = 64) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=gen)
    x[:, 3] *= 30.0  # an outlier channel
    x = x + 0.5 * x.roll(1, dims=1)  # correlated neighbours
    return hessian_blocks(x)


def _kernel_search(x, method, hessian=None, prune=True, device="cpu"):
    from nvfp4_inductor.kernels import scale_search as kernels

    h = None if hessian is None else hessian.to(device)
    data, bits, g, err = kernels.search(x.to(device), None, method, h, prune)
    return data.cpu(), bits.cpu(), g.cpu(), err.cpu()


def _assert_matches_reference(x, method, hessian=None, prune=True, device="cpu"):
    data, bits, g, err = _kernel_search(x, method, hessian, prune, device)
    g_ref = reference.compute_global_scale(x)
    want_bits, want_err = scale_search.search_scales(x, g_ref, method, hessian)
    assert torch.equal(g, g_ref)
    assert torch.equal(bits, want_bits), f"{int((bits != want_bits).sum())} blocks differ"
    torch.testing.assert_close(err, want_err, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(data, scale_search.encode(x, want_bits, g_ref))
    return bits, err


@pytest.mark.parametrize("method", ["mse", "hessian"])
def test_kernel_equals_brute_force(kernel_device, method):
    k = 32  # two groups: each its own H (channel 3's outlier is in the first only) and lambda
    x = _weights(45, k, seed=11)  # odd row count
    hessian = _hessian(k, seed=12) if method == "hessian" else None
    bits, _ = _assert_matches_reference(x, method, hessian, device=kernel_device)
    rtn_bits = reference.quantize(x)[1].view(torch.uint8)
    assert (bits != rtn_bits).float().mean() > 0.3  # the search does move most scales
    assert bits[1, 0] == 0 and bits[2, (k // BLOCK_SIZE) - 1] == 0x7F  # all-zero, NaN: RTN


@pytest.mark.parametrize("e", [-91, -126, -134])
def test_tiny_global_scale_searches_as_if_scaled_up(kernel_device, e):
    """g below 2^-100 (x and g scaled by 2^64 first, as the quantizer does): the brute force on
    x * 2^e with g * 2^e chooses x's scales with x's errors, and the pruned kernel matches it
    (dynamic g, subnormal). Unscaled, r = 1 / (s g) overflows for most candidates there."""
    gen = torch.Generator().manual_seed(-e)
    x = scalable_values((33, 32), gen)
    scaled = times_power_of_two(x, e)
    g = torch.tensor(2.0**-10)
    for method, hessian in (("mse", None), ("hessian", _hessian(32, seed=-e))):
        want = scale_search.search_scales(x, g, method, hessian)
        got = scale_search.search_scales(scaled, g * 2.0**e, method, hessian)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    _assert_matches_reference(scaled, "mse", device=kernel_device)


@pytest.mark.parametrize("method", ["mse", "hessian"])
def test_kernel_equals_brute_force_bf16_normal(kernel_device, method):
    # The GPU test's public-path weights in miniature: bf16 ~ N(0, 0.02), one block column per
    # 16 values, many rows (so many near-RTN ties: scale s against s / 2 and 2 s).
    gen = torch.Generator().manual_seed(25)
    k = 32 if method == "mse" else 16
    w = (torch.randn(512, k, generator=gen) * 0.02).to(torch.bfloat16)
    hessian = _hessian(k, seed=26) if method == "hessian" else None
    _assert_matches_reference(w, method, hessian, device=kernel_device)


def test_kernel_singular_hessian_negative_errors(kernel_device):
    # H = t t^T from one calibration token: lambda = 0, and rounding makes some computed errors
    # negative. A pruned kernel that stops both sweeps at the first negative best ("0 > best"
    # passes for the vanished bounds) chooses bits 38 (E = -0.67) over the reference's 35
    # (E = -1.30) in block 1. Row 0 holds the tensor's amax (it sets g, as in the 8192-row
    # tensor, seed 3, that the block came from).
    token = torch.tensor([
        -0.5972964763641357, -1.777728796005249, -0.465898722410202, 0.2682900130748749,
        -0.5403047204017639, -0.7157183885574341, 0.4004928767681122, 0.4667956233024597,
        -1.1900434494018555, 1.5735183954238892, -0.21717453002929688, 0.551885724067688,
        -1.6412652730941772, 0.6539067625999451, -1.6565139293670654, 0.20719704031944275])
    x = torch.tensor([
        [-0.00173187255859375, 0.01092529296875, 0.04248046875, 0.0294189453125,
         0.0031585693359375, 0.00970458984375, 0.02294921875, -0.01904296875, 0.015625,
         -0.003631591796875, -0.0205078125, -0.0306396484375, -0.0185546875, 0.095703125,
         -0.004608154296875, -0.0302734375],
        [-0.004302978515625, 0.0242919921875, 0.01025390625, 0.0142822265625, -0.057373046875,
         -0.040283203125, 4.6253204345703125e-05, 0.0057373046875, -0.01611328125,
         0.0034637451171875, -0.01434326171875, 0.029296875, 0.019287109375, 0.01043701171875,
         0.0235595703125, -0.004608154296875]]).to(torch.bfloat16)
    hessian = hessian_blocks(token[None])
    from nvfp4_inductor.kernels.scale_search import hessian_operands
    assert hessian_operands(hessian)[1].item() == 0.0
    bits, err = _assert_matches_reference(x, "hessian", hessian, device=kernel_device)
    assert bits[1, 0] == 35 and err[1, 0] < 0


def test_brute_force_sweep_kernel_equals_reference(kernel_device):
    # The benchmark's baseline: every candidate, one kernel (slow under the interpreter: K = 16).
    _assert_matches_reference(_weights(21, 16, seed=13), "mse", prune=False, device=kernel_device)


def test_hessian_identity_is_mse(kernel_device):
    x = _weights(70, 64, seed=14)
    g = reference.compute_global_scale(x)
    eye = torch.eye(BLOCK_SIZE).repeat(4, 1, 1)
    mse_bits, mse_err = scale_search.search_scales(x, g, "mse")
    h_bits, h_err = scale_search.search_scales(x, g, "hessian", eye)
    assert torch.equal(h_bits, mse_bits)
    torch.testing.assert_close(h_err, mse_err, rtol=0, atol=0, equal_nan=True)
    small = x[:15, :16]
    _, k_bits, _, k_err = _kernel_search(small, "hessian", eye[:1], device=kernel_device)
    want_bits, want_err = scale_search.search_scales(small, reference.compute_global_scale(small), "mse")
    assert torch.equal(k_bits, want_bits)
    torch.testing.assert_close(k_err, want_err, rtol=0, atol=0, equal_nan=True)


def _true_errors(x, bits, g, hessian=None):
    """fp64 errors of the dequantized blocks, independent of the search's fp32 arithmetic."""
    data = scale_search.encode(x, bits, g)
    x_hat = reference.dequantize(data, bits.view(torch.float8_e4m3fn), g).double()
    e = (x.double() - x_hat).reshape(x.shape[0], -1, BLOCK_SIZE)
    if hessian is None:
        return (e * e).sum(-1)
    return torch.einsum("rgi,gij,rgj->rg", e, hessian.double(), e)


@pytest.mark.parametrize("method", ["mse", "hessian"])
def test_never_worse_than_rtn(method):
    x = _weights(140, 128, seed=15)
    x[2] = 0.5  # no NaN here: compare every block
    hessian = _hessian(128, seed=16) if method == "hessian" else None
    g = reference.compute_global_scale(x)
    bits, err = scale_search.search_scales(x, g, method, hessian)
    rtn_bits = reference.quantize(x, g)[1].view(torch.uint8)
    blocks = x.reshape(-1, BLOCK_SIZE)
    u = None if hessian is None else scale_search.hessian_operand(hessian).repeat(x.shape[0], 1, 1)
    rtn_err = scale_search.block_errors(blocks, g, rtn_bits.reshape(-1, 1).long(), u).reshape(err.shape)
    assert (err <= rtn_err).all()
    nonzero = rtn_err > 0
    assert (err[nonzero] / rtn_err[nonzero]).mean() < 0.9  # per block, not the outlier's alone
    # Independently, in fp64 on the dequantized blocks (up to fp32 rounding of the search).
    true_chosen, true_rtn = _true_errors(x, bits, g, hessian), _true_errors(x, rtn_bits, g, hessian)
    slack = 1e-5 * true_rtn.abs() + 1e-30
    assert (true_chosen <= true_rtn + slack).all()
    # And the chosen scale is the best of all 126 in fp64 too (within fp32 rounding).
    for c in range(1, 0x7F):
        cand = torch.full_like(bits, c)
        assert (true_chosen <= _true_errors(x, cand, g, hessian) + 1e-5 * true_chosen + 1e-30).all()


def test_hand_worked_blocks():
    # {4, 3, 0, ...} with g = 1/8: RTN s = e4m3(4 / 0.75) = 5.5 leaves errors (3 -> 4.36 -> 4);
    # s = 8 (scale 1) and s = 16 (scale 2) are exact: the smaller bits win the tie.
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 4.0, 3.0
    g = torch.tensor(0.125)
    assert reference.quantize(x, g)[1].float().item() == 5.5
    bits, err = scale_search.search_scales(x, g, "mse")
    assert bits.view(torch.float8_e4m3fn).float().item() == 8.0 and err.item() == 0.0
    # A constant block whose RTN scale is exact: ties everywhere, RTN kept.
    x = torch.full((1, 16), 3.0)
    bits, err = scale_search.search_scales(x, g, "mse")
    assert torch.equal(bits, reference.quantize(x, g)[1].view(torch.uint8)) and err.item() == 0.0


def test_collect_hessians_equals_xtx():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 20), nn.Linear(20, 16)).eval()
    batches = [torch.randn(3, 5, 32), torch.randn(7, 32)]
    hessians = nv.collect_hessians(model, batches)
    assert sorted(hessians) == ["0", "2"]  # "3" has in_features 20, not a multiple of 16
    x0 = torch.cat([b.reshape(-1, 32) for b in batches])
    x2 = torch.relu(model[0](x0)).detach()
    for name, x in (("0", x0), ("2", x2)):
        full = x.T @ x
        want = torch.stack([full[16 * i:16 * i + 16, 16 * i:16 * i + 16] for i in range(x.shape[1] // 16)])
        torch.testing.assert_close(hessians[name], want, rtol=1e-5, atol=1e-4)
    assert not model[0]._forward_pre_hooks  # hooks removed
    only = nv.collect_hessians(model, batches[:1], include=lambda name, m: name == "2")
    assert sorted(only) == ["2"]


class _KeywordCalls(nn.Module):
    """Calls its linear with input= and takes a second argument: list and dict batches."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 16)

    def forward(self, x, scale=1.0):
        return self.proj(input=x * scale)


def test_collect_hessians_batch_forms_and_training_mode():
    torch.manual_seed(0)
    model = _KeywordCalls().eval()
    x = torch.randn(6, 32)
    blocks = nv.collect_hessians(model, [x])["proj"]
    want = torch.stack([x[:, 16 * i:16 * i + 16].T @ x[:, 16 * i:16 * i + 16] for i in range(2)])
    torch.testing.assert_close(blocks, want)
    assert torch.equal(nv.collect_hessians(model, [[x, 1.0]])["proj"], blocks)
    assert torch.equal(nv.collect_hessians(model, [{"x": x, "scale": 1.0}])["proj"], blocks)
    with pytest.warns(UserWarning, match="training mode"):
        nv.collect_hessians(model.train(), [x])


def test_quantize_api_and_validation():
    x = torch.randn(8, 32, dtype=torch.bfloat16)
    eye = torch.eye(16).repeat(2, 1, 1)
    q = nv.quantize(x, method="mse")
    bits, _ = scale_search.search_scales(x, reference.compute_global_scale(x), "mse")
    assert torch.equal(q.scale.view(torch.uint8), bits)
    assert torch.equal(nv.quantize(x, method="hessian", hessian=eye).data, q.data)
    swz = nv.quantize(x, method="mse", swizzle=True)
    assert torch.equal(nv.unswizzle_scales(swz.scale, 8, 2), q.scale)
    assert torch.equal(nv.quantize(x, method="rtn").data, nv.quantize(x).data)
    assert nv.quantize(x, 0.01, method="mse").global_scale.item() == pytest.approx(0.01)
    bad = [
        (dict(method=1), TypeError, "method must be a str"),
        (dict(method="gptq"), ValueError, "method must be one of"),
        (dict(method="hessian"), ValueError, "needs hessian"),
        (dict(method="mse", hessian=eye), ValueError, "only used with"),
        (dict(method="mse", per_row=True), ValueError, "per-tensor global scale"),
        (dict(method="hessian", hessian=eye[:1]), ValueError, r"shape \(2, 16, 16\)"),
        (dict(method="hessian", hessian=eye.double()), TypeError, "hessian must have dtype"),
        (dict(method="hessian", hessian=eye.numpy()), TypeError, "torch.Tensor"),
        # values convert() already refused: NaN kept RTN silently, -H chose the worst scales
        (dict(method="hessian", hessian=torch.full_like(eye, float("nan"))), ValueError, "not finite"),
        (dict(method="hessian", hessian=-eye), ValueError, "negative diagonal"),
    ]
    for kwargs, error, match in bad:
        with pytest.raises(error, match=match):
            nv.quantize(x, **kwargs)


def test_hessian_brute_force_in_chunks(monkeypatch):
    """The brute force takes each block's Hessian by its column group, chunk by chunk (chunks of 7
    blocks here: boundaries inside rows) -- the same as one chunk holding every block."""
    x = _weights(9, 48, seed=31)
    hessian = _hessian(48, seed=32)
    g = reference.compute_global_scale(x)
    want = scale_search.search_scales(x, g, "hessian", hessian)
    monkeypatch.setattr(scale_search, "_CHUNK_BLOCKS", 7)
    got = scale_search.search_scales(x, g, "hessian", hessian)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0, equal_nan=True)
    # and each block's error is the quadratic form with its own group's H (errors are in units
    # of g^2: the module docstring)
    w_hat = reference.dequantize(scale_search.encode(x, want[0], g), want[0].view(torch.float8_e4m3fn),
                                 g).reshape(9, 3, 16)
    d = x.float().reshape(9, 3, 16) - w_hat
    quad = torch.einsum("rgi,gij,rgj->rg", d, hessian, d)
    torch.testing.assert_close(want[1] * g * g, quad, rtol=1e-4, atol=1e-6, equal_nan=True)


def test_config_and_convert_with_methods():
    with pytest.raises(ValueError, match="weight_method|method must be one of"):
        nv.Config(weight_method="best")
    with pytest.raises(ValueError, match="needs hessian"):
        nv.Config(weight_method="hessian")
    with pytest.raises(TypeError, match="hessians must be a dict"):
        nv.Config(weight_method="hessian", hessians=[1])
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16)).to(torch.bfloat16).eval()
    batches = [torch.randn(6, 32, dtype=torch.bfloat16)]
    hessians = nv.collect_hessians(model, batches)
    weights = {name: model.get_submodule(name).weight.detach().clone() for name in hessians}
    with pytest.raises(ValueError, match=r"no calibration Hessian for layers \['2'\]"):
        nv.convert(model, nv.Config(weight_method="hessian", hessians={"0": hessians["0"]},
                                    skip_output_head=False))
    assert isinstance(model[0], nn.Linear)  # nothing replaced before the error
    for bad, what in ((float("nan"), "not finite"), (-1.0, "negative diagonal")):
        broken = {name: h.clone() for name, h in hessians.items()}
        broken["2"][1, 3, 3] = bad
        with pytest.raises(ValueError, match=rf"hessians\['2'\] .*{what}"):
            nv.convert(model, nv.Config(weight_method="hessian", hessians=broken,
                                        skip_output_head=False))
    assert isinstance(model[0], nn.Linear)
    nv.convert(model, nv.Config(activations="bf16", weight_method="hessian", hessians=hessians))
    for name, w in weights.items():
        want = nv.quantize(w, method="hessian", hessian=hessians[name])
        data, scale = model.get_submodule(name).plain_weight()
        assert torch.equal(data, want.data)
        assert torch.equal(scale.view(torch.uint8), want.scale.view(torch.uint8))


def test_backend_with_mse_and_hessian_error():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32)).to(torch.bfloat16).eval()
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    config = nv.Config(activations="bf16", weight_method="mse", skip_output_head=False)
    y, code = run_and_get_code(nv.compile(model, config), x)
    source = "\n".join(code)
    assert source.count("torch.ops.nvfp4.linear_tiled.default(") == 2
    assert "nvfp4.quantize_weight" not in source  # folded at compile time
    with torch.no_grad():
        h = nv.linear(x, nv.quantize(model[0].weight, method="mse"), model[0].bias)
        want = nv.linear(torch.relu(h), nv.quantize(model[2].weight, method="mse"), model[2].bias)
    assert torch.equal(y, want)
    torch._dynamo.reset()
    hessians = nv.collect_hessians(model, [x])
    with pytest.raises(ValueError, match='cannot use weight_method="hessian"'):
        nv.compile(model, nv.Config(weight_method="hessian", hessians=hessians))


def test_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    script = Path(__file__).parent / "helpers" / "compile_scale_search.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(script.parents[2]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(script), "90", "bf16"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(results) == 4
    failed = {r["case"]: r["error"] for r in results if not r["ok"]}
    assert not failed, failed
    assert all(all(r["ptx_checks"].values()) for r in results)  # no contracted fma


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mse", "hessian"])
@pytest.mark.parametrize("prune", [True, False])
def test_kernel_equals_brute_force_on_gpu(method, prune):
    x = _weights(301, 256, seed=21)
    hessian = _hessian(256, seed=22) if method == "hessian" else None
    _assert_matches_reference(x, method, hessian, prune, device="cuda")
    # bf16 weights as models hold them, through the public API and the op's CUDA kernel. Seeded:
    # with the global RNG the weights depended on which tests ran before.
    gen = torch.Generator().manual_seed(24)
    w = (torch.randn(512, 1024, generator=gen) * 0.02).to(torch.bfloat16)
    hessian = _hessian(1024, seed=23) if method == "hessian" else None
    q = nv.quantize(w.cuda(), method=method, hessian=None if hessian is None else hessian.cuda())
    g = reference.compute_global_scale(w)
    bits, err = scale_search.search_scales(w, g, method, hessian)
    assert torch.equal(q.global_scale.cpu(), g)
    got = q.scale.view(torch.uint8).cpu()
    assert torch.equal(got, bits), _describe_mismatches(w, g, got, bits, err, hessian)


@pytest.mark.parametrize("method", ["mse", "hessian"])
def test_kernel_search_copies_a_given_global_scale(kernel_device, method):
    """The returned g is a new tensor, as the CPU path's: nvfp4::quantize_weight's CUDA kernel
    returned the caller's scale itself, an output aliasing an input, which torch.library refuses
    (nv.quantize(w, g, method="mse") raised on a GPU)."""
    from nvfp4_inductor.kernels import scale_search as kernels

    gen = torch.Generator().manual_seed(41)
    x = torch.randn(5, 32, generator=gen).to(kernel_device)
    hessian = _hessian(32, seed=42).to(kernel_device) if method == "hessian" else None
    g = torch.tensor(0.01, device=kernel_device)
    got = kernels.search(x, g, method, hessian)[2]
    assert torch.equal(got, g)
    assert got.untyped_storage().data_ptr() != g.untyped_storage().data_ptr()


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["mse", "hessian"])
def test_static_global_scale_search_on_gpu(method):
    gen = torch.Generator().manual_seed(43)
    w = torch.randn(64, 128, generator=gen).to(torch.bfloat16)
    hessian = _hessian(128, seed=44) if method == "hessian" else None
    g = torch.tensor(0.002)
    want = nv.quantize(w, g, method=method, hessian=hessian)
    got = nv.quantize(w.cuda(), g.cuda(), method=method,
                      hessian=None if hessian is None else hessian.cuda())
    assert torch.equal(got.global_scale.cpu(), g)
    assert torch.equal(got.data.cpu(), want.data)
    assert torch.equal(got.scale.view(torch.uint8).cpu(), want.scale.view(torch.uint8))


def _describe_mismatches(x, g, got, want, want_err, hessian=None, limit=8):
    """Assertion message: each differing block's values, both bits and both reference errors."""
    lines = [f"{int((got != want).sum())} blocks differ (g = {g.item()!r})"]
    u = None if hessian is None else scale_search.hessian_operand(hessian)
    for r, c in (got != want).nonzero()[:limit].tolist():
        block = x[r, c * BLOCK_SIZE:(c + 1) * BLOCK_SIZE].float()
        pair = torch.tensor([[int(got[r, c]), int(want[r, c])]])
        e = scale_search.block_errors(block[None], g, pair, None if u is None else u[c:c + 1])[0]
        lines.append(f"block ({r}, {c}) {block.tolist()}: kernel bits {pair[0, 0]} error "
                     f"{e[0].item()!r}, reference bits {pair[0, 1]} error {e[1].item()!r} "
                     f"(reference's chosen error {want_err[r, c].item()!r})")
    return "\n".join(lines)


@pytest.mark.gpu
def test_device_global_scale_is_the_correctly_rounded_quotient():
    # CUDA computes `tensor / python_scalar` as tensor * (1 / scalar) (one ulp off for some
    # values); the scale search's on-device g must equal the CPU reference's amax / 2688.
    gen = torch.Generator().manual_seed(31)
    amax = torch.rand(100_000, generator=gen) * torch.logspace(-20, 20, 100_000)
    on_gpu = reference.global_scale_from_amax(amax.cuda()).cpu()
    assert torch.equal(on_gpu, reference.global_scale_from_amax(amax))
    assert torch.equal(on_gpu, (amax.double() / 2688).float())  # correctly rounded


def test_searched_weights_carry_no_gradient():
    # quantize's outputs carry no gradient whatever the method: a W4A16 linear on a weight searched
    # from a Linear that requires grad backpropagates to x (it raised: quantize_weight had no
    # autograd formula)
    linear = nn.Linear(32, 16)
    for method in ("rtn", "mse"):
        q = nv.quantize(linear.weight, method=method)
        assert not (q.data.requires_grad or q.scale.requires_grad or q.global_scale.requires_grad)
        x = torch.randn(2, 32, requires_grad=True)
        nv.linear(x, q).sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape


@pytest.mark.parametrize("bad", [torch.randn(2, 24), torch.randn(3, 8), torch.tensor(1.0)])
def test_hessian_blocks_refuses_k_not_a_multiple_of_16(bad):
    """(2, 24) reshaped to (-1, 1, 16) silently regrouped rows across row boundaries;
    the blocks need K a multiple of 16, as collect_hessians' layers have."""
    with pytest.raises(ValueError):
        hessian_blocks(bad)


def test_hessian_blocks_sums_each_group_over_rows():
    x = torch.randn(3, 5, 32)
    h = hessian_blocks(x)
    rows = x.reshape(-1, 32)
    for g in range(2):
        block = rows[:, 16 * g:16 * (g + 1)]
        torch.testing.assert_close(h[g], block.T @ block)

"""kernels/hopper_gemm.py, the Hopper W4A16 GEMM (Gluon, warp-specialized). Without a GPU: every
shipped config compiles for sm_90 into load, decode and mma partitions, and the mma partition's
K loop keeps one wgmma group in flight (PTX `wgmma.wait_group 1` in the loop, SASS
`WARPGROUP.DEPBAR.LE gsb0, 0x1`, no ptxas serialization warning, no spills), for both weight
layouts (and the register-A form on the tiled one), and the split-K epilogue's handshake is
there. On a GPU: the kernel against the reference linear on fresh random inputs, odd shapes and
every shipped config and register-A form."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor import reference
from nvfp4_inductor.kernels import gemm_configs
from helpers.gemm import hopper_forms

pytest.importorskip("triton.experimental.gluon")

SCRIPT = Path(__file__).parents[1] / "helpers" / "compile_hopper.py"
FORMS = hopper_forms()  # (config, tiled weights): what tests/helpers/compile_hopper.py compiles
FORM_IDS = [f"{'x'.join(map(str, c))}-{'tiled' if tiled else 'hopper'}" for c, tiled in FORMS]


@pytest.fixture(scope="module")
def compiled() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[2]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_every_config_compiles_for_sm90(compiled):
    assert len(compiled) == 2 * len(FORMS)  # 2 epilogues
    failed = {r["case"]: r["error"] for r in compiled if not r["ok"]}
    assert not failed, failed


def test_wgmma_stays_in_flight_through_the_k_loop(compiled):
    for r in compiled:
        assert r["mma"] and all(".bf16.bf16" in mma for mma in r["mma"]), r
        register_a = gemm_configs.HopperConfig(*r["config"]).register_a
        assert r["loops"] == 3 - register_a + r["split"], r  # one K loop a partition (and the split sum)
        assert r["mma_loops"] == 1, r
        assert r["mma_loop_wait_counts"] == [1], r  # the mma loop never drains the wgmma groups
        assert not r["ptxas_serialized"], r  # ptxas did not serialize the wgmmas (C7515)
        assert not r["ptxas_warnings"], r
        assert 1 in r["sass_depbar_counts"], r
        assert r["spills"] == ["0"], r


def test_split_k_handshake(compiled):
    """With K split, the last program of a tile to arrive (one acq_rel atomic after a barrier)
    sums the partials; without, no atomic at all."""
    assert {r["split"] for r in compiled} == {False, True}
    for r in compiled:
        assert r["atomics"] == (["atom.global.gpu.acq_rel.add.u32"] if r["split"] else []), r


def test_partitions_and_handover(compiled):
    """The partitions get their register counts, and each release of a slot (decode: codes read,
    A tile stored; mma: step i - 1's wgmma retired) follows a partition-wide bar.sync."""
    for r in compiled:
        config = gemm_configs.HopperConfig(*r["config"])
        if config.register_a:  # mma: load_empty only
            assert config.load_regs in r["setmaxnreg"] and r["loop_releases"] == 1, r
        else:  # decode: load_empty, a_ready; mma: load_empty, a_empty
            assert {config.load_regs, config.decode_regs} <= set(r["setmaxnreg"]), r
            assert r["loop_releases"] == 4, r
        assert r["arrives_after_bar_sync"], r


def _rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def _pack(data, scale, tiled):
    """The weights in the kernel's layout: reference.hopper's, or the backend's tiled one."""
    from nvfp4_inductor.reference import hopper, tiled as tiled_layout

    return tiled_layout.tile(data, scale.view(torch.uint8)) if tiled else hopper.pack(data, scale)


def _case(m, n, k, seed, per_row, bias=True, tiled=False):
    """Fresh random x over a wide range, weights with blocks spanning the e4m3 range (subnormal
    scales included), a per-tensor or per-row global scale, bias -> (inputs on the GPU, reference
    output in float64)."""

    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 10).to(torch.bfloat16)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 2, n)[:, None]
    data, scale, g = reference.quantize(w, per_row=per_row)
    b = torch.randn(n, generator=gen) if bias else None
    codes, scales = _pack(data, scale, tiled)
    want = x.double() @ reference.dequantize(data, scale, g).double().T
    if bias:
        want = want + b.double()
    args = [t.cuda() for t in (x, codes, scales, g)] + [b.cuda() if bias else None]
    return args, want


LAYOUTS = pytest.mark.parametrize("tiled", [False, True], ids=["hopper-layout", "tiled-layout"])


@pytest.mark.gpu
@LAYOUTS
@pytest.mark.parametrize("m", [17, 33, 128, 200, 600])
@pytest.mark.parametrize("n, k", [(200, 320), (1024, 512), (96, 1040), (328, 4112)])
def test_against_the_reference_linear(m, n, k, tiled):
    """The default config for M; N not a multiple of the tile, K a multiple of 16 and (512 aside)
    not of BLOCK_K, K = 4112 wrapping the slot rings many times."""
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear

    args, want = _case(m, n, k, seed=m * 131 + n * 7 + k, per_row=m % 2 == 1, tiled=tiled)
    y = hopper_linear(*args, out_dtype=torch.float32, n=n, tiled=tiled)
    assert y.shape == (m, n)
    assert _rel(y, want) <= 2e-3
    y16 = hopper_linear(*args, out_dtype=torch.bfloat16, n=n, tiled=tiled)
    assert _rel(y16, want) <= 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("config, tiled", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("m", [17, 200, 600])
@pytest.mark.parametrize("per_row, bias", [(False, True), (True, False), (True, True)])
def test_every_shipped_config(config, m, per_row, bias, tiled):
    """Each config at every M (not only where the table picks it), odd N and K."""
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear

    n, k = 200, 1040
    args, want = _case(m, n, k, seed=m + 3 * per_row + bias + config.rows, per_row=per_row, bias=bias,
                       tiled=tiled)
    y = hopper_linear(*args, out_dtype=torch.float32, config=config, n=n, tiled=tiled)
    assert _rel(y, want) <= 2e-3, config


@pytest.mark.gpu
@pytest.mark.parametrize("config, tiled", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("m, n, k, splits", [(33, 200, 1040, 2), (128, 328, 4112, 5), (600, 96, 2048, 3)])
def test_split_k(config, m, n, k, splits, tiled):
    """K split across programs (the last to arrive sums the partials in split order): the
    reference linear, the same bits on a second call and with the splits' counters reused."""
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear

    args, want = _case(m, n, k, seed=m + n + splits, per_row=splits % 2 == 1, tiled=tiled)
    y = hopper_linear(*args, out_dtype=torch.float32, config=config, n=n, tiled=tiled, splits=splits)
    assert _rel(y, want) <= 2e-3, config
    for _ in range(3):
        again = hopper_linear(*args, out_dtype=torch.float32, config=config, n=n, tiled=tiled, splits=splits)
        assert torch.equal(again, y)


@pytest.mark.gpu
@pytest.mark.parametrize("config, tiled", FORMS, ids=FORM_IDS)
def test_special_blocks(config, tiled):
    """A NaN block poisons its row's outputs only; an all-zero row gives zeros."""
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear

    gen = torch.Generator().manual_seed(11)
    m, n, k = 300, 192, 768
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    q = nv.quantize(torch.randn(n, k, generator=gen))
    data, scale = q.data.clone(), q.scale.clone()
    scale.view(torch.uint8)[5, 3] = 0x7F
    data[7], scale.view(torch.uint8)[7] = 0, 0
    codes, scales = _pack(data, scale, tiled)
    want = x.double() @ reference.dequantize(data, scale, q.global_scale).double().T
    y = hopper_linear(x.cuda(), codes.cuda(), scales.cuda(), q.global_scale.cuda(), None,
                      torch.float32, config, n=n, tiled=tiled).cpu()
    assert torch.isnan(y[:, 5]).all() and not torch.isnan(y[:, torch.arange(n) != 5]).any(), config
    assert not y[:, 7].any(), config
    keep = torch.arange(n) != 5
    assert _rel(y[:, keep], want[:, keep]) <= 2e-3, config


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
@pytest.mark.parametrize("m, n, k", [(300, 200, 1040), (128, 4096, 4096), (512, 1000, 768)])
def test_the_op_runs_it_where_planned(activation, m, n, k):
    """nvfp4::linear_tiled on sm_90 in gemm_configs.HOPPER_GEMM_M: the kernel's output with the
    launch plan.hopper_launch gives (W4A4: on x's quantized values, both global scales), bit for
    bit, and the reference linear within the GEMM tolerance."""
    from nvfp4_inductor.kernels import plan
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear

    if not torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("the Hopper GEMM needs sm_90")
    assert gemm_configs.hopper_gemm_planned(m)
    (x, codes, scales, g, bias), want = _case(m, n, k, seed=m + n, per_row=m % 2 == 0, tiled=True)
    y = torch.ops.nvfp4.linear_tiled(x, codes, scales, g, bias, n, activation)
    a, gx = (x, None) if activation == "bf16" else torch.ops.nvfp4.quantize_values(x)
    launch = plan.hopper_launch(m, n, k, x.device)
    direct = hopper_linear(a, codes, scales, g if gx is None else g * gx, bias, torch.bfloat16,
                           config=launch.config, n=n, tiled=True, splits=launch.splits)
    assert torch.equal(y, direct)
    if activation == "bf16":
        assert _rel(y, want) <= 1e-2


def test_rejects_a_config_the_kernel_cannot_run():
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear
    from nvfp4_inductor.reference import hopper

    codes, scales = hopper.pack(torch.zeros(64, 32, dtype=torch.uint8), torch.ones(64, 4).to(torch.float8_e4m3fn))
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_warps"):
        hopper_linear(x, codes, scales, torch.ones(()), config=gemm_configs.HopperConfig(rows=128, num_warps=4))


def test_rejects_tiled_weights_of_another_shape():
    from nvfp4_inductor.kernels.hopper_gemm import hopper_linear
    from nvfp4_inductor.reference import tiled

    codes, scales = tiled.tile(torch.zeros(64, 48, dtype=torch.uint8), torch.zeros(64, 6, dtype=torch.uint8))
    x = torch.zeros(8, 96, dtype=torch.bfloat16)
    g = torch.ones(())
    with pytest.raises(ValueError, match="give n"):
        hopper_linear(x, codes, scales, g, tiled=True)
    with pytest.raises(ValueError, match="at most 64"):
        hopper_linear(x, codes, scales, g, n=65, tiled=True)
    with pytest.raises(ValueError, match="tiled layout"):
        hopper_linear(torch.zeros(8, 160, dtype=torch.bfloat16), codes, scales, g, n=64, tiled=True)
    with pytest.raises(ValueError, match="tiled layout"):
        hopper_linear(x, codes[:-16], scales, g, n=64, tiled=True)
    with pytest.raises(ValueError, match="splits must be 1 .. 2"):  # (K = 96: two K-steps of 64)
        hopper_linear(x, codes, scales, g, n=64, tiled=True, splits=3)


@pytest.mark.parametrize("tiles, steps, sms", [(32, 32, 132), (112, 32, 132), (224, 64, 132), (5, 9, 132),
                                               (1, 3, 132), (40, 1000, 114)])
def test_splits_fill_one_wave(tiles, steps, sms):
    """K is split only while the output tiles are fewer than the SMs: the programs stay within one
    wave, and every split keeps at least HOPPER_MIN_STEPS K-steps."""
    splits = gemm_configs.hopper_splits(tiles, steps, sms)
    assert splits >= 1
    if tiles >= sms or steps < 2 * gemm_configs.HOPPER_MIN_STEPS:
        assert splits == 1
    else:
        assert tiles * splits <= sms < tiles * (splits + 1) or steps // splits < 2 * gemm_configs.HOPPER_MIN_STEPS
        assert steps // splits >= gemm_configs.HOPPER_MIN_STEPS


@pytest.mark.parametrize("m, n, k", [(128, 4096, 4096), (512, 14336, 4096), (33, 200, 1040)])
def test_the_planner_gives_the_launch(m, n, k):
    """plan.hopper_launch: the config for M, K split as hopper_splits says over whole K-steps, one
    program per tile and split; a config or split given is kept, and checked."""
    from nvfp4_inductor.kernels import plan

    device = torch.device("cpu")
    launch = plan.hopper_launch(m, n, k, device)
    config = gemm_configs.hopper_config(m, n, k)
    tiles = -(-n // config.rows) * -(-m // config.block_t)
    steps = -(-k // config.block_k)
    splits = gemm_configs.hopper_splits(tiles, steps, 8)
    assert launch.config == config and launch.tiles == tiles
    assert launch.steps_per_split == -(-steps // splits)
    assert launch.splits == -(-steps // launch.steps_per_split) and launch.grid == (tiles * launch.splits, )
    other = gemm_configs.HopperConfig(rows=64, block_t=64, block_k=64, stages=4, num_warps=4)
    assert plan.hopper_launch(m, n, k, device, other, 1)[:2] == (other, 1)
    with pytest.raises(ValueError, match="splits must be"):
        plan.hopper_launch(m, n, k, device, other, -(-k // 64) + 1)

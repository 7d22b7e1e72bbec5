"""kernels/plan.py and kernels/gemm_configs.py: which GEMM and which mainloop serve a linear (by
rows, weight layout, device; eager or compiled), and the invariants of the split-K configs (tiles,
splits, the split sum's rounds). Asked as for a GPU where it matters; nothing is launched."""

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor import capability
from nvfp4_inductor.kernels import gemm_configs, plan
from nvfp4_inductor.kernels.device import mma as gemm_mma
from nvfp4_inductor.reference import tiled as nv_tiled


@pytest.fixture
def sm90(monkeypatch):
    """A CUDA device as an H100 reports itself (132 SMs, sm_90), for plans asked on the CPU."""
    monkeypatch.setattr(capability, "sm_count", lambda device: 132)
    monkeypatch.setattr(capability, "sm90_or_later", lambda device: device.type == "cuda")
    monkeypatch.setattr(capability, "wgmma", lambda device: device.type == "cuda")
    monkeypatch.setattr(capability, "block_scaled_mma", lambda device: False)
    monkeypatch.setattr(capability, "gluon_hopper", lambda: True)  # (whatever Triton is installed)
    return torch.device("cuda")


def test_plan_by_rows_and_layout():
    """Row-major weights: the split-K kernel up to plan.SPLITK_MAX_M rows, tiled ones up to
    plan.SPLITK_MAX_M_TILED; above, dequantize + cuBLASLt eagerly. Whatever x's dtype and activation."""
    cpu = torch.device("cpu")
    for tiled, limit in ((False, plan.SPLITK_MAX_M), (True, plan.SPLITK_MAX_M_TILED)):
        for activation in ("bf16", "nvfp4"):
            for m in (1, limit, limit + 1, 4096):
                chosen = plan.plan_gemm(m, 4096, 4096, tiled=tiled, activation=activation, device=cpu)
                assert chosen.kernel == ("splitk" if m <= limit else "dequant_cublas"), (tiled, m, chosen)
                assert chosen.x_format == "bf16"  # (no NVFP4 MMA on the CPU)
                assert chosen.mainloop == ("dot" if m <= limit else "")  # (no inline PTX either)


def test_splitk_config_fills_the_gpu():
    for m, n, k in [(1, 4096, 4096), (16, 28672, 8192), (7, 4096, 14336), (1, 64, 16)]:
        for min_steps in (1, gemm_configs.MIN_STEPS_PER_SPLIT):  # the template's, the eager launcher's
            block_m, block_n, block_k, splits, _, _ = gemm_configs.splitk_config(m, n, k, 132,
                                                                                min_steps=min_steps)
            steps = -(-k // block_k)
            assert block_m >= max(16, m) and 1 <= splits <= max(1, steps // min_steps)
            programs = -(-n // block_n) * splits
            assert programs >= min(4 * 132, -(-n // block_n) * (steps // min_steps))


@pytest.mark.parametrize("m", [1, 8, 9, 16, 17, 32])
@pytest.mark.parametrize("n, k", [(4096, 4096), (28672, 4096), (14336, 4096), (4096, 14336), (64, 64)])
def test_register_fed_config(m, n, k):
    """The register-fed mainloop's split rule, eager and template alike: its fixed tile, splits
    that cover K with no empty range and at least its minimum K-steps each, one wave at M = 9..16
    (what fits an SM), and the template's first config splitting K as the eager launcher does."""
    sms = 132
    config = gemm_configs.splitk_config(m, n, k, sms, reg_mma=True)
    block_m, block_n, block_k, splits, warps, stages = config
    assert (block_m, block_n, block_k, warps, stages) == (16 if m <= 16 else 32, 64, 64, gemm_mma.WARPS, 1)
    steps = -(-k // 64)
    min_steps = gemm_configs.REG_MMA_MIN_STEPS[m > 8]
    assert 1 <= splits and (splits == 1 or steps // splits >= min_steps)
    if 8 < m <= 16:
        assert -(-n // 64) * splits <= gemm_configs.REG_MMA_MAX_PER_SM_TWO_B * sms
    kernel = "splitk"
    template = gemm_configs.template_configs(m, n, k, sms, kernel, "mma")[0]
    assert (template.split, template.tiles_per_split) == gemm_configs.split_ranges(k, 64, splits)
    assert template.reg_mma == gemm_configs.reg_mma_blocks(m)
    ranges = gemm_configs.split_ranges(k, 64, splits)
    assert (ranges[0] - 1) * ranges[1] < steps <= ranges[0] * ranges[1]


def test_plan_takes_the_register_fed_mainloop_where_it_runs(sm90):
    """On CUDA: up to plan.MMA_MAX_M rows of row-major weights, plan.MMA_MAX_M_TILED of tiled ones,
    where the operands fit its word loads; tl.dot elsewhere; never on the CPU (inline PTX)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    for tiled, limit in ((False, plan.MMA_MAX_M), (True, plan.MMA_MAX_M_TILED)):
        for m in (1, limit, limit + 1):
            chosen = plan.splitk_mainloop(m, tiled=tiled, x_format="bf16", device=cuda)
            assert chosen == ("mma" if m <= limit else "dot"), (tiled, m)
            assert plan.splitk_mainloop(m, tiled=tiled, x_format="bf16", device=cpu) == "dot"
        assert plan.plan_gemm(1, 4096, 4096, tiled=tiled, activation="bf16", device=cuda,
                              mma_operands_fit=False).mainloop == "dot"
    assert plan.plan_gemm(1, 64, 64, tiled=True, activation="bf16", device=cuda,
                          code_bytes=plan.MMA_MAX_CODE_BYTES).mainloop == "dot"


def test_compiled_plan_above_the_decode_sizes(monkeypatch):
    """Compiled, above plan.SPLITK_MAX_M_TILED rows: the template without split K where it has a
    program per SM up to plan.TEMPLATE_MAX_M rows, else dequantize + cuBLAS."""
    monkeypatch.setattr(capability, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    m = plan.SPLITK_MAX_M_TILED + 1
    chosen = plan.plan_gemm(m, 64 * 132, 4096, tiled=True, activation="bf16", device=cpu, compiled=True)
    assert chosen[:3] == ("tile", "dot", "bf16") and chosen.launch is None
    assert chosen.configs == tuple(gemm_configs.template_configs(m, 64 * 132, 4096, 132, "tile", "dot"))
    assert chosen.configs[0].block_m == plan.TEMPLATE_TILE_M and chosen.configs[0].split == 1
    # dequantize + cuBLAS picked: the template's configs above the decode sizes join it (max-autotune)
    chosen = plan.plan_gemm(m, 64, 4096, tiled=True, activation="bf16", device=cpu, compiled=True)
    assert chosen.kernel == "dequant_cublas" and chosen.configs[0].mainloop == "dot"
    assert chosen.configs == tuple(gemm_configs.template_configs(m, 64, 4096, 132, "tile", "dot"))
    assert plan.plan_gemm(plan.TEMPLATE_MAX_M + 1, 64 * 132, 4096, tiled=True, activation="bf16", device=cpu,
                          compiled=True).kernel == "dequant_cublas"


def test_split_sum_tile():
    """Partials a round of the split sum: 32 at M = 1, 2 at M = 9..16, 8 a thread elsewhere (one
    at M = 8), never more than the splits rounded up to a power of two."""
    assert gemm_configs.split_sum_tile(1, 32, 64, 2) == (1, 32)
    assert gemm_configs.split_sum_tile(1, 10, 64, 2) == (1, 16)
    assert gemm_configs.split_sum_tile(1, 3, 64, 2) == (1, 4)
    assert gemm_configs.split_sum_tile(4, 32, 64, 2) == (4, 2)
    assert gemm_configs.split_sum_tile(8, 32, 64, 2) == (8, 1)
    assert gemm_configs.split_sum_tile(16, 16, 64, 2) == (16, 2)
    assert gemm_configs.split_sum_tile(24, 16, 64, 2) == (32, 1)


@pytest.mark.parametrize("m, n, k, splits", [
    (1, 4096, 4096, 8),    # 64 steps, at least 8 a split
    (1, 14336, 4096, 5),   # 224 tile rows: 8 programs per SM of 132 leave 5 splits
    (8, 4096, 14336, 17),  # 1056 programs over 64 tile rows
])
def test_register_fed_grouped_config(m, n, k, splits):
    """Row-major weights with plain scales at M <= 8 (the grouped k-mapping): fewer, longer splits
    (REG_MMA_GROUPED_PER_SM programs per SM, at least REG_MMA_GROUPED_MIN_STEPS K-steps a split)."""
    config = gemm_configs.splitk_config(m, n, k, 132, reg_mma=True, grouped=True)
    assert config == (16, 64, 64, splits, gemm_mma.WARPS, 1)


def test_plan_takes_the_wgmma_mainloop_on_sm90(monkeypatch, sm90):
    """On sm_90 with tiled weights, from plan.WGMMA_MIN_M to plan.WGMMA_MAX_M rows (W4A16, and W4A4
    on x's quantized values) short of the Hopper GEMM's: the split-K kernel with the wgmma
    mainloop, eager and compiled.
    Not on row-major weights, not where the device has no wgmma (sm_100: asked as such)."""
    monkeypatch.setattr(capability, "sm_count", lambda device: 132)
    cuda = torch.device("cuda")
    for has_wgmma in (True, False):
        monkeypatch.setattr(capability, "wgmma", lambda device: has_wgmma)
        monkeypatch.setattr(capability, "block_scaled_mma", lambda device: False)
        for m in (plan.WGMMA_MIN_M - 1, plan.WGMMA_MIN_M, 64, 65, plan.WGMMA_MAX_M, plan.WGMMA_MAX_M + 1):
            for activation in ("bf16", "nvfp4"):
                for compiled in (False, True):
                    chosen = plan.plan_gemm(m, 4096, 4096, tiled=True, activation=activation, device=cuda,
                                            compiled=compiled)
                    # (from gemm_configs.HOPPER_GEMM_M's first row on, the Hopper GEMM comes first)
                    serves = (has_wgmma and plan.WGMMA_MIN_M <= m <= plan.WGMMA_MAX_M
                              and not gemm_configs.hopper_gemm_planned(m))
                    assert (chosen.mainloop == "wgmma") == serves, (m, activation, compiled, chosen)
                    if serves:
                        assert chosen[:3] == ("splitk", "wgmma", "bf16")
            assert plan.plan_gemm(m, 4096, 4096, tiled=False, activation="bf16", device=cuda).mainloop != "wgmma"


def test_plan_takes_the_hopper_gemm_in_its_rows(monkeypatch, sm90):
    """The Hopper GEMM serves gemm_configs.HOPPER_GEMM_M's rows on sm_90 with tiled weights and a
    bf16 operand (W4A16; W4A4 on x's quantized values), eager and compiled, with
    plan.hopper_launch's launch (register A); nowhere else (row-major weights, no wgmma)."""
    first, last = gemm_configs.HOPPER_GEMM_M
    cuda = torch.device("cuda")
    for has_wgmma in (True, False):
        monkeypatch.setattr(capability, "wgmma", lambda device: has_wgmma)
        for m in (first - 1, first, 200, last, last + 1):
            serves = has_wgmma and first <= m <= last
            for activation in ("bf16", "nvfp4"):
                for compiled in (False, True):
                    chosen = plan.plan_gemm(m, 4096, 4096, tiled=True, activation=activation, device=cuda,
                                            compiled=compiled)
                    assert (chosen.kernel == "hopper") == serves, (m, activation, compiled, chosen)
                    if serves:
                        assert chosen == ("hopper", "", "bf16", plan.hopper_launch(m, 4096, 4096, cuda), ())
                        assert chosen.launch.config.register_a
            assert plan.plan_gemm(m, 4096, 4096, tiled=False, activation="bf16", device=cuda).kernel != "hopper"
    # a Triton whose Gluon is not the API the kernel is written against: the other paths
    monkeypatch.setattr(capability, "wgmma", lambda device: True)
    monkeypatch.setattr(capability, "gluon_hopper", lambda: False)
    assert plan.plan_gemm(first, 4096, 4096, tiled=True, activation="bf16", device=cuda).kernel != "hopper"


def test_gluon_hopper_names_the_triton_it_is_written_for(monkeypatch):
    """capability.gluon_hopper: Triton 3.6 only."""
    import triton

    for version, expected in (("3.6.0", True), ("3.6.1", True), ("3.7.0", False), ("3.5.1", False)):
        monkeypatch.setattr(triton, "__version__", version)
        capability.gluon_hopper.cache_clear()
        assert capability.gluon_hopper() is expected, version
    capability.gluon_hopper.cache_clear()


@pytest.mark.parametrize("m, n, k, rows, block_t", [
    (128, 4096, 4096, 64, 128),      # a small weight: 64 rows a program
    (128, 14336, 4096, 128, 128),
    (256, 4096, 14336, 128, 128),
    (257, 4096, 4096, 64, 256),
    (512, 28672, 8192, 64, 256),
])
def test_hopper_config(m, n, k, rows, block_t):
    """The planned tiles: register A in K-steps of 64; 128 weight rows by 128 tokens up to 256
    rows of x (64 rows on a small weight), 64 by 256 above."""
    config = gemm_configs.hopper_config(m, n, k)
    assert (config.rows, config.block_t, config.block_k, config.register_a) == (rows, block_t, 64, True)
    assert not gemm_configs.hopper_config(m, n, k, tiled=False).register_a


def test_hopper_launch_refuses_what_register_a_cannot_read():
    """Register A reads the tiled layout in K-steps of 64 only."""
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="register A"):
        plan.hopper_launch(128, 4096, 4096, cuda, gemm_configs.HOPPER_SMALL_CONFIG, 1, tiled=False)
    with pytest.raises(ValueError, match="register A"):
        plan.hopper_launch(128, 4096, 4096, cuda, gemm_configs.HOPPER_SMALL_CONFIG._replace(block_k=128), 1)


@pytest.mark.parametrize("m, n, k, splits", [
    (64, 4096, 4096, 2),     # 64 output tiles on 132 SMs: K in two
    (64, 14336, 4096, 1),    # 224 tiles
    (40, 4096, 14336, 2),
    (128, 4096, 4096, 1),    # two blocks of rows: never split (the split sum holds all rows)
    (64, 64, 128, 1),        # one K-step
])
def test_wgmma_config(m, n, k, splits):
    """The wgmma mainloop's config: its fixed tile, K cut in two only where the output tiles are
    fewer than the SMs and all rows fit one block; the template's configs split alike."""
    block_m, block_n, block_k, got, warps, stages = gemm_configs.wgmma_config(m, n, k, 132)
    assert (block_m, block_k, warps, stages) == gemm_configs.WGMMA_CONFIG and block_n == 64
    assert got == splits
    configs = gemm_configs.template_configs(m, n, k, 132, "splitk", "wgmma")
    assert all(c.mainloop == "wgmma" and c.split == splits and (c.block_m, c.block_k) == (64, 128) for c in configs)
    assert all(c.split == 1 or c.block_m >= m for c in configs)


@pytest.mark.parametrize("case, m, k, expect", [
    ("plain", 1, 1024, dict(reg_mma=1, layout="grouped", even=True)),    # a scale word per 4 K-tiles
    ("plain", 5, 1040, dict(reg_mma=1, layout="row_major", even=False)),  # K % 64 != 0: scale bytes
    ("plain", 12, 1024, dict(reg_mma=2, layout="row_major")),             # grouped only at M <= 8
    ("plain", 24, 1024, dict(reg_mma=4, block_m=32)),                     # four x-row blocks
    ("swizzled", 1, 1024, dict(reg_mma=1, layout="swizzled")),
    ("odd-scales", 1, 1024, dict(reg_mma=1, layout="row_major")),        # scales 1 byte off a word
    ("odd-rows", 1, 1024, dict(mainloop="dot", reg_mma=0)),               # code rows off 8 bytes: tl.dot
    ("tiled", 16, 1024, dict(reg_mma=2, layout="tiled")),
    ("tiled", 24, 1024, dict(mainloop="dot", reg_mma=0, layout="tiled", block_m=32)),  # tiled M > 16
])
def test_splitk_launch_by_layout_and_rows(case, m, k, expect, sm90):
    """The split-K launch the plan makes for the operands as they are (layout, alignments) and M,
    asked as for an H100; the GPU tests run each choice."""
    n = 128
    w = nv.quantize(torch.randn(n, k), swizzle=case == "swizzled")
    data, scale, tiled_n = w.data, w.scale.view(torch.uint8), None
    if case == "tiled":
        (data, scale), tiled_n = nv_tiled.tile(data, scale), n
    elif case == "odd-scales":
        scale = torch.empty(scale.numel() + 1, dtype=torch.uint8)[1:].view(scale.shape).copy_(scale)
    elif case == "odd-rows":
        data = torch.empty(data.numel() + 4, dtype=torch.uint8)[4:].view(data.shape).copy_(data)
    x = torch.randn(m, k).to(torch.bfloat16)
    chosen = plan.plan_gemm(m, n, k, tiled=tiled_n is not None, activation="bf16", device=sm90,
                            mma_operands_fit=plan.mma_operands_aligned(x, data, scale, tiled_n is not None),
                            code_bytes=data.numel(), swizzled=case == "swizzled",
                            scale_word_aligned=scale.data_ptr() % 4 == 0)
    launch = chosen.launch
    assert {key: getattr(launch, key) for key in expect} == expect
    assert launch.mainloop == ("mma" if launch.reg_mma else "dot")
    if launch.layout == "grouped":  # splits cover whole groups of 4 K-tiles, counted as 4 * cdiv(K, 256)
        assert launch.steps_per_split % 4 == 0
        assert launch.splits == -(-(-(-k // 256) * 4) // launch.steps_per_split)
        assert launch.steps_per_split >= gemm_configs.REG_MMA_GROUPED_MIN_STEPS  # the grouped split rule
    else:
        assert launch.splits == -(-(-(-k // 64)) // launch.steps_per_split)
    assert launch.grid == (-(-n // 64), launch.splits, 1) and launch.tiles == -(-n // 64)


def test_grouped_plan_by_rows_an_expert(sm90):
    """The grouped GEMM's launch by the rows an expert gets on average, asked as for an H100: the
    register-fed mainloop at decode (K split: few experts hit), wgmma for serving batches, the
    dequantize form above; tl.dot under the interpreter; the block-scaled MMA on x's codes."""
    e, n_pad, k = 8, 128, 1024
    mma = plan.plan_grouped(8, e, n_pad, k, device=sm90)
    assert mma.mainloop == "mma" and mma.reg_mma == plan.grouped_mma_blocks(8, e) == 1
    assert (mma.block_m, mma.block_n, mma.block_k, mma.num_warps, mma.acc_m) == (8, 64, 64, 2, 16)
    assert mma.splits == 4 and mma.splits * mma.steps_per_split == k // 64
    assert (mma.m_tiles, mma.n_tiles) == (plan.grouped_row_tiles(8, e, 8), 2)
    assert plan.plan_grouped(8, e, n_pad, k, device=sm90, mma_operands_fit=False).mainloop == "wgmma"
    wgmma = plan.plan_grouped(40 * e, e, n_pad, k, device=sm90)
    assert wgmma.mainloop == "wgmma" and (wgmma.block_m, wgmma.splits) == (64, 1)
    assert wgmma.num_stages == gemm_configs.WGMMA_CONFIG[3]
    assert plan.plan_grouped(200 * e, e, n_pad, k, device=sm90).mainloop == ""  # dequantize form
    interpreted = plan.plan_grouped(8, e, n_pad, k, device=torch.device("cpu"))
    assert interpreted.mainloop == "dot" and interpreted[1:4] == gemm_configs.GROUPED_INTERPRET_CONFIG[:3]
    codes = plan.plan_grouped(8, e, 256, k, device=sm90, x_codes=True)
    assert codes.mainloop == "dot_scaled" and (codes.block_n, codes.block_k) == (128, 128)
    with pytest.raises(ValueError, match="dequantize form"):
        plan.plan_grouped(8, e, 256, k, device=sm90, x_codes=True, dequant=True)

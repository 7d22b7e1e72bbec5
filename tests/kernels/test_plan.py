"""kernels/plan.py and kernels/gemm_configs.py: which GEMM and which mainloop serve a linear (by
rows, weight layout, device; eager or compiled), and the invariants of the split-K configs (tiles,
splits, the split sum's rounds). Asked as for a GPU where it matters; nothing is launched."""

import pytest
import torch

from nvfp4_inductor import capability
from nvfp4_inductor.kernels import gemm_configs, gemm_mma, plan


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


def test_plan_takes_the_register_fed_mainloop_where_it_runs():
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
    assert plan.plan_gemm(m, 64 * 132, 4096, tiled=True, activation="bf16", device=cpu,
                          compiled=True) == ("tile", "dot", "bf16")
    assert plan.plan_gemm(m, 64, 4096, tiled=True, activation="bf16", device=cpu, compiled=True).kernel \
        == "dequant_cublas"
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


def test_plan_takes_the_wgmma_mainloop_on_sm90(monkeypatch):
    """On sm_90 with tiled weights, from plan.WGMMA_MIN_M to plan.WGMMA_MAX_M rows (W4A16, and W4A4
    on x's quantized values): the split-K kernel with the wgmma mainloop, eager and compiled.
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
                    serves = has_wgmma and plan.WGMMA_MIN_M <= m <= plan.WGMMA_MAX_M
                    assert (chosen.mainloop == "wgmma") == serves, (m, activation, compiled, chosen)
                    if serves:
                        assert chosen == ("splitk", "wgmma", "bf16")
            assert plan.plan_gemm(m, 4096, 4096, tiled=False, activation="bf16", device=cuda).mainloop != "wgmma"


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
    assert all(c.wgmma and c.split == splits and (c.block_m, c.block_k) == (64, 128) for c in configs)
    assert all(c.split == 1 or c.block_m >= m for c in configs)

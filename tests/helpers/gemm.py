"""Shared by the split-K GEMM tests."""

from nvfp4_inductor.kernels import gemm_configs


def pin_splitk_config(monkeypatch, config):
    """The split-K launcher with this (BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages) config."""
    from nvfp4_inductor.kernels import gemm_splitk

    gemm_splitk._launch_setup.cache_clear()  # (set-ups cached under the real tables)
    monkeypatch.setattr(gemm_configs, "splitk_config", lambda *args, **kwargs: config)

"""Shared by the split-K GEMM tests."""

from nvfp4_inductor.kernels import gemm_configs, plan

# a line of the NVFP4 GEMM template's kernel source (templates/nvfp4_tiled_gemm.py.jinja): in a
# compiled graph's code where a linear became the template
TEMPLATE_MARK = "from nvfp4_inductor.kernels.device.mainloops import MAINLOOP_WGMMA, mainloop"


def pin_splitk_config(monkeypatch, config):
    """The split-K launcher with this (BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages) config."""
    plan.splitk_launch.cache_clear()  # (launches cached under the real tables)
    monkeypatch.setattr(gemm_configs, "splitk_config", lambda *args, **kwargs: config)


def splitk(x, w_data, w_scale, w_global_scale, bias, out_dtype, swizzled, tiled_n=None, x_scale=None, mainloop=None):
    """gemm_splitk.gemm_splitk with the planner's launch for these operands, its mainloop the one
    given (plan.splitk_launch checks that it can run)."""
    from nvfp4_inductor.kernels import gemm_splitk

    launch = plan.splitk_launch_for(x, w_data, w_scale, swizzled=swizzled, tiled_n=tiled_n,
                                    x_format="bf16" if x_scale is None else "nvfp4", mainloop=mainloop)
    return gemm_splitk.gemm_splitk(x, w_data, w_scale, w_global_scale, bias, out_dtype, swizzled, tiled_n=tiled_n,
                                   x_scale=x_scale, launch=launch)


def hopper_forms() -> list:
    """(config, tiled weights) of the Hopper GEMM (kernels/hopper_gemm.py) that the package ships:
    the warp-specialized configs on both layouts, the planned register-A ones on the tiled layout
    (the only one it reads)."""
    ws = sorted({config for _, config in gemm_configs.HOPPER_WS_CONFIGS})
    register_a = sorted({config for _, config in gemm_configs.HOPPER_CONFIGS} | {gemm_configs.HOPPER_SMALL_CONFIG})
    return [(config, tiled) for config in ws for tiled in (False, True)] + [(config, True) for config in register_a]

"""Inductor lowering of nvfp4::linear_tiled (what backend="nvfp4" puts in place of a BF16 linear).

    y = nvfp4.linear_tiled(x, W_data, W_scale, g, bias, N, "bf16")
      -> P = nvfp4_tiled_gemm(x2, W_data, W_scale)          a TritonTemplate (or an extern choice)
         y = (P * g + bias).to(x.dtype)                      Inductor IR: fused, see below
    y = nvfp4.linear_tiled(x, W_data, W_scale, g, bias, N, "nvfp4")          (W4A4)
      -> x_values, x_global_scale = nvfp4.quantize_values(x2)        its eager kernel: e2m1 * s_x in bf16
         P = nvfp4_tiled_gemm(x_values, W_data, W_scale)          the W4A16 template
         y = (P * (g * x_global_scale) + bias).to(x.dtype)
    On sm_100 W4A4 keeps x as NVFP4 for the block-scaled MMA instead:
      -> x_data, x_scale, x_global_scale = nvfp4.quantize(x2, None, False, False)
         P = nvfp4_tiled_gemm(x_data, x_scale, W_data, W_scale)          (DOT_SCALED)

The template (templates/nvfp4_tiled_gemm.py.jinja) runs the eager skinny kernel's mainloop and
stores the fp32 products P (M, N) with the block scales applied. The rest of the linear is plain
IR, so Inductor fuses it with whatever follows (activation, residual add, dtype cast) into the
template's store (store_output): one kernel for GEMM + bias + GELU + residual. At decode (M <= 64)
the template splits K (the weight stream needs ~8 programs per SM): each program stores partial
sums to a workspace, and the last split of each output tile sums them and runs that epilogue, so
this is one kernel too (no separate reduction over the partials).
The fp32 operation order is the eager kernels': ((sum * 2^7) * g + bias), then one rounding.

A deferred RMSNorm (norm_h, W4A16 at decode: passes/norms.py) is applied by the template, which
reads h's rows whole (the last split of each tile, or each program when K is not split: the
template's RMS); where plan.norm_in_template says it cannot (rows, the program's BLOCK_M when K
is not split, times K above gemm_configs.RMS_MAX_ELEMENTS) the op runs eagerly.

Choices: the template with the configs plan.plan_gemm returns, and where the output is
(M, N) on CUDA an extern choice (dequantize + cuBLAS, the eager op's path for large M). Where the
extern choice is the pick (not autotuned against the template, so it need not return the fp32
products), it returns the linear's output itself: one cuBLASLt GEMM that reads the global scale
(W4A4: g * x_global_scale) on the device as alpha and adds the bias (kernels/cublaslt.py). By default
the pick of kernels/plan.py (the template where it splits K, or up to plan.TEMPLATE_MAX_M rows
with a program per SM); under mode="max-autotune" all of them. Where plan.py picks the Hopper
GEMM (sm_90, the M ranges it measured fastest in), the op's CUDA implementation runs it, epilogue
included. Where the
template does not apply (a dynamic M, a non-CUDA device unless Inductor's CPU backend is Triton)
the op stays the eager custom op (also for an empty x).
"""

import math

import sympy
import torch
from torch._inductor import ir
from torch._inductor.virtualized import V
from torch._inductor.lowering import (
    fallback_handler,
    lowerings,
    register_lowering,
    to_dtype,
)
from torch._inductor.select_algorithm import (
    ExternKernelChoice,
    SymbolicGridFn,
    TritonTemplate,
    autotune_select_algorithm,
    realize_inputs,
)

from nvfp4_inductor import capability, templates
from nvfp4_inductor.kernels import gemm as eager_gemm, plan
from nvfp4_inductor.kernels.device.mainloops import MAINLOOPS
from nvfp4_inductor.lowerings import compat as _compat
from nvfp4_inductor.reference import tiled

aten = torch.ops.aten
OP = torch.ops.nvfp4.linear_tiled.default
SILU_MUL_OP = torch.ops.nvfp4.linear_tiled_silu_mul.default
_TL_DTYPES = {torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16", torch.float32: "tl.float32"}


def load_template(name: str) -> str:
    """The Jinja source of templates/<name>.py.jinja (template bodies live in files named after
    the template)."""
    return templates.source(f"{name}.py.jinja")


@SymbolicGridFn
def _grid(m, n, meta, *, cdiv):
    mainloop = "wgmma" if meta.get("MAINLOOP") == MAINLOOPS["wgmma"] else ""
    return plan.splitk_grid(mainloop, cdiv(m, meta["BLOCK_M"]), meta["SPLIT"], cdiv(n, meta["BLOCK_N"]))


tiled_gemm_template = TritonTemplate(name="nvfp4_tiled_gemm", grid=_grid,
                                     source=load_template("nvfp4_tiled_gemm"))


def mm_tiled_f32(x, w_data, w_scale, n):
    """The extern choice: x (M, K) @ (e2m1 * block scale)^T in fp32, W tiled (dequantize + cuBLAS)."""
    return eager_gemm.mm_tiled_f32(x, w_data, w_scale, n)


def mm_tiled_f32_x4(x_data, x_scale, w_data, w_scale, n):
    """The same for W4A4: x as NVFP4 codes + plain scale bits, decoded without its global scale."""
    from nvfp4_inductor.kernels.dequantize import dequantize

    return eager_gemm.mm_tiled_f32(dequantize(x_data, x_scale, None, False, torch.bfloat16), w_data, w_scale, n)


def scaled_mm_tiled(x, w_data, w_scale, w_global_scale, bias=None, *, n, out_dtype):
    """The extern choice where it is the only one: (M, N) out_dtype = g * (x @ (e2m1 * block
    scale)^T) + bias, the global scale g read on the device by one cuBLASLt GEMM (kernels/gemm.py)."""
    return eager_gemm.scaled_mm_tiled(x, w_data, w_scale, w_global_scale, bias, n, out_dtype)


extern_mm_tiled_f32 = ExternKernelChoice(mm_tiled_f32, name="nvfp4_mm_tiled_f32", has_out_variant=False)
extern_scaled_mm_tiled = ExternKernelChoice(scaled_mm_tiled, name="nvfp4_scaled_mm_tiled",
                                            has_out_variant=False)
extern_mm_tiled_f32_x4 = ExternKernelChoice(mm_tiled_f32_x4, name="nvfp4_mm_tiled_f32_x4",
                                            has_out_variant=False)
# The split-K template's tile counters, int32 zeros a tile that each kernel leaves zeroed (the last
# split of a tile resets its counter). A graph allocates them itself, one buffer a device filled
# with zeros once a call, shared by all its split-K templates there: they run in order on the
# graph's stream, each after the last one's writes (each one mutates the buffer). Two compiled
# graphs, or one called from two threads, each get their own, whatever streams they run on.
_GRAPH_COUNTERS = "nvfp4_split_counters"  # V.graph's attribute: device -> the buffer


def _graph_tiles(device) -> int:
    """The most output tiles a split-K template of the graph being lowered may count on device: its
    nvfp4 linears' weight rows (a gated MLP's: twice its output's width) over the narrowest tile."""
    most = 0
    for op, rows in ((OP, 1), (SILU_MUL_OP, 2)):
        for node in V.graph.module.graph.find_nodes(op="call_function", target=op):
            y = node.meta.get("val")
            if isinstance(y, torch.Tensor) and y.device == device and isinstance(y.shape[-1], int):
                most = max(most, -(-rows * y.shape[-1] // tiled.TILE_N))
    return most


def _split_counters(device, tiles: int):
    """The graph's tile counters on device (a realized full([size], 0) int32 buffer), at least
    `tiles` of them. The first split-K template of a graph makes them, sized for every linear of
    the graph (_graph_tiles): one fill kernel a call. (A template wanting more than that, which the
    configs' tiles of at least TILE_N rows rule out, gets a larger buffer, which later ones share.)"""
    made = getattr(V.graph, _GRAPH_COUNTERS, None)
    if made is None:
        made = {}
        setattr(V.graph, _GRAPH_COUNTERS, made)
    counters = made.get(device)
    if counters is None or int(counters.get_numel()) < tiles:
        size = max(tiles, _graph_tiles(device))
        counters = lowerings[aten.full.default]([size], 0, dtype=torch.int32, device=device)
        counters.realize()
        made[device] = counters = realize_inputs(counters)
    return counters

QUANTIZE = torch.ops.nvfp4.quantize.default
QUANTIZE_VALUES = torch.ops.nvfp4.quantize_values.default


def _uses_template(x) -> bool:
    """A device Inductor emits Triton for, static sizes, at least one row."""
    sizes = x.get_size()
    static = all(isinstance(s, int) or getattr(s, "is_number", False) for s in sizes)
    return capability.template_device(x.get_device()) and static and all(int(s) > 0 for s in sizes)


def _unit_k_stride(x):
    """x (M, K) in row-major order (K's stride 1, any row stride), as the template's mainloops
    read x's rows: a column-major x (a transposed view, or a copy Inductor lays out like one) would
    be read as if row-major. A flexible layout is frozen so, a fixed one copied."""
    if x.get_stride()[-1] == 1 and not isinstance(x.get_layout(), ir.FlexibleLayout):
        return x
    return ir.ExternKernel.require_stride_order(x, [1, 0])


def _even_rows(x) -> bool:
    """x's rows start at even element offsets (a static layout): 4-byte aligned bf16 pairs."""
    layout = x.get_layout()
    stride, offset = layout.stride[0], layout.offset
    # Static strides and offsets are ints or sympy Integers: a buffer computed in the graph (a norm's
    # output) has the latter. (Checking for int alone would send every such x to tl.dot.)
    static = all(isinstance(v, (int, sympy.Integer)) for v in (stride, offset))
    return static and int(stride) % 2 == 0 and int(offset) % 2 == 0


def _pdl_mode(device, w_data, w_scale) -> int:
    """The most the template's PDL may be (see the template): 0 without programmatic dependent
    launch (off in Inductor's config, not CUDA sm_90+, or no launch options in this torch); 2 where
    the weights are frozen (graph constants, which no kernel of the graph writes: the register-fed
    mainloop loads their first tile before the wait); 1 otherwise (the wait comes first)."""
    if not (device.type == "cuda" and _compat.pdl_enabled() and _compat.template_launch_options()
            and capability.sm90_or_later(device)):
        return 0
    return 2 if all(node.get_name() in V.graph.constants for node in (w_data, w_scale)) else 1


def lower_linear_tiled(x, w_data, w_scale, w_global_scale, bias, n, activation, norm_h=None, norm_eps=0.0,
                       silu_mul=False, x_global_scale=None):
    """silu_mul: nvfp4.linear_tiled_silu_mul (with its x_global_scale), n = 2 x its output width: the
    template's epilogue takes silu(gate) * up from each tile's 32 gate and 32 up rows and stores
    (M, n / 2) itself. norm_h: a deferred RMSNorm (the op's docstring), applied by the template
    where it reads h's rows whole (plan.norm_in_template), else the eager op."""
    op_args = (x, w_data, w_scale, w_global_scale, *((x_global_scale, n // 2) if silu_mul else (bias, n)),
               activation, norm_h, norm_eps)  # the op's own arguments, as called

    def eager_op():
        return fallback_handler(SILU_MUL_OP if silu_mul else OP, add_to_fallback_set=False)(*op_args)

    dot_scaled = plan.x_format(activation, x.get_device()) == "nvfp4"
    if not _uses_template(x) or (silu_mul and dot_scaled):
        return eager_op()
    *lead, k = (int(s) for s in x.get_size())
    m = math.prod(lead)
    # a deferred norm: W4A16, the template reading h's rows whole
    if norm_h is not None and not plan.norm_in_template(m, k, activation):
        return eager_op()
    x2 = lowerings[aten.view.default](x, [m, k])
    device = x.get_device()
    # W4A4 on sm_100: x stays NVFP4 for the block-scaled MMA (tl.dot_scaled); elsewhere x's
    # quantized values multiply in bf16, so W4A4 runs the W4A16 template on them (measured faster
    # than decoding x's codes in every program: docs/gemm.md).
    if dot_scaled:
        quantize = fallback_handler(QUANTIZE, add_to_fallback_set=False)
        x_data, x_scale, x_global_scale = quantize(x2, None, False, False)
        inputs = realize_inputs(x_data, x_scale, w_data, w_scale)
        extern_choice = extern_mm_tiled_f32_x4
    else:
        if activation == "nvfp4":
            x2, x_global_scale = fallback_handler(QUANTIZE_VALUES, add_to_fallback_set=False)(x2)
        elif x2.get_dtype() != torch.bfloat16:
            # W4A16 multiplies x rounded to bf16; the register-fed mainloop reads x's words as bf16
            # pairs (an fp16 x read so would come out inf)
            x2 = to_dtype(x2, torch.bfloat16)
        x2 = _unit_k_stride(realize_inputs(x2))
        inputs = realize_inputs(x2, w_data, w_scale)
        extern_choice = extern_mm_tiled_f32
    if activation == "nvfp4" and not silu_mul:  # (the SiLU * up template multiplies them itself)
        w_global_scale = lowerings[aten.mul.Tensor](w_global_scale, x_global_scale)  # the eager kernels' order
    # the register-fed mainloop reads x's rows as 32-bit words: even row stride and offset (a
    # flexible layout is contiguous until the template freezes it; forcing one would copy x)
    chosen = plan.plan_gemm(m, n, k, tiled=True, activation=activation, device=device, compiled=True,
                            mma_operands_fit=_even_rows(inputs[0]), code_bytes=int(w_data.get_numel()))
    if chosen.kernel == "hopper":  # the Gluon kernel, with its epilogue: the op's CUDA implementation
        return eager_op()
    # (dequantize + cuBLAS as the pick: the template's configs still join under max-autotune)
    configs = list(chosen.configs)
    split = configs[0].split
    if norm_h is not None and not plan.norm_in_template(m, k, activation, configs):
        return eager_op()
    # where dequantize + cuBLAS may win (M > 64); it does not apply a deferred norm
    extern = split == 1 and device.type == "cuda" and not silu_mul and norm_h is None
    if not _compat.max_autotune():  # the plan's pick alone
        template = not extern or chosen.kernel != "dequant_cublas"
        configs = configs[:1] if template else []
        extern = not template
    if extern and not configs and device.type == "cuda" and not dot_scaled:
        # The extern choice alone (prefill): cuBLASLt reads g (W4A4: the scales' product) from
        # the device as alpha and adds the bias, x's dtype out; no fp32 (M, N) product for an
        # epilogue kernel to read. (A frozen weight's g is a named constant, never a literal
        # alpha: the FX graph cache binds such constants anew, not literals; backend.py.)
        inputs = realize_inputs(x2, w_data, w_scale, w_global_scale, *([bias] if bias is not None else []))
        y = extern_scaled_mm_tiled.bind(inputs, ir.FixedLayout(device, x.get_dtype(), [m, n]), n=n,
                                        out_dtype=x.get_dtype()).output_node()
        return lowerings[aten.view.default](y, [*lead, n])
    layout = ir.FixedLayout(device, torch.float32, [m, n])
    use_asm = device.type == "cuda"  # inline PTX decode; the CPU backend decodes with plain ops
    extra, input_gen_fns = {"SILU_MUL": silu_mul, "RMS": norm_h is not None, "NORM_EPS": float(norm_eps),
                            "RMS_SPAN": 1 << (k - 1).bit_length()}, None
    pdl = _pdl_mode(device, w_data, w_scale)
    if pdl:
        extra["triton_meta"] = {"launch_pdl": True}
    if silu_mul:  # the global scales go in (the epilogue rounds each linear), the output is final
        inputs.append(realize_inputs(w_global_scale))
        extra["HAS_GX"] = x_global_scale is not None
        if x_global_scale is not None:
            inputs.append(realize_inputs(x_global_scale))
        layout = ir.FixedLayout(device, x.get_dtype(), [m, n // 2])
        extra["OUT_DTYPE"] = _TL_DTYPES[x.get_dtype()]
        assert all(c.block_n % (2 * tiled.GATED_GROUP) == 0 for c in configs), configs
    if norm_h is not None:  # the norm's input h, unit column stride (the residual stream: no copy)
        inputs.append(ir.ExternKernel.require_stride1(realize_inputs(
            lowerings[aten.view.default](norm_h, [m, k]))))
    if split > 1:
        # split K: partials in a workspace, the last split of each tile sums them (the template's
        # docstring); every choice splits alike, all rows in one program
        assert all(c.split == split and c.block_m >= m for c in configs), configs
        extra["workspace_arg"] = _compat.scratch_workspace(device, split * m * n, torch.float32)
        counters = _split_counters(device, -(-n // configs[0].block_n))
        inputs.append(counters)
        extra["mutated_inputs"] = [counters]  # orders the templates sharing them
        # (autotuning benchmarks the choices on random inputs: zeros for the counters)
        input_gen_fns = {len(inputs) - 1: lambda node: torch.zeros(
            [int(s) for s in node.get_size()], dtype=torch.int32, device=node.get_device())}
    choices = []
    for c in configs:
        if split > 1:
            extra["SUM_ROWS"], extra["SUM_SPLITS"] = c.sum_rows, c.sum_splits
        tiled_gemm_template.maybe_append_choice(
            choices, input_nodes=inputs, layout=layout, num_stages=c.num_stages,
            num_warps=c.num_warps, call_sizes=[m, n], HALF_N=c.block_n // 2,
            SPLIT=c.split, TILES_PER_SPLIT=c.tiles_per_split, N=n, BLOCK_M=c.block_m,
            BLOCK_N=c.block_n, BLOCK_K=c.block_k, EVEN=k % c.block_k == 0, USE_ASM=use_asm,
            MAINLOOP=MAINLOOPS[c.mainloop], REG_MMA=c.reg_mma, PDL=min(pdl, 2 if c.reg_mma else 1),
            OPERAND="tl.bfloat16" if use_asm else "tl.float32", DOT_SCALED=dot_scaled,
            UNSCALE=1.0 if dot_scaled else 2.0**7, **extra)
    if extern:
        choices.append(extern_choice.bind(inputs, layout, n=n))
    products = _compat.selected_node(autotune_select_algorithm(
        "nvfp4_tiled_gemm", choices, list(inputs), layout, input_gen_fns=input_gen_fns))
    if silu_mul:
        return lowerings[aten.view.default](products, [*lead, n // 2])
    y = lowerings[aten.mul.Tensor](products, w_global_scale)
    if bias is not None:
        y = lowerings[aten.add.Tensor](y, to_dtype(bias, torch.float32))
    y = to_dtype(y, x.get_dtype())
    # A buffer of its own, (m, n) like the template's product: the scheduler fuses it into the
    # template's store (and a consumer's pointwise ops after it, dropping the store when nothing
    # else reads it). Left a pointwise node, a consumer that needs a fixed layout (attention on
    # q / k / v sliced from a merged GEMM) would copy it out in a kernel of its own, the template
    # storing fp32 for it.
    y.realize()
    return lowerings[aten.view.default](y, [*lead, n])


_registered = False


def register() -> None:
    """Install the lowering (idempotent; backend="nvfp4" calls it before compiling)."""
    global _registered
    if not _registered:
        register_lowering(OP, type_promotion_kind=None)(lower_linear_tiled)
        register_lowering(SILU_MUL_OP, type_promotion_kind=None)(
            lambda x, w_data, w_scale, w_global_scale, x_global_scale, n, activation, norm_h=None, norm_eps=0.0:
            lower_linear_tiled(x, w_data, w_scale, w_global_scale, None, 2 * n, activation, norm_h, norm_eps,
                               silu_mul=True, x_global_scale=x_global_scale))
        _registered = True

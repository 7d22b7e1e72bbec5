"""Compile every Triton kernel variant the launchers use for a GPU target, without a GPU.

Run as a script (in a process without TRITON_INTERPRET, which turns kernels into interpreted
functions): prints one JSON object per case, {"case", "ok", "error", "ptx_checks"}.
    python tests/helpers/compile_kernels.py [sm]
"""

import itertools
import json
import os
import re
import sys

assert "TRITON_INTERPRET" not in os.environ, "compile without the interpreter"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from nvfp4_inductor.kernels import dequantize as dk  # noqa: E402
from nvfp4_inductor.kernels import gemm_configs  # noqa: E402
from nvfp4_inductor.kernels import gemm_splitk as sk  # noqa: E402
from nvfp4_inductor.kernels import kv_cache as kv  # noqa: E402
from nvfp4_inductor.kernels import quantize as qk  # noqa: E402
from nvfp4_inductor.kernels.device.common import LAYOUTS  # noqa: E402
from nvfp4_inductor.kernels.device.mainloops import MAINLOOPS  # noqa: E402
from nvfp4_inductor.kernels.device.mma import mma_mainloop  # noqa: E402

# What the JIT specializes at launch: pointers and these integer sizes divisible by 16.
DIVISIBLE = {"K", "stride_xm", "stride_xm_pairs", "scale_cols_pad"}
DTYPES = ["bf16", "fp16", "fp32"]
LOAD_16B = r"ld\.global(\.\w+)*\.v(4\.b32|2\.b64|4\.f32|8\.b16)"  # 16-byte vector loads
STORE_16B = r"st\.global(\.\w+)*\.v4\.b32"  # 16-byte vector stores (quantize_values' bf16 values)
NO_FLOAT_TO_INT = r"!cvt\.rzi"  # values stored as bf16, not converted (a u8 output pointer did that)
# launched with PDL (the quantize kernel on sm_90): wait before any global access, release the next
PDL_WAIT_FIRST = [r"(?s)^(?:(?!(ld|st)\.global).)*griddepcontrol\.wait", r"griddepcontrol\.launch_dependents"]

QUANTIZE_SIGNATURE = {
    "x_ptr": None, "data_ptr": "*u8", "scale_ptr": "*u8", "g_in_ptr": "*fp32", "g_out_ptr": "*fp32",
    "partials_ptr": "*fp32", "w_ptr": "*fp32", "M": "i32", "K": "i32", "num_partials": "i32",
    "scale_rows_pad": "i32", "scale_cols_pad": "i32", "stride_xm": "i32",
    "stride_xm_pairs": "i32", "eps": "fp32",
    **{name: "constexpr" for name in ("GLOBAL", "WRITE_G", "SWIZZLE", "VALUES", "USE_ASM", "OPERAND",
                                      "BLOCK_M", "BLOCK_K", "FUSED_M", "FUSED_K", "PARTIALS_BLOCK",
                                      "NORM", "PDL")},
}
AMAX_SIGNATURE = {"x_ptr": None, "partials_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32",
                  "num_programs": "i32", "BLOCK_M": "constexpr", "BLOCK_K": "constexpr",
                  "PDL": "constexpr"}
ROW_G_SIGNATURE = {"x_ptr": None, "g_ptr": "*fp32", "M": "i32", "K": "i32", "stride_xm": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_K": "constexpr"}
DEQUANTIZE_SIGNATURE = {
    "data_ptr": "*u8", "scale_ptr": "*u8", "g_ptr": "*fp32", "index_ptr": "*i64", "out_ptr": None,
    "M": "i32", "K": "i32", "src_rows": "i32", "scale_cols_pad": "i32",
    **{name: "constexpr" for name in ("PER_ROW", "HAS_G", "SWIZZLE", "GATHER", "TILED", "BLOCK_M",
                                      "BLOCK_K")},
}


SPLITK_SIGNATURE = {
    "x_ptr": "*bf16", "x_scale_ptr": "*u8", "w_ptr": "*u8", "w_scale_ptr": "*u8", "w_global_scale_ptr": "*fp32",
    "bias_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "counter_ptr": "*i32", "M": "i32",
    "N": "i32", "K": "i32",
    "w_scale_cols": "i32", "tiles_per_split": "i32", "stride_xm": "i32", "stride_om": "i32",
    **{name: "constexpr" for name in ("MAINLOOP", "LAYOUT", "W_GLOBAL_SCALE_PER_ROW", "HAS_BIAS", "SPLIT",
                                      "USE_ASM", "OPERAND", "EVEN", "REG_MMA", "UNSCALE", "BLOCK_M", "BLOCK_N",
                                      "BLOCK_K", "SUM_ROWS", "SUM_SPLITS", "PDL")},
}
MMA_SYNC_BF16 = r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32"
WORD_DECODE = r"mul\.rn\.bf16x2"  # the inline-PTX decode made it into the kernel
# NVFP4: scale_vec::4X is one scale per 16 elements (NVFP4's block; 2X is MXFP4's 32)
TCGEN05_BLOCK_SCALE = r"tcgen05\.mma\.cta_group::1\.kind::mxf4nvf4\.block_scale\.scale_vec::4X"
# sm_120 (consumer Blackwell) has no tcgen05: its block-scaled MMA is a warp-level mma.sync
MMA_SYNC_BLOCK_SCALE = r"mma\.sync\.aligned\.m16n8k64\.row\.col\.kind::mxf4nvf4\.block_scale\.scale_vec::4X"


def block_scaled_mma_check(sm: int) -> str:
    """The PTX of the block-scaled MMA for sm_100 and up."""
    return MMA_SYNC_BLOCK_SCALE if sm >= 120 else TCGEN05_BLOCK_SCALE


def compile_for(fn, signature, constexprs, target, num_warps=4, num_stages=3):
    attrs = {(i,): [["tt.divisibility", 16]] for i, (name, kind) in enumerate(signature.items())
             if kind != "constexpr" and (kind.startswith("*") or name in DIVISIBLE)}
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=target,
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _splitk_constexprs(TILED=False, SWIZZLED=False, GROUPED=False, WGMMA=False, DOT_SCALED=False, **overrides):
    """The split-K kernel's meta-parameters, the mainloop and layout named by flags."""
    mainloop = ("dot_scaled" if DOT_SCALED else "wgmma" if WGMMA else "mma" if overrides.get("REG_MMA")
                else "dot")
    layout = "tiled" if TILED else "swizzled" if SWIZZLED else "grouped" if GROUPED else "row_major"
    return {"MAINLOOP": MAINLOOPS[mainloop], "LAYOUT": LAYOUTS[layout], "W_GLOBAL_SCALE_PER_ROW": False,
            "HAS_BIAS": True, "SPLIT": True, "USE_ASM": True, "OPERAND": triton.language.bfloat16, "EVEN": True,
            "REG_MMA": 0, "UNSCALE": 128.0, "SUM_ROWS": 1, "SUM_SPLITS": 16, "PDL": 0, **overrides}


def splitk_cases():
    """The skinny kernel (the mainloop the Inductor template calls too) in each shipped
    configuration, with and without masks, row-major and tiled weights; 2-warp
    tiles must multiply with mma.sync."""
    # the configs differ in programs per SM only (a launch choice): one compiled kernel
    for bn, bk, warps, stages in {(bn, bk, w, st) for bn, bk, _, w, st in (gemm_configs.SPLITK_CONFIG,
                                                                          gemm_configs.SPLITK_CONFIG_WIDE_N)}:
        for bm, even, swizzled in itertools.product((16, 32), (False, True), (False, True)):
            yield (f"splitk-{bm}x{bn}x{bk}-w{warps}-even{int(even)}-swizzle{int(swizzled)}",
                   sk._splitk_kernel, SPLITK_SIGNATURE,
                   _splitk_constexprs(SWIZZLED=swizzled, EVEN=even, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk),
                   warps, [WORD_DECODE] + ([MMA_SYNC_BF16] if warps == 2 else []), stages)
    bn, bk, _, warps, stages = gemm_configs.SPLITK_CONFIG
    for bm in (16, 64):
        yield (f"splitk-tiled-{bm}x{bn}x{bk}", sk._splitk_kernel, SPLITK_SIGNATURE,
               _splitk_constexprs(TILED=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk),
               warps, [WORD_DECODE, MMA_SYNC_BF16], stages)



WGMMA_BF16 = r"wgmma\.mma_async\.sync\.aligned\.m64n64k16\.f32\.bf16\.bf16"
ASYNC_16B = r"cp\.async\.cg\.shared\.global \[[^\]]+\], \[[^\]]+\], 0x10"  # 16-byte copies to shared memory


def wgmma_cases():
    """The wgmma mainloop (sm_90, tiled W, serving batch sizes): x's tile and the decoded weight
    step multiply by wgmma on 4 warps; the software pipeline copies x and the codes to shared
    memory in 16-byte pieces; split and not, with and without K masks, on programmatic dependent
    launch (no load before its wait)."""
    bm, bk, warps, stages = gemm_configs.WGMMA_CONFIG
    signature = {**SPLITK_SIGNATURE, "PDL": "constexpr"}
    for split, even in itertools.product((False, True), (False, True)):
        yield (f"splitk-wgmma-{bm}x64x{bk}-split{int(split)}-even{int(even)}", sk._splitk_kernel, signature,
               {**_splitk_constexprs(TILED=True, WGMMA=True, SPLIT=split, EVEN=even, BLOCK_M=bm, BLOCK_N=64,
                                     BLOCK_K=bk, SUM_ROWS=bm, SUM_SPLITS=2), "PDL": 1},
               warps, [WGMMA_BF16, WORD_DECODE, ASYNC_16B, PDL_WAIT_FIRST[0]], stages)


# the grouped row-major mainloop: x's two 16-byte loads and the four rows' codes, before the loop
# and in it (x alone has 4)
CODES_16B_EVERY_OTHER_TILE = r"(?s)(ld\.global(\.[\w:]+)*\.v4\.b32.*){12}"
# The register-fed mainloop's tiled weight loads (8-byte codes, a scale word a lane: no scale bytes)
# are marked first out of L1, x's 16-byte loads are not; row-major weights are not marked
# (device/mma.TILED_WEIGHT_EVICTION)
EVICT_FIRST = r"ld\.global\.L1::evict_first"
TILED_EVICT_FIRST = [EVICT_FIRST + r"(\.[\w:]+)*\.v2\.b32", EVICT_FIRST + r"(\.L2::\w+)*\.b32",
                     r"!ld\.global(\.[\w:]+)*\.b8", r"ld\.global\.v4\.b32"]


def reg_mma_cases():
    """The register-fed mainloop (device/mma.py): mma.sync on operands it loads into registers
    itself, scales through the hardware e4m3 conversion; x rows 1-8 and 9-16; W tiled, or
    row-major with plain or swizzled scales (8-byte code loads) or plain scales grouped (16-byte
    code loads every other K-tile, no 8-byte ones), with and without K masks."""
    bn, bk, _, warps, stages = gemm_configs.REG_MMA_CONFIG
    checks = [MMA_SYNC_BF16, WORD_DECODE, r"cvt\.rn\.f16x2\.e4m3x2"]
    for b_blocks in (1, 2, 4):
        yield (f"splitk-reg-mma-{8 * b_blocks}x{bn}x{bk}", sk._splitk_kernel, SPLITK_SIGNATURE,
               _splitk_constexprs(TILED=True, REG_MMA=b_blocks, BLOCK_M=8 * max(b_blocks, 2), BLOCK_N=bn,
                                  BLOCK_K=bk),
               warps, checks + TILED_EVICT_FIRST, stages)
        for scales, even in itertools.product(("plain", "swizzled") + (("grouped",) if b_blocks == 1 else ()),
                                              (True, False)):
            yield (f"splitk-reg-mma-rows-{8 * b_blocks}x{bn}x{bk}-{scales}-even{int(even)}",
                   sk._splitk_kernel, SPLITK_SIGNATURE,
                   _splitk_constexprs(SWIZZLED=scales == "swizzled", GROUPED=scales == "grouped", EVEN=even,
                                      REG_MMA=b_blocks, BLOCK_M=8 * max(b_blocks, 2), BLOCK_N=bn, BLOCK_K=bk),
                   warps, checks + ["!" + EVICT_FIRST]
                   + ([CODES_16B_EVERY_OTHER_TILE, r"!ld\.global(\.[\w:]+)*\.v2\.b32"] if scales == "grouped"
                      else [r"ld\.global(\.[\w:]+)*\.v2\.b32"]), stages)


@triton.jit
def _mma_mainloop_pdl(x_ptr, w_ptr, w_scale_ptr, out_ptr, M, K, stride_xm, PDL: tl.constexpr):
    """The template's call of the register-fed mainloop under programmatic dependent launch."""
    acc = mma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xm, tl.program_id(0), 0,
                       tl.cdiv(K, 64), 1, True, PDL)
    tl.store(out_ptr + tl.arange(0, 64)[:, None] * 16 + tl.arange(0, 16)[None, :], acc)


def pdl_cases():
    """PDL 1 waits before any load; PDL 2 loads the first tile's codes (8-byte loads) first."""
    signature = {"x_ptr": "*bf16", "w_ptr": "*u8", "w_scale_ptr": "*u8", "out_ptr": "*fp32",
                 "M": "i32", "K": "i32", "stride_xm": "i32", "PDL": "constexpr"}
    yield ("mma-mainloop-pdl1", _mma_mainloop_pdl, signature, {"PDL": 1}, 2,
           [r"(?s)^(?:(?!ld\.global).)*griddepcontrol\.wait"], 1)
    # (from the start: no 16-byte load (x) before the wait, at least one 8-byte load (codes))
    no_x = r"(?:(?!ld\.global(\.[\w:]+)*\.v4).)*"
    yield ("mma-mainloop-pdl2", _mma_mainloop_pdl, signature, {"PDL": 2}, 2,
           [r"(?s)^" + no_x + r"ld\.global(\.[\w:]+)*\.v2\.b32" + no_x + r"griddepcontrol\.wait"], 1)


def eager_pdl_cases():
    """The eager skinny GEMM on PDL (on sm_90+): no global load or store before its
    wait, and no early release of the next launch; register-fed and tl.dot mainloops."""
    signature = {**SPLITK_SIGNATURE, "PDL": "constexpr"}
    bn, bk, _, warps, stages = gemm_configs.REG_MMA_CONFIG
    wait_first = [PDL_WAIT_FIRST[0], "!" + PDL_WAIT_FIRST[1]]
    for b_blocks in (1, 2):
        yield (f"splitk-reg-mma-{8 * b_blocks}x{bn}x{bk}-pdl", sk._splitk_kernel, signature,
               {**_splitk_constexprs(TILED=True, REG_MMA=b_blocks, BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk), "PDL": 1},
               warps, [MMA_SYNC_BF16] + wait_first, stages)
    bn, bk, _, warps, stages = gemm_configs.SPLITK_CONFIG
    yield (f"splitk-tiled-64x{bn}x{bk}-pdl", sk._splitk_kernel, signature,
           {**_splitk_constexprs(TILED=True, BLOCK_M=64, BLOCK_N=bn, BLOCK_K=bk), "PDL": 1},
           warps, [MMA_SYNC_BF16] + wait_first, stages)


def dot_scaled_splitk_cases(sm: int = 100):
    """sm_100 and up: the skinny kernel's block-scaled mainloop (tiled W, NVFP4 x) -> tcgen05 MMA
    (sm_120: mma.sync's block-scaled form)."""
    _, bn, bk, _, warps, stages = gemm_configs.dot_scaled_splitk_config(16, 4096, 4096, 148)
    for bm in (16, 64, 128):
        yield (f"splitk-dot-scaled-{bm}x{bn}x{bk}", sk._splitk_kernel, {**SPLITK_SIGNATURE, "x_ptr": "*u8"},
               _splitk_constexprs(TILED=True, DOT_SCALED=True, UNSCALE=1.0, USE_ASM=False,
                                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk),
               warps, [block_scaled_mma_check(sm)], stages)


KV_WRITE_SIGNATURE = {
    "k_ptr": None, "v_ptr": None, "pos_ptr": "*i64", **{f"{side}_{part}_ptr": kind for side in "kv" for part, kind in
                                                       (("data", "*u8"), ("scale", "*u8"), ("g", "*fp32"))},
    "H": "i32", "S": "i32", "T": "i32", **{f"stride_{x}{d}": "i32" for x in "kv" for d in "bhs"},
    **{name: "constexpr" for name in ("D", "BLOCK_D", "ROWS", "USE_ASM")},
}
KV_ATTENTION_SIGNATURE = {
    "q_ptr": "*bf16", **{f"{side}_{part}_ptr": kind for side in "kv" for part, kind in
                         (("data", "*u8"), ("scale", "*u8"), ("g", "*fp32"))},
    "mask_ptr": "*u8", "part_ptr": "*fp32", "H": "i32", "T": "i32", "kv_limit": "i32", "slots_per_split": "i32",
    "stride_qb": "i32", "stride_qh": "i32", "stride_mb": "i32", "stride_mt": "i32", "qk_scale": "fp32",
    **{name: "constexpr" for name in ("GROUP", "ROWS", "D", "BLOCK_D", "BLOCK_N", "HAS_MASK", "MASK_CHUNK",
                                      "USE_ASM", "OPERAND")},
}
KV_COMBINE_SIGNATURE = {"part_ptr": "*fp32", "out_ptr": "*bf16", "HQ": "i32", "stride_ob": "i32", "stride_oh": "i32",
                        **{name: "constexpr" for name in ("SPLITS", "SPLITS_P2", "D", "BLOCK_D")}}
MMA_OR_WGMMA_BF16 = r"(mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32|wgmma\.mma_async\.sync\.aligned\.\w+\.f32\.bf16\.bf16)"


def kv_cache_cases():
    """The KV cache's write (bf16 / fp16 / fp32 keys, head_dim 128 and 80) and decode attention
    (Llama-3-8B's group of 4, a group of 1 and head_dim 80): the attention decodes with the word
    decode and multiplies on the tensor cores, bf16 operands."""
    for dtype, dim in itertools.product(DTYPES, (128, 80)):
        block_d = triton.next_power_of_2(dim)
        yield (f"kv-write-{dtype}-d{dim}", kv._write_kernel, {**KV_WRITE_SIGNATURE, "k_ptr": f"*{dtype}",
                                                             "v_ptr": f"*{dtype}"},
               {"D": dim, "BLOCK_D": block_d, "ROWS": kv.WRITE_ROWS, "USE_ASM": True}, 4, [], 1)
    for group, dim, has_mask in ((4, 128, True), (4, 128, False), (1, 128, True), (8, 80, True)):
        # (a contiguous mask row: the JIT specializes a stride of 1)
        yield (f"kv-attention-g{group}-d{dim}-mask{int(has_mask)}", kv._attention_partials_kernel,
               {**KV_ATTENTION_SIGNATURE, "stride_mt": "constexpr"},
               {"stride_mt": 1, "GROUP": group, "ROWS": max(kv.MIN_ROWS, group), "D": dim, "BLOCK_D": triton.next_power_of_2(dim),
                "BLOCK_N": kv.BLOCK_N, "HAS_MASK": has_mask, "MASK_CHUNK": kv.MASK_CHUNK, "USE_ASM": True,
                "OPERAND": triton.language.bfloat16}, kv.NUM_WARPS, [WORD_DECODE, MMA_OR_WGMMA_BF16], 3)
    yield ("kv-combine", kv._combine_kernel, KV_COMBINE_SIGNATURE,
           {"SPLITS": 33, "SPLITS_P2": 64, "D": 128, "BLOCK_D": 128}, 1, [], 1)


def cases(sm):
    if sm >= 100:
        yield from dot_scaled_splitk_cases(sm)
        return
    yield from splitk_cases()
    yield from wgmma_cases()
    yield from reg_mma_cases()
    yield from pdl_cases()
    yield from eager_pdl_cases()
    yield from kv_cache_cases()
    block_m, block_k, num_warps = qk.LARGE_TILE
    for dtype, mode, swizzle in itertools.product(DTYPES, range(4), [False, True]):
        yield (f"quantize-{dtype}-g{mode}-swizzle{int(swizzle)}", qk._quantize_kernel,
               {**QUANTIZE_SIGNATURE, "x_ptr": f"*{dtype}"},
               {"GLOBAL": mode, "WRITE_G": True, "SWIZZLE": swizzle, "VALUES": False, "USE_ASM": True,
                "OPERAND": triton.language.bfloat16, "BLOCK_M": block_m, "BLOCK_K": block_k,
                "FUSED_M": 1, "FUSED_K": 4096, "PARTIALS_BLOCK": 1024, "NORM": 0, "PDL": True},
               num_warps,
               # the element path never goes through shared memory (the dynamic modes reduce the
               # global amax across warps and the swizzled scale store re-lays out 1/16 of a tile);
               # the fused amax of 16-bit x works on packed halves
               [LOAD_16B] + ([] if mode >= 2 or swizzle else ["!bar.sync"])
               + ([r"max\.s16x2"] if mode == 2 and dtype != "fp32" else []) + PDL_WAIT_FIRST, 1)
    for mode in (2, 3):  # quantize_values: dynamic per-tensor scale, values by the word decode
        yield (f"quantize-values-bf16-g{mode}", qk._quantize_kernel,
               {**QUANTIZE_SIGNATURE, "x_ptr": "*bf16", "data_ptr": "*bf16"},
               {"GLOBAL": mode, "WRITE_G": True, "SWIZZLE": False, "VALUES": True, "USE_ASM": True,
                "OPERAND": triton.language.bfloat16, "BLOCK_M": block_m, "BLOCK_K": block_k,
                "FUSED_M": 1, "FUSED_K": 4096, "PARTIALS_BLOCK": 1024, "NORM": 0, "PDL": True},
               num_warps, [LOAD_16B, WORD_DECODE, STORE_16B, NO_FLOAT_TO_INT] + PDL_WAIT_FIRST, 1)
    # rms_norm_quantize_values at decode: every program normalizes all of h, then its own tile
    for norm, dtype in itertools.product((1, 2, 3), ("bf16", "fp16")):
        tile_m, tile_k, warps = qk._tile(1, 4096)
        yield (f"rms-norm-quantize-values-{dtype}-norm{norm}", qk._quantize_kernel,
               {**QUANTIZE_SIGNATURE, "x_ptr": f"*{dtype}", "data_ptr": "*bf16", "w_ptr": f"*{dtype}"},
               {"GLOBAL": 2, "WRITE_G": True, "SWIZZLE": False, "VALUES": True, "USE_ASM": True,
                "OPERAND": triton.language.bfloat16, "BLOCK_M": tile_m, "BLOCK_K": tile_k,
                "FUSED_M": 1, "FUSED_K": 4096, "PARTIALS_BLOCK": 1, "NORM": norm, "PDL": True},
               warps, [WORD_DECODE, STORE_16B, NO_FLOAT_TO_INT] + PDL_WAIT_FIRST, 1)
    amax_m, amax_k = qk.AMAX_TILE
    for dtype in DTYPES:
        yield (f"amax-partials-{dtype}", qk.amax_partials_kernel, {**AMAX_SIGNATURE, "x_ptr": f"*{dtype}"},
               {"BLOCK_M": amax_m, "BLOCK_K": amax_k, "PDL": True}, 4, [LOAD_16B] + PDL_WAIT_FIRST, 1)
        yield (f"row-g-{dtype}", qk._row_g_kernel, {**ROW_G_SIGNATURE, "x_ptr": f"*{dtype}"},
               {"BLOCK_M": amax_m, "BLOCK_K": amax_k}, 4, [LOAD_16B], 1)
    for dtype, per_row, swizzle, gather in itertools.product(DTYPES, *[[False, True]] * 3):
        yield (f"dequantize-{dtype}-row{int(per_row)}-swizzle{int(swizzle)}-gather{int(gather)}",
               dk._dequantize_kernel, {**DEQUANTIZE_SIGNATURE, "out_ptr": f"*{dtype}"},
               {"PER_ROW": per_row, "HAS_G": True, "SWIZZLE": swizzle, "GATHER": gather,
                "TILED": False, "BLOCK_M": dk.BLOCK_M, "BLOCK_K": dk.BLOCK_K}, dk.NUM_WARPS, [], 1)
    yield ("dequantize-tiles-bf16", dk._tiles_bf16_kernel,
           {"data_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": "*bf16", "N": "i32", "K": "i32",
            "USE_ASM": "constexpr", "OPERAND": "constexpr"},
           {"USE_ASM": True, "OPERAND": triton.language.bfloat16}, 4, [WORD_DECODE, LOAD_16B], 1)
    yield ("dequantize-bf16-tiled", dk._dequantize_kernel, {**DEQUANTIZE_SIGNATURE, "out_ptr": "*bf16"},
           {"PER_ROW": False, "HAS_G": False, "SWIZZLE": False, "GATHER": False, "TILED": True,
            "BLOCK_M": dk.BLOCK_M, "BLOCK_K": dk.BLOCK_K}, dk.NUM_WARPS, [], 1)


def main() -> None:
    sm = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    target = GPUTarget("cuda", sm, 32)
    for name, fn, signature, constexprs, num_warps, checks, num_stages in cases(sm):
        result = {"case": name, "ok": True, "error": "", "ptx_checks": {}}
        try:
            ptx = compile_for(fn, signature, constexprs, target, num_warps, num_stages).asm["ptx"]
            for check in checks:
                present = re.search(check.lstrip("!"), ptx) is not None
                result["ptx_checks"][check] = present != check.startswith("!")
        except Exception as exc:  # reported, not raised: the test names the failing case
            result.update(ok=False, error=f"{type(exc).__name__}: {str(exc)[-2000:]}")
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

"""Grouped NVFP4 GEMM for mixture-of-experts layers (W4A16 and W4A4, eager): y[t] = x[t] @ W_e^T for the
tokens t of each expert e. W: the experts' codes and plain e4m3 scale bits laid out by
tiled.tile_experts (each expert in the dense GEMM's tiled layout, N_pad stored rows, one expert
after another; gated: gate and up rows interleaved by 32) + one fp32 global scale per expert.

Tokens arrive sorted by expert with `offsets` (E,) int32, the `torch._grouped_mm` convention:
expert e owns rows [offsets[e - 1], offsets[e]) (offsets[-1] read as 0). The counts stay on the
device, so the launch is sized for the worst case and every program finds its work itself:

1. Work list. Expert e needs ceil(count_e / BLOCK_M) row tiles; over all experts that is at most
   floor(T / BLOCK_M) + min(E, T) (each expert with rows adds at most one partial tile). The grid
   is that bound times ceil(N_pad / BLOCK_N), by the K splits, blocks of rows first. Program
   (m, n) loads the E offsets, takes the inclusive cumulative sum of the tile counts, and finds
   its expert as the number of experts whose sum is <= m; a program past the last tile returns at
   once. No host sync, so a launch can be captured in a CUDA graph and replayed with other routings.
2. Mainloop: the dense split-K kernel's, on the expert's tiles and the tile's rows of x, by the
   rows an expert gets on average (T / E; the counts stay on the device):
   - decode (at most 16 on CUDA, sm_90 and up, bf16 x): the register-fed mainloop
     (gemm_mma.mma_mainloop) on 8, 16 or 32 rows of x, K split so that the few experts hit still
     fill the SMs (the dense split-K scheme: fp32 partials, the tile's last split sums them in order);
   - serving batches (17 to plan.WGMMA_MAX_M on sm_90, bf16 x): gemm_splitk.wgmma_mainloop on
     blocks of 64 rows;
   - W4A4 on GPUs with the block-scaled MMA (sm_100 and up), any rows (DOT_SCALED): x's per-group
     NVFP4 codes and scales and the experts' go to tl.dot_scaled (gemm_splitk.dot_scaled_mainloop);
     compiled for sm_100 in CI and run on the CPU through a stand-in, never on hardware;
   - prefill (above those on CUDA, sm_90 and up, K a multiple of 16; not with x's codes): every
     expert dequantized to bf16 once, torch._grouped_mm, then step 3 as a kernel of its own over
     a work list of its own tiles (`_grouped_dequant`; each linear rounded once more, to bf16, in
     between);
   - otherwise, and under the interpreter: gemm_splitk.splitk_mainloop (each 64 x 64 tile decoded
     in registers to e2m1 * s * 2^-7, exact in bf16, and multiplied by tl.dot in fp32);
   x enters rounded to bf16 (W4A16); W4A4 passes x's quantized values (e2m1 * s_x, exact; on
   sm_100 its codes and scale bits) and one global scale per row.
3. Epilogue: acc * 2^7 (the decode's 2^-7 back; not after tl.dot_scaled or torch._grouped_mm)
   * g_e (* g_x per row) + bias_e, rounded once to the output dtype. The gated form (GATED)
   pairs each tile's 32 gate rows with its 32 up rows and writes silu(gate) * up, each linear
   rounded to the output dtype first, as reference.silu_mul.
Rows at or past offsets[E - 1] are zero in the output (torch._grouped_mm leaves them unwritten).

On CUDA the offsets are never read back, so they are not checked there: values are clamped to
[0, T] (memory-safe; rows of an unordered group are computed with whichever expert the clamped
ranges give). The CPU reference raises on them.

Under the Triton interpreter (no inline PTX, no bf16 tl.dot) the decode is the byte form and the
products run in fp32.
"""

import os

import torch
import triton
import triton.language as tl

from nvfp4_inductor import capability
from nvfp4_inductor.kernels import gemm_configs, gemm_mma, plan
from nvfp4_inductor.kernels._common import BLOCK, round_to
from nvfp4_inductor.kernels.gemm_mma import mma_mainloop
from nvfp4_inductor.kernels.gemm_splitk import (
    mma_operands_fit, dot_scaled_mainloop, last_split, silu_mul_halves, split_counters, split_tiles, splitk_mainloop,
    wgmma_mainloop,
)
from nvfp4_inductor.reference.tiled import expert_rows, stored_rows, TILE_K, TILE_N

_TILE_N: tl.constexpr = tl.constexpr(TILE_N)
_TILE_K: tl.constexpr = tl.constexpr(TILE_K)

_UNSCALE: tl.constexpr = tl.constexpr(2.0**7)  # the decode's 2^-7 (gemm_splitk's module docstring)

# The tl.dot mainloop's configs: BLOCK_M 16 (tl.dot's least) where most experts get a few tokens
# (decode where the register-fed mainloop does not fit), 64 where they get many (up to the
# dequantize form, or where it does not apply); two warps keep the dot on mma.sync at BLOCK_M 16, as the dense split-K kernel.
DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=TILE_N, BLOCK_K=TILE_K, num_warps=2)
PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=TILE_N, BLOCK_K=TILE_K, num_warps=4)
# sm_100's block-scaled MMA (tcgen05 mxf4nvf4) takes 128 x 128 weight steps, as the dense kernel's.
DOT_SCALED_DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4)
DOT_SCALED_PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4)
# Under the interpreter a program costs per operation, not per element: few, small programs.
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=TILE_N, BLOCK_K=TILE_K, num_warps=1)


@triton.jit
def _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr):
    """Token tile pid_m of the work list -> (expert, first row, end row of that expert, valid)."""
    es = tl.arange(0, E_POW2)
    in_range = es < E
    ends = tl.load(offsets_ptr + es, mask=in_range, other=0)
    starts = tl.load(offsets_ptr + es - 1, mask=in_range & (es > 0), other=0)
    ends = tl.minimum(tl.maximum(ends, 0), T)
    starts = tl.minimum(tl.maximum(starts, 0), T)
    tiles = tl.where(in_range, tl.cdiv(tl.maximum(ends - starts, 0), BLOCK_M), 0)
    cum = tl.cumsum(tiles, 0)  # inclusive
    expert = tl.sum((cum <= pid_m).to(tl.int32), 0)
    valid = pid_m < tl.sum(tiles, 0)
    this = es == expert
    local = pid_m - tl.sum(tl.where(this, cum - tiles, 0), 0)
    row0 = tl.sum(tl.where(this, starts, 0), 0) + local * BLOCK_M
    end = tl.sum(tl.where(this, ends, 0), 0)
    return expert, row0, end, valid


@triton.jit
def _tiled_mainloop(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xt, pid_n, pid_k, steps_per_split,
                    USE_ASM: tl.constexpr, DOT: tl.constexpr, EVEN_K: tl.constexpr, REG_MMA: tl.constexpr,
                    WGMMA: tl.constexpr, DOT_SCALED: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 (BLOCK_N, ACC_M) products of tile rows pid_n * BLOCK_N ... of one expert's tiled weight
    (w_ptr, w_scale_ptr; N: its stored rows) and x's M rows at x_ptr, over split pid_k's K-steps:
    the dense split-K kernel's mainloops (gemm_splitk.py, gemm_mma.py), e2m1 * s * 2^-7 products
    (not after tl.dot_scaled)."""
    t_begin, t_end = split_tiles(pid_k, steps_per_split, tl.cdiv(K, BLOCK_K))
    if REG_MMA > 0:  # sm_90+: mma.sync on registers, the tiled layout (LAYOUT 0)
        acc = mma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xt, pid_n, t_begin, t_end, REG_MMA, EVEN_K)
    elif WGMMA:  # sm_90: x's tile as wgmma's first operand
        acc = wgmma_mainloop(x_ptr, w_ptr, w_scale_ptr, M, K, stride_xt, pid_n, t_begin, t_end, USE_ASM, DOT,
                             EVEN_K, BLOCK_M, BLOCK_K)
    elif DOT_SCALED:  # sm_100, W4A4: x's codes and scale bits, the block-scaled MMA
        acc = dot_scaled_mainloop(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xt, pid_n, t_begin,
                                  t_end, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        acc = splitk_mainloop(x_ptr, w_ptr, w_scale_ptr, M, N, K, stride_xt, 0, pid_n, t_begin, t_end, False,
                              USE_ASM, DOT, EVEN_K, True, BLOCK_M, BLOCK_N, BLOCK_K)
    return acc


@triton.jit
def grouped_linear_kernel(
    # pointers
    x_ptr, offsets_ptr, w_ptr, w_scale_ptr, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
    partial_ptr, counter_ptr, x_scale_ptr,
    # sizes
    T, NP, K, E, N_OUT, M_TILES, steps_per_split,
    # strides
    stride_xt, stride_ot,
    # meta-parameters
    HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr, GATED: tl.constexpr, USE_ASM: tl.constexpr,
    DOT: tl.constexpr, SPLIT: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    REG_MMA: tl.constexpr = 0, WGMMA: tl.constexpr = False, EVEN_K: tl.constexpr = False,
    ACC_M: tl.constexpr = 16, DOT_SCALED: tl.constexpr = False,
):
    """out (T, N_OUT) for the work-list tile of this program (module docstring). NP: the rows an
    expert's tiled weight stores (tiled.expert_rows), N_OUT the output columns (with GATED half
    the logical rows: column n from the interleaved gate and up rows). Program (tile, split), the
    tile m + M_TILES * n (blocks of rows first: an expert's weight tile is read by its row blocks
    together), multiplies K-steps [split * steps_per_split, ...); with SPLIT, its fp32 products go
    to partial (splits, T, NP) and the tile's last split to finish sums them in split order and
    runs the epilogue (the dense split-K kernel's scheme: gemm_splitk.last_split).
    REG_MMA > 0: gemm_mma.mma_mainloop with REG_MMA blocks of 8 rows (BLOCK_M = 8 * REG_MMA,
    BLOCK_N = BLOCK_K = 64, 2 warps), its tile ACC_M = 8 * max(REG_MMA, 2) columns wide, those past
    BLOCK_M unused; WGMMA: gemm_splitk.wgmma_mainloop (BLOCK_M = 64); else ACC_M = BLOCK_M.
    HAS_BIAS: bias (E, NP) in the stored row order; X_SCALED: x_global_scale_ptr (T,), each row's
    global scale (W4A4). DOT_SCALED (sm_100, W4A4): x_ptr holds x's e2m1 codes (T, K/2) and
    x_scale_ptr their e4m3 bits (T, K/16)."""
    pid_m = tl.program_id(0) % M_TILES
    pid_n = tl.program_id(0) // M_TILES
    pid_k = tl.program_id(1)
    expert, row0, end, valid = _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M, E_POW2)
    if valid:
        ts = row0 + tl.arange(0, ACC_M)
        t_ok = (tl.arange(0, ACC_M) < BLOCK_M) & (ts < end)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # stored weight rows of the expert
        e64 = expert.to(tl.int64)
        # the expert's tiles: whole tiles, so its codes start on 2 KiB and its scales on 256 bytes
        expert_tiles = (NP // _TILE_N) * tl.cdiv(K, _TILE_K)
        w_e = w_ptr + tl.multiple_of(e64 * expert_tiles * (_TILE_N * _TILE_K // 2), 16)
        s_e = w_scale_ptr + tl.multiple_of(e64 * expert_tiles * (_TILE_N * _TILE_K // BLOCK), 16)
        m_rows = tl.minimum(end - row0, BLOCK_M)
        x_t = x_ptr + row0.to(tl.int64) * stride_xt
        xs_t = x_scale_ptr + row0.to(tl.int64) * (K // BLOCK)
        acc = _tiled_mainloop(x_t, xs_t, w_e, s_e, m_rows, NP, K, stride_xt, pid_n, pid_k, steps_per_split,
                              USE_ASM, DOT, EVEN_K, REG_MMA, WGMMA, DOT_SCALED, BLOCK_M, BLOCK_N, BLOCK_K)
        UNSCALE: tl.constexpr = 1.0 if DOT_SCALED else _UNSCALE  # (the epilogue's: the decode's 2^-7 back)
        if SPLIT:
            # this split's products, then the tile's last split sums all of them, in split order
            mask = t_ok[None, :]
            place = ts.to(tl.int64)[None, :] * NP + rows[:, None]
            split_stride = tl.cast(T, tl.int64) * NP
            tl.store(partial_ptr + pid_k * split_stride + place, acc, mask=mask)
            if last_split(counter_ptr + tl.program_id(0), tl.num_programs(1)):
                acc = tl.zeros((BLOCK_N, ACC_M), tl.float32)
                for split in range(0, tl.num_programs(1)):
                    acc += tl.load(partial_ptr + split * split_stride + place, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                _epilogue(acc, expert, ts, t_ok, pid_n, NP, N_OUT, w_global_scale_ptr, x_global_scale_ptr,
                          bias_ptr, out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, UNSCALE, BLOCK_N)
        else:
            _epilogue(acc, expert, ts, t_ok, pid_n, NP, N_OUT, w_global_scale_ptr, x_global_scale_ptr, bias_ptr,
                      out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, UNSCALE, BLOCK_N)


@triton.jit
def _epilogue(acc, expert, ts, t_ok, pid_n, NP, N_OUT, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
              stride_ot, HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr, GATED: tl.constexpr,
              UNSCALE: tl.constexpr, BLOCK_N: tl.constexpr):
    """A tile's fp32 products (BLOCK_N stored weight rows from pid_n * BLOCK_N, x rows ts) -> out; UNSCALE:
    what the products are multiplied by besides the global scales (2^7 after the decode's 2^-7).
    GATED: the rows are interleave_halves' (32 gate rows, the same 32 up rows, ...): out columns
    rows // 64 * 32 + rows % 32, silu(gate) * up, each linear rounded to out's dtype first."""
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    g = tl.load(w_global_scale_ptr + expert) * UNSCALE
    y = acc * g
    if X_SCALED:
        y = y * tl.load(x_global_scale_ptr + ts, mask=t_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + expert.to(tl.int64) * NP + rows).to(tl.float32)[:, None]
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    if GATED:
        y = silu_mul_halves(y, tl.full((BLOCK_N,), 1.0, tl.float32), OUT, BLOCK_N, acc.shape[1])
        cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    else:
        cols = rows
    tl.store(out_ptr + ts.to(tl.int64)[None, :] * stride_ot + cols[:, None], round_to(y, OUT).to(OUT),
             mask=(cols < N_OUT)[:, None] & t_ok[None, :])


EPILOGUE_CONFIG = dict(BLOCK_M=32, BLOCK_N=128, num_warps=4)


@triton.jit
def grouped_epilogue_kernel(y_ptr, offsets_ptr, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
                            T, NP, E, N_OUT, M_TILES, stride_yt, stride_ot, HAS_BIAS: tl.constexpr,
                            X_SCALED: tl.constexpr, GATED: tl.constexpr, E_POW2: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The prefill form's epilogue (_grouped_dequant): y (T, NP) bf16 products of x and the
    experts' e2m1 * block scale, in the stored row order -> out, over the kernel's work list, by
    its _epilogue."""
    pid_m = tl.program_id(0) % M_TILES
    pid_n = tl.program_id(0) // M_TILES
    expert, row0, end, valid = _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M, E_POW2)
    if valid:
        ts = row0 + tl.arange(0, BLOCK_M)
        t_ok = ts < end
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.load(y_ptr + ts.to(tl.int64)[None, :] * stride_yt + rows[:, None],
                      mask=(rows < NP)[:, None] & t_ok[None, :], other=0.0).to(tl.float32)
        _epilogue(acc, expert, ts, t_ok, pid_n, NP, N_OUT, w_global_scale_ptr, x_global_scale_ptr, bias_ptr,
                  out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, 1.0, BLOCK_N)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _config(t: int, e: int, dot_scaled: bool = False) -> dict:
    """tl.dot (or, dot_scaled, tl.dot_scaled) block sizes from the shapes only (the per-expert
    counts are on the device): decode tiles where an expert gets at most 16 rows on average."""
    if _interpreting():
        return INTERPRET_CONFIG
    if dot_scaled:
        return DOT_SCALED_DECODE_CONFIG if t <= 16 * e else DOT_SCALED_PREFILL_CONFIG
    return DECODE_CONFIG if t <= 16 * e else PREFILL_CONFIG


def _mma_blocks(t: int, e: int) -> int:
    """Blocks of 8 x rows a program of the register-fed mainloop takes (1, 2 or 4), or 0 (tl.dot):
    about twice the rows an expert gets where the t rows spread evenly over the e experts, so
    that an expert's rows rarely need a second program, which reads its weights again."""
    rows = 2 * triton.cdiv(t, e)
    return next((nb for nb in (1, 2, 4) if rows <= 8 * nb), 0)


def _mma_fits(x: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor) -> bool:
    """The register-fed mainloop's operands: the dense kernel's (gemm_splitk.mma_operands_fit),
    bf16 x, an expert's tiles addressed with 32-bit offsets, inline PTX (sm_90 and up, not the
    interpreter)."""
    return (not _interpreting() and capability.sm90_or_later(x.device) and x.dtype == torch.bfloat16
            and w_data.shape[1] < 2**31 and mma_operands_fit(x, w_data, w_scale, tiled=True))


def _wgmma_fits(t: int, e: int, x: torch.Tensor) -> bool:
    """The wgmma mainloop (sm_90, bf16 x): up to plan.WGMMA_MAX_M rows an expert on average, as
    the dense GEMM takes it up to that many rows (docs/backend.md, the experts' kernel)."""
    return (not _interpreting() and capability.wgmma(x.device) and x.dtype == torch.bfloat16
            and t <= plan.WGMMA_MAX_M * e)


# Decode: K split so that the programs of the tiles that can have rows (at most one per expert
# with rows, and there are at most min(T, E) of those) fill every SM PROGRAMS_PER_SM times, each
# split at least MIN_STEPS K-steps of the tl.dot mainloop (the register-fed one:
# gemm_configs.REG_MMA_MIN_STEPS), as the dense split-K kernel does (docs/gemm.md).
PROGRAMS_PER_SM = 8
MIN_STEPS = 4


def splits_for(tiles: int, steps: int, num_sms: int, min_steps: int = MIN_STEPS) -> int:
    """How many ranges K's `steps` steps are split into (1: no split) for `tiles` output tiles
    that have rows."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, tiles)
    return max(1, min(wanted, steps // min_steps))


# Prefill: from this many rows an expert on average (T / E), decoding each expert's weights once
# into bf16 and one torch._grouped_mm is about even with the tl.dot kernel, which decodes them
# again in every row tile, and ahead above; on sm_90 the wgmma mainloop keeps the rows up to
# plan.WGMMA_MAX_M (docs/backend.md, the experts' kernel).
DEQUANT_MIN_ROWS = 64


def _dequant_runs(t: int, e: int, k: int, x: torch.Tensor) -> bool:
    """Whether the dequantize + torch._grouped_mm form takes this launch (CUDA, sm_90 and up,
    where the GEMM's operands are 16-byte aligned: K a multiple of 16)."""
    if not x.is_cuda or _interpreting() or not capability.sm90_or_later(x.device) or k % 16:
        return False
    return t > plan.WGMMA_MAX_M * e if capability.wgmma(x.device) else t >= DEQUANT_MIN_ROWS * e


def _row_tiles(t: int, e: int, block_m: int) -> int:
    """The row tiles of a work-list launch (module docstring, 1.): each expert's rows over
    block_m, at most t // block_m + min(e, t) in all (each expert with rows adds at most one
    partial tile)."""
    return t // block_m + min(e, t)


def _stored_bias(bias: torch.Tensor | None, gated: bool) -> torch.Tensor | None:
    """bias (E, N) in the logical row order -> (E, N_pad) in the stored one (tiled.stored_rows)."""
    return None if bias is None else stored_rows(bias[..., None], gated)[..., 0].contiguous()


def _grouped_dequant(x, offsets, w_data, w_scale, w_global_scale, bias, np_, n_out, gated, x_global_scale,
                     out_dtype):
    """The grouped GEMM as every expert dequantized to bf16 (e2m1 * block scale, exact), one
    torch._grouped_mm (bf16 products, rounded to bf16: torch's only output type) and
    grouped_epilogue_kernel (each row's expert's global scale, W4A4: times the row's, bias,
    silu(gate) * up, rounded to the output dtype): each linear is rounded once more than in the
    kernel. The offsets are clamped to [0, T] and made non-decreasing first (torch._grouped_mm
    reads memory by them); rows past the groups are zero."""
    from nvfp4_inductor.kernels.dequantize import dequantize

    t, k = x.shape
    e = w_data.shape[0]
    # the experts' tiles, one after another, are the tiles of one (E * N_pad, K) weight
    w = dequantize(w_data.reshape(-1), w_scale.reshape(-1), None, False, torch.bfloat16,
                   tiled_nk=(e * np_, k)).view(e, np_, k)
    offsets = torch.cummax(offsets.clamp(0, t), 0).values
    y = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    del w
    out = torch.zeros((t, n_out), dtype=out_dtype, device=x.device)
    cfg = EPILOGUE_CONFIG
    m_tiles = _row_tiles(t, e, cfg["BLOCK_M"])
    grouped_epilogue_kernel[(m_tiles * triton.cdiv(np_, cfg["BLOCK_N"]),)](
        y, offsets, w_global_scale, x_global_scale if x_global_scale is not None else w_global_scale,
        bias if bias is not None else w_global_scale, out, t, np_, e, n_out, m_tiles, y.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, X_SCALED=x_global_scale is not None, GATED=gated,
        E_POW2=triton.next_power_of_2(e), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"])
    return out


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                   w_global_scale: torch.Tensor, bias: torch.Tensor | None, n: int, gated: bool,
                   x_global_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, splits: int | None = None,
                   dequant: bool | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) float, offsets (E,) int32, W tiled by tiled.tile_experts ((E, N_pad * K_pad / 2)
    uint8 + (E, N_pad * K_pad / 16) uint8 e4m3 bits) of N logical rows an expert + (E,) fp32,
    bias (E, N) or None -> (T, N) in out_dtype (default x.dtype), or (T, N/2) silu(gate) * up with
    gated. x_global_scale (T,) fp32: x holds W4A4's quantized values (bf16) and this each row's
    global scale. splits: K ranges (splits_for's choice at decode where None, else 1). dequant:
    the dequantize + torch._grouped_mm form (_dequant_runs' choice where None). x_scale (T, K/16)
    uint8 (sm_100, W4A4, with x_global_scale and out_dtype): x holds x's e2m1 codes (T, K/2) uint8
    and this their e4m3 bits, multiplied by the block-scaled MMA (DOT_SCALED; dequant is not
    asked). Arguments checked by the caller (moe.check_grouped_args)."""
    t, k = x.shape[0], x.shape[1] * (2 if x_scale is not None else 1)
    e = w_data.shape[0]
    np_ = expert_rows(n, gated)
    n_out = n // 2 if gated else n
    out_dtype = out_dtype or x.dtype
    if t == 0 or n_out == 0:
        return torch.zeros((t, n_out), dtype=out_dtype, device=x.device)
    if x_scale is None and x.dtype != torch.bfloat16:
        x = x.to(torch.bfloat16)  # W4A16's x, rounded to nearest even
    if x.stride(-1) != 1:
        x = x.contiguous()
    # the kernels index these with unit strides: a strided view (offsets[::2]) would be misread
    offsets, w_global_scale = offsets.contiguous(), w_global_scale.contiguous()
    if x_global_scale is not None:
        x_global_scale = x_global_scale.contiguous()
    if x_scale is not None:
        x_scale = x_scale.contiguous()
    bias = _stored_bias(bias, gated)
    if x_scale is None and (_dequant_runs(t, e, k, x) if dequant is None else dequant):
        return _grouped_dequant(x, offsets, w_data, w_scale, w_global_scale, bias, np_, n_out, gated,
                                x_global_scale, out_dtype)
    out = torch.zeros((t, n_out), dtype=out_dtype, device=x.device)  # rows past offsets[E - 1]: zero
    nb = _mma_blocks(t, e) if x_scale is None and _mma_fits(x, w_data, w_scale) else 0
    wgmma = not nb and x_scale is None and _wgmma_fits(t, e, x)
    stages = None
    if nb:  # the register-fed mainloop: 64 weight rows by 8 * nb x rows, 64-k steps, two warps
        block_m, block_n, block_k, warps = 8 * nb, gemm_mma.TILE_N, gemm_mma.TILE_K, gemm_mma.WARPS
        acc_m = 8 * max(nb, 2)
        min_steps = gemm_configs.REG_MMA_MIN_STEPS[nb > 1]
    elif wgmma:  # x's 64-row tile as wgmma's first operand, two tiles a K-step
        block_m, block_k, warps, stages = gemm_configs.WGMMA_CONFIG
        block_n, acc_m, min_steps = TILE_N, block_m, None
    else:
        cfg = _config(t, e, x_scale is not None)
        block_m, block_n, block_k, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
        acc_m = block_m
        min_steps = None if cfg is PREFILL_CONFIG or cfg is DOT_SCALED_PREFILL_CONFIG else MIN_STEPS
    m_tiles = _row_tiles(t, e, block_m)
    n_tiles = triton.cdiv(np_, block_n)
    steps = triton.cdiv(k, block_k)
    if splits is None:
        splits = 1 if min_steps is None else splits_for(min(t, e) * n_tiles, steps, capability.sm_count(x.device),
                                                        min_steps)
    per_split = triton.cdiv(steps, max(1, min(splits, steps)))
    splits = triton.cdiv(steps, per_split)  # (none empty)
    if splits > 1:
        partial = torch.empty((splits, t, np_), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, m_tiles * n_tiles)
    else:
        partial = counters = out  # (unused)
    use_asm = capability.sm90_or_later(x.device)
    extra = {} if stages is None else {"num_stages": stages}
    grouped_linear_kernel[(m_tiles * n_tiles, splits)](
        x, offsets, w_data, w_scale, w_global_scale,
        x_global_scale if x_global_scale is not None else w_global_scale,  # unused without X_SCALED
        bias if bias is not None else w_global_scale,  # unused without HAS_BIAS
        out, partial, counters, x_scale if x_scale is not None else w_scale,  # unused without DOT_SCALED
        t, np_, k, e, n_out, m_tiles, per_split, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, X_SCALED=x_global_scale is not None, GATED=gated, USE_ASM=use_asm,
        DOT=tl.float32 if _interpreting() else tl.bfloat16, SPLIT=splits > 1,
        E_POW2=triton.next_power_of_2(e), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        REG_MMA=nb, WGMMA=wgmma, EVEN_K=k % block_k == 0, ACC_M=acc_m, DOT_SCALED=x_scale is not None,
        num_warps=warps, **extra,
    )
    return out

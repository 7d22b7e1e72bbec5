"""Grouped NVFP4 GEMM for mixture-of-experts layers (W4A16 and W4A4, eager): y[t] = x[t] @ W_e^T for the
tokens t of each expert e, W (E, N, K/2) row-major codes + (E, N, K/16) e4m3 scales + one fp32
global scale per expert.

Tokens arrive sorted by expert with `offsets` (E,) int32, the `torch._grouped_mm` convention:
expert e owns rows [offsets[e - 1], offsets[e]) (offsets[-1] read as 0). The counts stay on the
device, so the launch is sized for the worst case and every program finds its work itself:

1. Work list. Expert e needs ceil(count_e / BLOCK_M) token tiles; over all experts that is at most
   floor(T / BLOCK_M) + min(E, T) (each expert with rows adds at most one partial tile). The grid
   is that bound times ceil(N_OUT / BLOCK_N), by the K splits. Program (m, n) loads the E offsets, takes the inclusive cumulative sum of the
   tile counts, and finds its expert as the number of experts whose sum is <= m; a program past
   the last tile returns at once. No host sync, so a launch can be captured in a CUDA graph and
   replayed with other routings.
2. Mainloop, by the rows an expert gets on average (T / E; counts stay on the device):
   - decode (at most 16 on CUDA, sm_90 and up, bf16 x, K % 64 == 0): the dense decode kernel's register-fed mainloop
     (gemm_mma.mma_mainloop, row-major weights) on the expert's weights and 8, 16 or 32 rows of
     x, K split so that the few experts hit still fill the SMs (the dense split-K scheme: fp32
     partials, the tile's last split sums them in order);
   - W4A4 on GPUs with the block-scaled MMA (sm_100 and up), any rows (DOT_SCALED): x's per-group NVFP4 codes and scales and the
     experts' go to tl.dot_scaled (tcgen05 block-scaled MMA, 128 x 128 weight steps), no decode;
     compiled for sm_100 in CI and run on the CPU through a stand-in, never on hardware;
   - prefill (at least DEQUANT_MIN_ROWS on CUDA, sm_90 and up, N and K multiples of 16; not
     with x's codes): every expert dequantized to bf16 once, torch._grouped_mm, then step 3 as a
     kernel of its own over a work list of its own tiles (`_grouped_dequant`; each linear rounded
     once more, to bf16, in between);
   - otherwise, and under the interpreter: per K-step the (BLOCK_N, BLOCK_K) weight block is
     decoded in registers to e2m1 * s * 2^-7 (exact in bf16: gemm_splitk.decode_tile) and
     multiplied with the (BLOCK_M, BLOCK_K) x tile by tl.dot in fp32;
   x enters rounded to bf16 (W4A16); W4A4 passes x's quantized values (e2m1 * s_x, exact; on
   sm_100 its codes and scale bits) and one global scale per row.
3. Epilogue: acc * 2^7 (the decode's 2^-7 back; not after tl.dot_scaled or torch._grouped_mm)
   * g_e (* g_x per row) + bias_e, rounded once to the output dtype. The gated
   form (GATED) multiplies the same x tile by gate rows n and up rows I + n (Hugging Face's
   concatenated gate_up layout) and writes silu(gate) * up, each linear rounded to the output
   dtype first, as reference.silu_mul.
Rows at or past offsets[E - 1] are zero in the output (torch._grouped_mm leaves them unwritten).

On CUDA the offsets are never read back, so they are not checked there: values are clamped to
[0, T] (memory-safe; rows of an unordered group are computed with whichever expert the clamped
ranges give). The CPU reference raises on them.

Under the Triton interpreter (no inline PTX, no bf16 tl.dot) the decode is the byte form and the
products run in fp32; bf16 roundings are done on the bits (the interpreter's cast truncates).
"""

import os

import torch
import triton
import triton.language as tl

from .. import capability
from ..format import BLOCK_SIZE
from ._common import BLOCK, round_to
from . import gemm_configs, gemm_mma
from .gemm_mma import mma_mainloop
from .gemm_splitk import _mma_operands_fit, decode_tile, last_split, split_counters, split_tiles

_UNSCALE: tl.constexpr = tl.constexpr(2.0**7)  # the decode's 2^-7 (gemm_splitk's module docstring)

# The tl.dot mainloop's configs: BLOCK_M 16 (tl.dot's least) where most experts get a few tokens
# (decode where the register-fed mainloop does not fit), 64 where they get many (up to the
# dequantize form, or where it does not apply); two warps keep the dot on mma.sync at BLOCK_M 16, as the dense split-K kernel.
DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=2)
PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4)
# sm_100's block-scaled MMA (tcgen05 mxf4nvf4) takes 128 x 128 weight steps, as the dense kernel's.
DOT_SCALED_DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=128, num_warps=4)
DOT_SCALED_PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, num_warps=4)
# Under the interpreter a program costs per operation, not per element: few, small programs.
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=1)


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
def _weight_block(w_ptr, w_scale_ptr, rows, row_ok, k0, K, USE_ASM: tl.constexpr, DOT: tl.constexpr,
                  BLOCK_K: tl.constexpr, ROWS: tl.constexpr):
    """Rows `rows` (int64, ROWS) of one expert's row-major codes, K-step at k0 -> DOT (ROWS,
    BLOCK_K) e2m1 * s * 2^-7, exact (zeros past K and for rows not row_ok). USE_ASM: the word
    decode (inline PTX, sm_90 and up, bf16); else the byte decode in fp32."""
    block_cols = k0 // BLOCK + tl.arange(0, BLOCK_K // BLOCK)
    s_bits = tl.load(w_scale_ptr + rows[:, None] * (K // BLOCK) + block_cols[None, :],
                     mask=row_ok[:, None] & (block_cols < K // BLOCK)[None, :], other=0)
    byte3 = (block_cols * (BLOCK // 2))[None, :, None] + tl.arange(0, BLOCK // 2)[None, None, :]
    packed = tl.load(w_ptr + rows[:, None, None] * (K // 2) + byte3,
                     mask=row_ok[:, None, None] & (byte3 < K // 2), other=0)
    decoded: tl.constexpr = tl.bfloat16 if USE_ASM else tl.float32
    return decode_tile(packed, s_bits, USE_ASM, decoded, ROWS, BLOCK_K).to(DOT)


@triton.jit
def _packed_block(codes_ptr, scale_ptr, rows, row_ok, k0, K, stride_row, BLOCK_K: tl.constexpr):
    """Rows `rows` (int64) of row-major NVFP4 codes (row stride `stride_row` bytes) and their
    plain e4m3 scale bits (K/16 a row), K-step at k0 -> (rows, BLOCK_K / 2) uint8 codes, (rows,
    BLOCK_K / 16) uint8 bits; zeros past K and for rows not row_ok (code 0 and scale 0: zero)."""
    cols = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    codes = tl.load(codes_ptr + rows[:, None] * stride_row + cols[None, :],
                    mask=row_ok[:, None] & (cols < K // 2)[None, :], other=0)
    blocks = k0 // BLOCK + tl.arange(0, BLOCK_K // BLOCK)
    bits = tl.load(scale_ptr + rows[:, None] * (K // BLOCK) + blocks[None, :],
                   mask=row_ok[:, None] & (blocks < K // BLOCK)[None, :], other=0)
    return codes, bits


@triton.jit
def _dot_scaled_loop(x_ptr, x_scale_ptr, w_e, s_e, ts, t_ok, pid_n, K, N_OUT, stride_xt, t_begin, t_end,
                     GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """sm_100, W4A4: fp32 (BLOCK_N, BLOCK_M) products of the expert's weight rows pid_n * BLOCK_N...
    (w_e, s_e: its codes and scale bits) and x's rows ts (codes and scale bits), K-steps
    [t_begin, t_end) of tl.dot_scaled -> (acc, acc_up: the up rows' with GATED, else acc). GATED
    multiplies the gate rows and the up rows as one 2 * BLOCK_N-row operand (two accumulators in
    one loop fail Triton 3.6's sm_100 warp specialization)."""
    ROWS: tl.constexpr = 2 * BLOCK_N if GATED else BLOCK_N
    r = tl.arange(0, ROWS)
    cols = pid_n * BLOCK_N + r % BLOCK_N
    rows = cols.to(tl.int64) + (r // BLOCK_N) * N_OUT  # [gate rows, up rows] with GATED
    acc = tl.zeros((ROWS, BLOCK_M), tl.float32)
    for k0 in range(t_begin * BLOCK_K, t_end * BLOCK_K, BLOCK_K):
        x_t, x_bits = _packed_block(x_ptr, x_scale_ptr, ts, t_ok, k0, K, stride_xt, BLOCK_K)
        w, w_bits = _packed_block(w_e, s_e, rows, cols < N_OUT, k0, K, K // 2, BLOCK_K)
        acc = tl.dot_scaled(w, w_bits.to(tl.float8e4nv, bitcast=True), "e2m1", tl.trans(x_t),
                            x_bits.to(tl.float8e4nv, bitcast=True), "e2m1", acc)
    if GATED:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        return gate, up
    else:
        return acc, acc


@triton.jit
def grouped_linear_kernel(
    # pointers
    x_ptr, offsets_ptr, w_ptr, w_scale_ptr, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
    partial_ptr, counter_ptr, x_scale_ptr,
    # sizes
    T, N, K, E, N_OUT, steps_per_split,
    # strides
    stride_xt, stride_ot,
    # meta-parameters
    HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr, GATED: tl.constexpr, USE_ASM: tl.constexpr,
    DOT: tl.constexpr, SPLIT: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    REG_MMA: tl.constexpr = 0, LAYOUT: tl.constexpr = 1, EVEN_K: tl.constexpr = False,
    ACC_M: tl.constexpr = 16, DOT_SCALED: tl.constexpr = False,
):
    """out (T, N_OUT) for the work-list tile of this program (module docstring). N: weight rows an
    expert; N_OUT: N, or N / 2 with GATED (column n from weight rows n and N_OUT + n). Program
    (tile, split) multiplies K-steps [split * steps_per_split, ...); with SPLIT, its fp32 products
    go to partial (splits, T, N) and the tile's last split to finish sums them in split order and
    runs the epilogue (the dense split-K kernel's scheme: gemm_splitk.last_split).
    REG_MMA > 0: gemm_mma.mma_mainloop with REG_MMA blocks of 8 rows (BLOCK_M = 8 * REG_MMA,
    BLOCK_N = BLOCK_K = 64, 2 warps, K % 64 == 0) in its row-major LAYOUT 1 or 3 (EVEN_K: K a
    multiple of its step), K-steps counted in 64-k tiles; its tile is ACC_M = 8 * max(REG_MMA, 2)
    columns wide, those past BLOCK_M unused. Else ACC_M = BLOCK_M. HAS_BIAS: bias (E, N);
    X_SCALED: x_global_scale_ptr (T,), each row's global scale (W4A4). DOT_SCALED (sm_100, W4A4):
    x_ptr holds x's e2m1 codes (T, K/2) and x_scale_ptr their e4m3 bits (T, K/16); tl.dot_scaled
    multiplies both NVFP4 operands, the block scales applied by the tensor core."""
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    pid_k = tl.program_id(1)
    expert, row0, end, valid = _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M, E_POW2)
    if valid:
        ts = row0 + tl.arange(0, ACC_M)
        t_ok = (tl.arange(0, ACC_M) < BLOCK_M) & (ts < end)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        e64 = expert.to(tl.int64)
        if REG_MMA > 0:
            # The dense decode kernel's register-fed mainloop (gemm_mma.py, row-major LAYOUT 1 or 3)
            # on this expert's weights and this tile's rows of x. With K % 64 == 0 every expert's
            # codes start on 32 bytes and its scales on 4, as a dense weight's do.
            w_e = w_ptr + tl.multiple_of(e64 * N * (K // 2), 32)
            s_e = w_scale_ptr + tl.multiple_of(e64 * N * (K // BLOCK), 4)
            x_t = x_ptr + row0.to(tl.int64) * stride_xt
            m_rows = tl.minimum(end - row0, BLOCK_M)
            if LAYOUT == 3:
                tiles_k = tl.cdiv(K, gemm_mma.GROUP * BLOCK_K) * gemm_mma.GROUP
            else:
                tiles_k = tl.cdiv(K, BLOCK_K)
            t_begin, t_end = split_tiles(pid_k, steps_per_split, tiles_k)
            acc = mma_mainloop(x_t, w_e, s_e, m_rows, K, stride_xt, pid_n, t_begin, t_end, REG_MMA, EVEN_K,
                               0, N_OUT, K // BLOCK, LAYOUT)
            acc_up = acc
            if GATED:  # the up rows: a second weight stream, the same x
                acc_up = mma_mainloop(x_t, w_e + tl.multiple_of((e64 * 0 + N_OUT) * (K // 2), 32),
                                      s_e + tl.multiple_of((e64 * 0 + N_OUT) * (K // BLOCK), 4), m_rows,
                                      K, stride_xt, pid_n, t_begin, t_end, REG_MMA, EVEN_K, 0, N_OUT,
                                      K // BLOCK, LAYOUT)
        else:
            w_e = w_ptr + e64 * N * (K // 2)
            s_e = w_scale_ptr + e64 * N * (K // BLOCK)
            rows = e64 * 0 + cols  # int64 row indices within the expert
            # Swapped operands, as the dense kernels: the decoded weights (in registers) are the A
            # operand, x^T the B one, so acc is (BLOCK_N, BLOCK_M). (x as A and the decoded weights
            # as B does not compile for wgmma, 4 warps on sm_90: Triton 3.6 cannot lay the
            # register-made B operand out in shared memory.)
            t_begin, t_end = split_tiles(pid_k, steps_per_split, tl.cdiv(K, BLOCK_K))
            if DOT_SCALED:
                acc, acc_up = _dot_scaled_loop(x_ptr, x_scale_ptr, w_e, s_e, ts.to(tl.int64), t_ok, pid_n, K, N_OUT,
                                               stride_xt, t_begin, t_end, GATED, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                for k0 in range(t_begin * BLOCK_K, t_end * BLOCK_K, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    x = tl.load(x_ptr + ts.to(tl.int64)[:, None] * stride_xt + ks[None, :],
                                mask=t_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
                    x = round_to(x, tl.bfloat16).to(DOT)  # W4A16's x, rounded to nearest even (exact in DOT)
                    w = _weight_block(w_e, s_e, rows, col_ok, k0, K, USE_ASM, DOT, BLOCK_K, BLOCK_N)
                    acc = tl.dot(w, tl.trans(x), acc)
                    if GATED:
                        w_up = _weight_block(w_e, s_e, rows + N_OUT, col_ok, k0, K, USE_ASM, DOT, BLOCK_K,
                                             BLOCK_N)
                        acc_up = tl.dot(w_up, tl.trans(x), acc_up)
        UNSCALE: tl.constexpr = 1.0 if DOT_SCALED else _UNSCALE  # (the epilogue's: the decode's 2^-7 back)
        if SPLIT:
            # this split's products, then the tile's last split sums all of them, in split order
            mask = col_ok[:, None] & t_ok[None, :]
            place = ts.to(tl.int64)[None, :] * N + cols[:, None]
            split_stride = tl.cast(T, tl.int64) * N
            tl.store(partial_ptr + pid_k * split_stride + place, acc, mask=mask)
            if GATED:
                tl.store(partial_ptr + pid_k * split_stride + place + N_OUT, acc_up, mask=mask)
            if last_split(counter_ptr + tl.program_id(0), tl.num_programs(1)):
                acc = tl.zeros((BLOCK_N, ACC_M), tl.float32)
                acc_up = tl.zeros((BLOCK_N, ACC_M), tl.float32)
                for split in range(0, tl.num_programs(1)):
                    acc += tl.load(partial_ptr + split * split_stride + place, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(partial_ptr + split * split_stride + place + N_OUT, mask=mask,
                                          other=0.0, cache_modifier=".cg")
                _epilogue(acc, acc_up, expert, ts, t_ok, cols, col_ok, N, N_OUT, w_global_scale_ptr,
                          x_global_scale_ptr, bias_ptr, out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, UNSCALE)
        else:
            _epilogue(acc, acc_up, expert, ts, t_ok, cols, col_ok, N, N_OUT, w_global_scale_ptr,
                      x_global_scale_ptr, bias_ptr, out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, UNSCALE)


@triton.jit
def _epilogue(acc, acc_up, expert, ts, t_ok, cols, col_ok, N, N_OUT, w_global_scale_ptr, x_global_scale_ptr,
              bias_ptr, out_ptr, stride_ot, HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr,
              GATED: tl.constexpr, UNSCALE: tl.constexpr):
    """A tile's fp32 products (BLOCK_N, ACC_M) (acc_up: the up rows' with GATED) -> out; UNSCALE:
    what the products are multiplied by besides the global scales (2^7 after the decode's 2^-7)."""
    e64 = expert.to(tl.int64)
    g = tl.load(w_global_scale_ptr + expert) * UNSCALE
    if X_SCALED:
        g = g * tl.load(x_global_scale_ptr + ts, mask=t_ok, other=0.0)[None, :]
    y = acc * g
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + e64 * N + cols, mask=col_ok, other=0.0).to(tl.float32)[:, None]
    OUT: tl.constexpr = out_ptr.dtype.element_ty
    if GATED:
        up = acc_up * g
        if HAS_BIAS:
            up = up + tl.load(bias_ptr + e64 * N + N_OUT + cols, mask=col_ok,
                              other=0.0).to(tl.float32)[:, None]
        gate = round_to(y, OUT)
        y = round_to(gate / (1.0 + tl.exp(-gate)), OUT) * round_to(up, OUT)
    tl.store(out_ptr + ts.to(tl.int64)[None, :] * stride_ot + cols[:, None],
             round_to(y, OUT).to(OUT), mask=col_ok[:, None] & t_ok[None, :])


EPILOGUE_CONFIG = dict(BLOCK_M=32, BLOCK_N=128, num_warps=4)


@triton.jit
def grouped_epilogue_kernel(y_ptr, offsets_ptr, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
                            T, N, E, N_OUT, stride_yt, stride_ot, HAS_BIAS: tl.constexpr,
                            X_SCALED: tl.constexpr, GATED: tl.constexpr, E_POW2: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The prefill form's epilogue (_grouped_dequant): y (T, N) bf16 products of x and the
    experts' e2m1 * block scale -> out, over the kernel's work list, by its _epilogue."""
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    expert, row0, end, valid = _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M, E_POW2)
    if valid:
        ts = row0 + tl.arange(0, BLOCK_M)
        t_ok = ts < end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        mask = col_ok[:, None] & t_ok[None, :]
        place = y_ptr + ts.to(tl.int64)[None, :] * stride_yt + cols[:, None]
        acc = tl.load(place, mask=mask, other=0.0).to(tl.float32)
        acc_up = acc
        if GATED:
            acc_up = tl.load(place + N_OUT, mask=mask, other=0.0).to(tl.float32)
        _epilogue(acc, acc_up, expert, ts, t_ok, cols, col_ok, N, N_OUT, w_global_scale_ptr,
                  x_global_scale_ptr, bias_ptr, out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED, 1.0)


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
    """The register-fed mainloop's operands: the dense kernel's (gemm_splitk._mma_operands_fit),
    bf16 x, K % 64 == 0 (each expert's codes then start on 32 bytes, its scales on 4), contiguous
    weights, inline PTX (sm_90 and up, not the interpreter)."""
    return (not _interpreting() and capability.sm90_or_later(x.device) and x.dtype == torch.bfloat16
            and x.shape[1] % (4 * BLOCK_SIZE) == 0 and w_data.is_contiguous() and w_scale.is_contiguous()
            and _mma_operands_fit(x, w_data, w_scale, tiled=False))


# Decode: K split so that the programs of the tiles that can have rows (at most one per expert
# with rows, and there are at most min(T, E) of those) fill every SM PROGRAMS_PER_SM times, each
# split at least MIN_STEPS K-steps of the tl.dot mainloops (the register-fed one:
# gemm_configs.REG_MMA_GROUPED_MIN_STEPS), as the dense split-K kernel does (docs/gemm.md).
PROGRAMS_PER_SM = 8
MIN_STEPS = 4


def splits_for(tiles: int, steps: int, num_sms: int, min_steps: int = MIN_STEPS) -> int:
    """How many ranges K's `steps` steps are split into (1: no split) for `tiles` output tiles
    that have rows."""
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, tiles)
    return max(1, min(wanted, steps // min_steps))


# Prefill: from this many rows an expert on average (T / E), decoding each expert's weights once
# into bf16 and one torch._grouped_mm is about even with the kernel, which decodes them again in
# every row tile, and ahead above (docs/backend.md, the experts' kernel).
DEQUANT_MIN_ROWS = 64


def _dequant_runs(t: int, e: int, n: int, k: int, x: torch.Tensor) -> bool:
    """Whether the dequantize + torch._grouped_mm form takes this launch (CUDA, sm_90 and up,
    where the GEMM's operands are 16-byte aligned: N and K multiples of 16)."""
    return (x.is_cuda and not _interpreting() and capability.sm90_or_later(x.device) and t >= DEQUANT_MIN_ROWS * e
            and n % 16 == 0 and k % 16 == 0)


def _work_tiles(t: int, e: int, n_out: int, block_m: int, block_n: int) -> int:
    """The programs a work-list launch needs (module docstring, 1.): each expert's rows over
    block_m, at most t // block_m + min(e, t) row tiles in all (each expert with rows adds at most
    one partial tile), times the column tiles."""
    return (t // block_m + min(e, t)) * triton.cdiv(n_out, block_n)


def _grouped_dequant(x, offsets, w_data, w_scale, w_global_scale, bias, gated, x_global_scale, out_dtype):
    """The grouped GEMM as every expert dequantized to bf16 (e2m1 * block scale, exact), one
    torch._grouped_mm (bf16 products, rounded to bf16: torch's only output type) and
    grouped_epilogue_kernel (each row's expert's global scale, W4A4: times the row's, bias,
    silu(gate) * up, rounded to the output dtype): each linear is rounded once more than in the
    kernel. The offsets are clamped to [0, T] and made non-decreasing first (torch._grouped_mm
    reads memory by them); rows past the groups are zero."""
    from .dequantize import dequantize

    t, k = x.shape
    e, n = w_data.shape[0], w_data.shape[1]
    n_out = n // 2 if gated else n
    w = dequantize(w_data.reshape(e * n, k // 2), w_scale.reshape(e * n, k // BLOCK_SIZE), None, False,
                   torch.bfloat16).view(e, n, k)
    offsets = torch.cummax(offsets.clamp(0, t), 0).values
    y = torch._grouped_mm(x.to(torch.bfloat16), w.transpose(-2, -1), offs=offsets)
    del w
    out = torch.zeros((t, n_out), dtype=out_dtype, device=x.device)
    cfg = EPILOGUE_CONFIG
    tiles = _work_tiles(t, e, n_out, cfg["BLOCK_M"], cfg["BLOCK_N"])
    grouped_epilogue_kernel[(tiles,)](
        y, offsets, w_global_scale, x_global_scale if x_global_scale is not None else w_global_scale,
        bias if bias is not None else w_global_scale, out, t, n, e, n_out, y.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, X_SCALED=x_global_scale is not None, GATED=gated,
        E_POW2=triton.next_power_of_2(e), BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        num_warps=cfg["num_warps"])
    return out


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                   w_global_scale: torch.Tensor, bias: torch.Tensor | None, gated: bool,
                   x_global_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, splits: int | None = None,
                   dequant: bool | None = None, x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x (T, K) float, offsets (E,) int32, W (E, N, K/2) uint8 + (E, N, K/16) uint8 e4m3 bits +
    (E,) fp32, bias (E, N) or None -> (T, N) in out_dtype (default x.dtype), or (T, N/2)
    silu(gate) * up with gated. x_global_scale (T,) fp32: x holds W4A4's quantized values (bf16)
    and this each row's global scale. splits: K ranges (splits_for's choice at decode where None,
    else 1). dequant: the dequantize + torch._grouped_mm form (_dequant_runs' choice where None).
    x_scale (T, K/16) uint8 (sm_100, W4A4, with x_global_scale and out_dtype): x holds x's e2m1
    codes (T, K/2) uint8 and this their e4m3 bits, multiplied by the block-scaled MMA
    (DOT_SCALED; dequant is not asked).
    Arguments checked by the caller (moe.check_grouped_args)."""
    t, k = x.shape[0], x.shape[1] * (2 if x_scale is not None else 1)
    e, n = w_data.shape[0], w_data.shape[1]
    n_out = n // 2 if gated else n
    out_dtype = out_dtype or x.dtype
    if t == 0 or n_out == 0:
        return torch.zeros((t, n_out), dtype=out_dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    # the kernels index these with unit strides: a strided view (offsets[::2]) would be misread
    offsets, w_global_scale = offsets.contiguous(), w_global_scale.contiguous()
    if x_global_scale is not None:
        x_global_scale = x_global_scale.contiguous()
    if x_scale is not None:
        x_scale = x_scale.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    if x_scale is None and (_dequant_runs(t, e, n, k, x) if dequant is None else dequant):
        return _grouped_dequant(x, offsets, w_data, w_scale, w_global_scale, bias, gated, x_global_scale,
                                out_dtype)
    out = torch.zeros((t, n_out), dtype=out_dtype, device=x.device)  # rows past offsets[E - 1]: zero
    nb = _mma_blocks(t, e) if x_scale is None and _mma_fits(x, w_data, w_scale) else 0
    layout, unit = 1, 1  # the mma mainloop's K mapping; K-steps a split is counted in
    if nb:  # the register-fed mainloop: 64 weight rows by 8 * nb x rows, 64-k steps, two warps
        block_m, block_n, block_k, warps = 8 * nb, gemm_mma.TILE_N, gemm_mma.TILE_K, gemm_mma.WARPS
        acc_m = 8 * max(nb, 2)
        # plain scales read a word per 4 K-steps at 8 rows (the dense kernel's LAYOUT 3)
        if nb == 1 and w_scale.data_ptr() % 4 == 0:
            layout, unit = 3, gemm_mma.GROUP
        min_steps = gemm_configs.REG_MMA_GROUPED_MIN_STEPS
    else:
        cfg = _config(t, e, x_scale is not None)
        block_m, block_n, block_k, warps = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
        acc_m = block_m
        min_steps = None if cfg is PREFILL_CONFIG or cfg is DOT_SCALED_PREFILL_CONFIG else MIN_STEPS
    tiles = _work_tiles(t, e, n_out, block_m, block_n)
    units = triton.cdiv(k, unit * block_k)  # (groups of `unit` K-steps)
    if splits is None:
        splits = 1 if min_steps is None else splits_for(min(t, e) * triton.cdiv(n_out, block_n),
                                                        units * unit, capability.sm_count(x.device), min_steps)
    per_split = triton.cdiv(units, max(1, min(splits, units)))
    splits = triton.cdiv(units, per_split)  # (none empty)
    if splits > 1:
        partial = torch.empty((splits, t, n), dtype=torch.float32, device=x.device)
        counters = split_counters(x.device, tiles)
    else:
        partial = counters = out  # (unused)
    use_asm = capability.sm90_or_later(x.device)
    grouped_linear_kernel[(tiles, splits)](
        x, offsets, w_data, w_scale, w_global_scale,
        x_global_scale if x_global_scale is not None else w_global_scale,  # unused without X_SCALED
        bias if bias is not None else w_global_scale,  # unused without HAS_BIAS
        out, partial, counters, x_scale if x_scale is not None else w_scale,  # unused without DOT_SCALED
        t, n, k, e, n_out, per_split * unit, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, X_SCALED=x_global_scale is not None, GATED=gated, USE_ASM=use_asm,
        DOT=tl.float32 if _interpreting() else tl.bfloat16, SPLIT=splits > 1,
        E_POW2=triton.next_power_of_2(e), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        REG_MMA=nb, LAYOUT=layout, EVEN_K=k % (unit * block_k) == 0, ACC_M=acc_m, DOT_SCALED=x_scale is not None,
        num_warps=warps,
    )
    return out

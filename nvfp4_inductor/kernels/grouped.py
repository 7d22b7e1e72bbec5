"""Grouped NVFP4 GEMM for mixture-of-experts layers (W4A16, eager): y[t] = x[t] @ W_e^T for the
tokens t of each expert e, W (E, N, K/2) row-major codes + (E, N, K/16) e4m3 scales + one fp32
global scale per expert.

Tokens arrive sorted by expert with `offsets` (E,) int32, the `torch._grouped_mm` convention:
expert e owns rows [offsets[e - 1], offsets[e]) (offsets[-1] read as 0). The counts stay on the
device, so the launch is sized for the worst case and every program finds its work itself:

1. Work list. Expert e needs ceil(count_e / BLOCK_M) token tiles; over all experts that is at most
   ceil(T / BLOCK_M) + E (each expert adds at most one partial tile). The grid is that bound times
   ceil(N / BLOCK_N). Program (m, n) loads the E offsets, takes the inclusive cumulative sum of the
   tile counts, and finds its expert as the number of experts whose sum is <= m; a program past
   the last tile returns at once. No host sync, so a launch can be captured in a CUDA graph and
   replayed with other routings.
2. Mainloop. Per K-step the (BLOCK_N, BLOCK_K) weight block is decoded in registers to
   e2m1 * s * 2^-7 (exact in bf16: gemm_splitk.decode_tile, the dense kernels' decode) and
   multiplied with the (BLOCK_M, BLOCK_K) x tile by tl.dot in fp32. x enters rounded to bf16
   (W4A16); W4A4 passes x's quantized values (e2m1 * s_x, exact) and one global scale per row.
3. Epilogue: acc * 2^7 * g_e (* g_x per row) + bias_e, rounded once to the output dtype. The gated
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
from ._common import BLOCK, round_to
from .gemm_splitk import decode_tile, last_split, split_counters

_UNSCALE: tl.constexpr = tl.constexpr(2.0**7)  # the decode's 2^-7 (gemm_splitk's module docstring)

# One config: BLOCK_M 16 (tl.dot's least) where most experts get a few tokens (decode), 64 where
# they get many; two warps keep the dot on mma.sync at BLOCK_M 16, as the dense split-K kernel.
DECODE_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=2)
PREFILL_CONFIG = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, num_warps=4)
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
def grouped_linear_kernel(
    # pointers
    x_ptr, offsets_ptr, w_ptr, w_scale_ptr, w_global_scale_ptr, x_global_scale_ptr, bias_ptr, out_ptr,
    partial_ptr, counter_ptr,
    # sizes
    T, N, K, E, N_OUT, steps_per_split,
    # strides
    stride_xt, stride_ot,
    # meta-parameters
    HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr, GATED: tl.constexpr, USE_ASM: tl.constexpr,
    DOT: tl.constexpr, SPLIT: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out (T, N_OUT) for the work-list tile of this program (module docstring). N: weight rows a
    expert; N_OUT: N, or N / 2 with GATED (column n from weight rows n and N_OUT + n). Program
    (tile, split) multiplies K-steps [split * steps_per_split, ...); with SPLIT, its fp32 products
    go to partial (splits, T, N) and the tile's last split to finish sums them in split order and
    runs the epilogue (the dense split-K kernel's scheme: gemm_splitk.last_split)."""
    num_n = tl.cdiv(N_OUT, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    pid_k = tl.program_id(1)
    expert, row0, end, valid = _find_tile(offsets_ptr, E, T, pid_m, BLOCK_M, E_POW2)
    if valid:
        ts = row0 + tl.arange(0, BLOCK_M)
        t_ok = ts < end
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N_OUT
        e64 = expert.to(tl.int64)
        w_e = w_ptr + e64 * N * (K // 2)
        s_e = w_scale_ptr + e64 * N * (K // BLOCK)
        rows = e64 * 0 + cols  # int64 row indices within the expert
        # Swapped operands, as the dense kernels: the decoded weights (in registers) are the A
        # operand, x^T the B one, so acc is (BLOCK_N, BLOCK_M). (x as A and the decoded weights as B
        # does not compile for wgmma, 4 warps on sm_90: Triton 3.6 cannot lay the register-made B
        # operand out in shared memory.)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        k_begin = pid_k * steps_per_split * BLOCK_K
        k_end = tl.minimum(k_begin + steps_per_split * BLOCK_K, K)
        for k0 in range(k_begin, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_ptr + ts.to(tl.int64)[:, None] * stride_xt + ks[None, :],
                        mask=t_ok[:, None] & (ks < K)[None, :], other=0.0).to(tl.float32)
            x = round_to(x, tl.bfloat16).to(DOT)  # W4A16's x, rounded to nearest even (exact in DOT)
            w = _weight_block(w_e, s_e, rows, col_ok, k0, K, USE_ASM, DOT, BLOCK_K, BLOCK_N)
            acc = tl.dot(w, tl.trans(x), acc)
            if GATED:
                w_up = _weight_block(w_e, s_e, rows + N_OUT, col_ok, k0, K, USE_ASM, DOT, BLOCK_K, BLOCK_N)
                acc_up = tl.dot(w_up, tl.trans(x), acc_up)
        if SPLIT:
            # this split's products, then the tile's last split sums all of them, in split order
            mask = col_ok[:, None] & t_ok[None, :]
            place = ts.to(tl.int64)[None, :] * N + cols[:, None]
            split_stride = tl.cast(T, tl.int64) * N
            tl.store(partial_ptr + pid_k * split_stride + place, acc, mask=mask)
            if GATED:
                tl.store(partial_ptr + pid_k * split_stride + place + N_OUT, acc_up, mask=mask)
            if last_split(counter_ptr + tl.program_id(0), tl.num_programs(1)):
                acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                acc_up = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
                for split in range(0, tl.num_programs(1)):
                    acc += tl.load(partial_ptr + split * split_stride + place, mask=mask, other=0.0,
                                   cache_modifier=".cg")
                    if GATED:
                        acc_up += tl.load(partial_ptr + split * split_stride + place + N_OUT, mask=mask,
                                          other=0.0, cache_modifier=".cg")
                _epilogue(acc, acc_up, expert, ts, t_ok, cols, col_ok, N, N_OUT, w_global_scale_ptr,
                          x_global_scale_ptr, bias_ptr, out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED)
        else:
            _epilogue(acc, acc_up, expert, ts, t_ok, cols, col_ok, N, N_OUT, w_global_scale_ptr,
                      x_global_scale_ptr, bias_ptr, out_ptr, stride_ot, HAS_BIAS, X_SCALED, GATED)


@triton.jit
def _epilogue(acc, acc_up, expert, ts, t_ok, cols, col_ok, N, N_OUT, w_global_scale_ptr, x_global_scale_ptr,
              bias_ptr, out_ptr, stride_ot, HAS_BIAS: tl.constexpr, X_SCALED: tl.constexpr,
              GATED: tl.constexpr):
    """A tile's fp32 products (BLOCK_N, BLOCK_M) (acc_up: the up rows' with GATED) -> out."""
    e64 = expert.to(tl.int64)
    g = tl.load(w_global_scale_ptr + expert) * _UNSCALE
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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _config(t: int, e: int) -> dict:
    """Block sizes from the shapes only (the per-expert counts are on the device): decode tiles
    where an expert gets at most 16 rows on average."""
    if _interpreting():
        return INTERPRET_CONFIG
    return DECODE_CONFIG if t <= 16 * e else PREFILL_CONFIG


# Decode: K split so that the programs of the tiles that can have rows (at most one per expert
# with rows, and there are at most min(T, E) of those) fill every SM PROGRAMS_PER_SM times, each
# split at least MIN_STEPS K-steps: the dense split-K kernel's rule (docs/gemm.md, tuning rules).
PROGRAMS_PER_SM = 8
MIN_STEPS = 4


def splits_for(t: int, e: int, n_out: int, k: int, cfg: dict, num_sms: int) -> int:
    """How many ranges K is split into (1: no split) for a launch of t rows over e experts."""
    if cfg is PREFILL_CONFIG:
        return 1
    tiles = min(t, e) * triton.cdiv(n_out, cfg["BLOCK_N"])
    steps = triton.cdiv(k, cfg["BLOCK_K"])
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, tiles)
    return max(1, min(wanted, steps // MIN_STEPS))


def grouped_linear(x: torch.Tensor, offsets: torch.Tensor, w_data: torch.Tensor, w_scale: torch.Tensor,
                   w_global_scale: torch.Tensor, bias: torch.Tensor | None, gated: bool,
                   x_global_scale: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, splits: int | None = None) -> torch.Tensor:
    """x (T, K) float, offsets (E,) int32, W (E, N, K/2) uint8 + (E, N, K/16) uint8 e4m3 bits +
    (E,) fp32, bias (E, N) or None -> (T, N) in out_dtype (default x.dtype), or (T, N/2)
    silu(gate) * up with gated. x_global_scale (T,) fp32: x holds W4A4's quantized values (bf16)
    and this each row's global scale. splits: K ranges (splits_for's choice where None).
    Arguments checked by the caller (moe.check_grouped_args)."""
    t, k = x.shape
    e, n = w_data.shape[0], w_data.shape[1]
    n_out = n // 2 if gated else n
    out = torch.zeros((t, n_out), dtype=out_dtype or x.dtype, device=x.device)  # rows past offsets[E - 1]: zero
    if t == 0 or n_out == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    # the kernel indexes these with unit strides: a strided view (offsets[::2]) would be misread
    offsets, w_global_scale = offsets.contiguous(), w_global_scale.contiguous()
    if x_global_scale is not None:
        x_global_scale = x_global_scale.contiguous()
    if bias is not None:
        bias = bias.contiguous()
    cfg = _config(t, e)
    block_m, block_n, block_k = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    if splits is None:
        splits = splits_for(t, e, n_out, k, cfg, capability.sm_count(x.device))
    steps = triton.cdiv(k, block_k)
    per_split = triton.cdiv(steps, max(1, min(splits, steps)))
    splits = triton.cdiv(steps, per_split)  # (none empty)
    tiles = (triton.cdiv(t, block_m) + e) * triton.cdiv(n_out, block_n)
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
        out, partial, counters, t, n, k, e, n_out, per_split, x.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, X_SCALED=x_global_scale is not None, GATED=gated, USE_ASM=use_asm,
        DOT=tl.float32 if _interpreting() else tl.bfloat16, SPLIT=splits > 1,
        E_POW2=triton.next_power_of_2(e), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg["num_warps"],
    )
    return out

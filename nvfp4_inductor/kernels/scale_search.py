"""Weight scale search on the GPU: per 16-element block, the E4M3 scale with the smallest error
("mse": squared error; "hessian": (w - w_hat)^T H_g (w - w_hat)), then the codes for it.

The error, its fp32 order and the choice rule are `nvfp4_inductor.reference.scale_search`'s (the reference,
a brute-force sweep); this kernel computes the same fp32 numbers (compiled with
enable_fp_fusion=False: a contracted multiply-add would round differently from the reference) and
chooses the same scale, but evaluates only the candidates that can win.

Layout: program p handles block column (group) grp = p % (K/16) of rows
[(p // (K/16)) * BLOCK_R, + BLOCK_R): one thread per block, its 16 values in 16 registers (a tuple
of (BLOCK_R,) tensors, so every sum has the reference's order and nothing is reduced across
threads), the group's U = hessian_operand(H)[grp] as uniform scalars. Outputs: codes (M, K/2),
chosen bits (M, K/16) uint8, optionally the chosen error (M, K/16) fp32.

Search (PRUNE), from the RTN bits c0, downward then upward; per thread, a candidate is evaluated
only if a cheap lower bound does not already exclude it; a program stops a direction once no
thread's bound allows further candidates. lambda (per group) is 1 for "mse"; for "hessian" a lower
bound of the smallest eigenvalue of H_g with the fp32 evaluation error taken off,
lambda = lambda_min(H_g) - 2^-16 * max_i sum_j |U_ij| (0 if that is negative: then the bounds
are off and the direction is swept fully). lambda > 0 also makes every computed E >= 0; with
lambda = 0 (a singular H_g, e.g. from fewer than 16 calibration tokens) rounding can make E
negative, and a test "0 > best" would cut candidates with a still smaller E, so the bounds are
used only where lambda > 0. Why each cut is safe (E = the reference's computed error):

- Clip bound (downward). B(c) = s^2 * tree_sum((y_i - 6)^2 over y_i >= 6) uses the terms of E
  (q = 6 there) and zeros elsewhere; fp32 rounding is monotone, so B(c) <= E(c) exactly for "mse",
  and E(c) >= lambda * B(c) * (1 - 8 eps) for "hessian" (e^T H e >= lambda_min |e|^2; the form's
  own rounding is what the 2^-16 term pays for). In exact arithmetic B(c) = sum (|x|/g - 6 s)^2_+
  grows as s falls; the computed value follows within 2^-16 relative plus s^2 * 2^-14 absolute
  (cancellation in y - 6), so a candidate with
      lambda * B(c) > best * (1 + 2^-10) + lambda * s^2 * 2^-12
  and every smaller one have E > best: the downward sweep stops there.
- Zero bound (upward). Z(c) = s^2 * tree_sum(y_i^2 over y_i <= 0.25) (those codes are 0, d = y)
  also uses E's terms; its computed set only grows with s and its terms equal x^2 / g^2 within
  ~20 eps, purely relative, so lambda * Z(c) * (1 - 2^-10) > best ends the upward sweep.
- All-zero candidates (max y <= 0.25) all have E_zero (the reference defines it so): only the
  smallest, c_z (found by bisection, max y being monotone in c), can be chosen; the upward sweep
  stops on reaching it.
- "mse" only, dominance: if max y <= 3 under scale s (s >= 2^-5, so s / 2 is the e4m3 bits c - 8;
  s g >= 2^-100; the block's smallest nonzero |x| >= amax * 2^-60, so no d^2 underflows), then
  s / 2 has r' = 2r, y' = 2y exactly, and its nearest code q' is at least as close to 2y as 2q
  (every code <= 3, doubled, is a code): |d'| <= 2|d| after rounding, so
  E(s / 2) = (s^2/4) * sum d'^2 <= s^2 * sum d^2 = E(s). A tie goes to the smaller bits, so s is
  never chosen; nor is any larger scale (max y only falls): the upward sweep stops. This does not
  hold for "hessian" (error vectors of the same size can be better or worse aligned with H).
Each excluded candidate has E > best, or is matched by a smaller candidate with E no larger, so
the result is the brute force's (tests check bits and errors against it). PRUNE=False is that
brute force on the GPU (all 126 candidates, one kernel), the benchmark's baseline.
"""

import os

import torch
import triton
import triton.language as tl

from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.kernels.device.common import block_scale_bits, e2m1_index_bits, e4m3_bits_to_f32, reciprocal_operands
from nvfp4_inductor.kernels.quantize import amax_partials_kernel, AMAX_TILE, MAX_PARTIALS
from nvfp4_inductor.reference import global_scale_from_amax
from nvfp4_inductor.reference.scale_search import hessian_operand

# One warp per program: the "any thread still searching" tests are warp shuffles (no barrier), and a
# direction's sweep lasts as long as its slowest of 32 blocks, not of more.
NUM_WARPS = 1
BLOCK_R = 32 * NUM_WARPS
# Under the Triton interpreter a program costs per operation, not per element: more rows each.
INTERPRET_BLOCK_R = 512
MAX_BITS: tl.constexpr = tl.constexpr(0x7E)  # largest finite e4m3
ALL_ZERO_Y: tl.constexpr = tl.constexpr(0.25)
DOMINATED_Y: tl.constexpr = tl.constexpr(3.0)
MIN_HALVABLE_SCALE: tl.constexpr = tl.constexpr(2.0**-5)
MIN_HALVABLE_SG: tl.constexpr = tl.constexpr(2.0**-100)
SMALLEST_RATIO: tl.constexpr = tl.constexpr(2.0**-60)
REL_MARGIN: tl.constexpr = tl.constexpr(2.0**-10)
ABS_MARGIN: tl.constexpr = tl.constexpr(2.0**-12)
_RNE_MAGIC: tl.constexpr = tl.constexpr(2.0**23)
LAMBDA_SLACK = 2.0**-16


@triton.jit
def _tree_sum(v):
    """16-tuple -> adjacent pairs summed, four levels (scale_search.tree_sum's order)."""
    a = ()
    for i in tl.static_range(8):
        a = a + (v[2 * i] + v[2 * i + 1],)
    b = ()
    for i in tl.static_range(4):
        b = b + (a[2 * i] + a[2 * i + 1],)
    return ((b[0] + b[1]) + (b[2] + b[3]))


@triton.jit
def _e2m1_nearest(y):
    """fp32 y >= 0 -> the nearest E2M1 value (ties to even, saturating at 6), as fp32."""
    a = tl.minimum(y, 6.0)
    b = a.to(tl.int32, bitcast=True)
    large = ((b + (0x1FFFFF + ((b >> 22) & 1))) & -4194304).to(tl.float32, bitcast=True)
    small = ((a * 2.0 + _RNE_MAGIC) - _RNE_MAGIC) * 0.5  # rne(2a) / 2: 0, 0.5 or 1
    return tl.where(a < 1.0, small, large)


@triton.jit
def _form(d, neg, u, HESSIAN: tl.constexpr):
    """Scaled residuals (16-tuple) -> tree_sum(d_i^2), or tree_sum(e_i t_i) with e = sign(x) d."""
    if HESSIAN:
        e = ()
        for i in tl.static_range(16):
            e = e + (tl.where(neg[i], -d[i], d[i]),)
        terms = ()
        for i in tl.static_range(16):
            t = u[i * 16 + i] * e[i]
            for j in tl.static_range(i + 1, 16):
                t = t + u[i * 16 + j] * e[j]
            terms = terms + (e[i] * t,)
    else:
        terms = ()
        for i in tl.static_range(16):
            terms = terms + (d[i] * d[i],)
    return _tree_sum(terms)


@triton.jit
def _scale_of(c, g):
    """Scale bits (int32 tensor), g * k -> (s, 1 / (s g k), s^2)."""
    s = e4m3_bits_to_f32(c)
    r = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s * g)
    return s, r, s * s


@triton.jit
def _error(xa, neg, u, r, s2, HESSIAN: tl.constexpr):
    d = ()
    for i in tl.static_range(16):
        y = xa[i] * r
        d = d + (y - _e2m1_nearest(y),)
    return s2 * _form(d, neg, u, HESSIAN)


@triton.jit
def _zero_error(xa, neg, u, g, HESSIAN: tl.constexpr):
    """E_zero: the error of all-zero codes, with s = 1 and r = 1 / (g k) (xa: |x| k)."""
    r = tl.math.div_rn(tl.full(xa[0].shape, 1.0, tl.float32), g)
    d = ()
    for i in tl.static_range(16):
        d = d + (xa[i] * r,)
    return _form(d, neg, u, HESSIAN)


@triton.jit
def _bound(xa, r, s2, CLIP: tl.constexpr):
    """s^2 * tree_sum of E's own terms where they are known without encoding: (y - 6)^2 where
    y >= 6 (CLIP), or y^2 where y <= 0.25."""
    terms = ()
    for i in tl.static_range(16):
        y = xa[i] * r
        if CLIP:
            t = tl.where(y >= 6.0, (y - 6.0) * (y - 6.0), 0.0)
        else:
            t = tl.where(y <= ALL_ZERO_Y, y * y, 0.0)
        terms = terms + (t,)
    return s2 * _tree_sum(terms)


@triton.jit
def _take(err, c, best, best_c, c0, consider):
    """Keep the smaller error; on a tie RTN (c0) stays, else the smaller bits win."""
    better = consider & ((err < best) | ((err == best) & (best_c != c0) & (c < best_c)))
    return tl.where(better, err, best), tl.where(better, c, best_c)


@triton.jit
def _any(mask):
    return tl.max(mask.to(tl.int32), axis=0) > 0


@triton.jit
def _scale_search_kernel(
    # pointers
    x_ptr, data_ptr, scale_ptr, err_ptr, g_ptr, u_ptr, lam_ptr,
    # sizes and strides
    M, K, stride_xm,
    # meta-parameters
    HESSIAN: tl.constexpr, PRUNE: tl.constexpr, WRITE_ERR: tl.constexpr, BLOCK_R: tl.constexpr,
):
    groups = K // 16
    pid = tl.program_id(0)
    grp = pid % groups
    rows = (pid // groups) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < M
    base = x_ptr + rows.to(tl.int64) * stride_xm + grp * 16
    g = tl.load(g_ptr)

    xa = ()
    neg = ()
    signs = ()
    amax = tl.zeros((BLOCK_R,), tl.float32)
    min_nonzero = tl.full((BLOCK_R,), float("inf"), tl.float32)
    finite = row_ok
    for j in tl.static_range(16):
        v = tl.load(base + j, mask=row_ok, other=0.0).to(tl.float32)
        a = tl.abs(v)
        xa = xa + (a,)
        neg = neg + (v < 0.0,)
        signs = signs + ((v.to(tl.int32, bitcast=True) >> 28) & 8,)  # sign bit -> code bit 3
        finite = finite & (a < float("inf"))  # NaN: False
        amax = tl.maximum(amax, a)
        min_nonzero = tl.minimum(min_nonzero, tl.where(a > 0.0, a, float("inf")))
    g_rows = g + tl.zeros((BLOCK_R,), tl.float32)
    g_ok = (g_rows > 0.0) & (g_rows < float("inf"))  # NaN: False
    c0 = block_scale_bits(amax, finite & g_ok, g)  # RTN bits (0x7F for bad blocks)
    # From here on the element step's operands: |x| k and g k (both exact; k = 1 unless g < 2^-100).
    k, g_k = reciprocal_operands(g)
    xk = ()
    for j in tl.static_range(16):
        xk = xk + (xa[j] * k,)
    amax_k = amax * k

    if HESSIAN:
        u = ()
        for i in tl.static_range(256):
            u = u + (tl.load(u_ptr + grp * 256 + i),)
        lam = tl.load(lam_ptr + grp)
        bounded = (lam + tl.zeros((BLOCK_R,), tl.float32)) > 0.0  # lambda = 0: bounds off
    else:
        u = ()
        lam = 1.0

    # Baseline: RTN, and the all-zero candidate c_z (smallest bits whose max y <= 0.25).
    searching = finite & g_ok & (amax > 0.0)
    e_zero = _zero_error(xk, neg, u, g_k, HESSIAN)
    c0_eval = tl.minimum(tl.maximum(c0, 1), MAX_BITS)
    _, r_0, s2_0 = _scale_of(c0_eval, g_k)
    e_rtn = _error(xk, neg, u, r_0, s2_0, HESSIAN)
    best = tl.where(c0 == 0, e_zero, tl.where(searching, e_rtn, float("nan")))
    best = tl.where(finite & g_ok, best, float("nan"))
    best_c = c0

    if PRUNE:
        lo = tl.full((BLOCK_R,), 1, tl.int32)
        hi = tl.full((BLOCK_R,), 127, tl.int32)
        for _ in tl.static_range(7):  # 127 possibilities -> 7 halvings
            mid = (lo + hi) // 2
            _, r_m, _ = _scale_of(mid, g_k)
            zero_at_mid = amax_k * r_m <= ALL_ZERO_Y
            hi = tl.where(zero_at_mid, mid, hi)
            lo = tl.where(zero_at_mid, lo, mid + 1)
        c_z = lo
        best, best_c = _take(e_zero, c_z, best, best_c, c0, searching & (c_z <= MAX_BITS))
        halvable = min_nonzero >= amax * SMALLEST_RATIO

        # Downward from c0 - 1: clip bound.
        c = c0 - 1
        active = searching & (c >= 1)
        while _any(active):
            c_eval = tl.maximum(c, 1)
            s, r, s2 = _scale_of(c_eval, g_k)
            bound = _bound(xk, r, s2, True)
            far = lam * bound > best * (1.0 + REL_MARGIN) + lam * s2 * ABS_MARGIN
            if HESSIAN:
                far = far & bounded  # best may be < 0 where lambda = 0 (see above)
            need = active & (far == 0)
            if _any(need):
                err = _error(xk, neg, u, r, s2, HESSIAN)
                best, best_c = _take(err, c_eval, best, best_c, c0, need)
            c = c - 1
            active = need & (c >= 1)

        # Upward from c0 + 1: zero bound, all-zero stop, dominance ("mse").
        c = c0 + 1
        active = searching & (c <= MAX_BITS)
        while _any(active):
            c_eval = tl.minimum(c, MAX_BITS)
            s, r, s2 = _scale_of(c_eval, g_k)
            y_max = amax_k * r
            stop = y_max <= ALL_ZERO_Y
            if not HESSIAN:
                stop = stop | ((y_max <= DOMINATED_Y) & (s >= MIN_HALVABLE_SCALE)
                               & (s * g >= MIN_HALVABLE_SG) & halvable)
            bound = _bound(xk, r, s2, False)
            if HESSIAN:
                stop = stop | (bounded & (lam * bound * (1.0 - REL_MARGIN) > best))
            else:
                stop = stop | (bound * (1.0 - REL_MARGIN) > best)
            need = active & (stop == 0)
            if _any(need):
                err = _error(xk, neg, u, r, s2, HESSIAN)
                best, best_c = _take(err, c_eval, best, best_c, c0, need)
            c = c + 1
            active = need & (c <= MAX_BITS)
    else:
        for cand in range(1, 127):
            c = tl.full((BLOCK_R,), cand, tl.int32)
            s, r, s2 = _scale_of(c, g_k)
            err = _error(xk, neg, u, r, s2, HESSIAN)
            err = tl.where(amax_k * r <= ALL_ZERO_Y, e_zero, err)
            best, best_c = _take(err, c, best, best_c, c0, searching)

    # Codes for the chosen scale, exactly as the quantizer encodes (zero / NaN scale: all +0).
    usable = (best_c >= 1) & (best_c <= MAX_BITS)
    _, r, _ = _scale_of(tl.minimum(tl.maximum(best_c, 1), MAX_BITS), g_k)
    word = tl.zeros((BLOCK_R,), tl.int64)
    for j in tl.static_range(16):
        code = (e2m1_index_bits(xk[j] * r) & 7) | signs[j]
        word = word | (code.to(tl.int64) << (4 * j))
    word = tl.where(usable, word, 0)
    block = rows.to(tl.int64) * groups + grp
    tl.store(data_ptr.to(tl.pointer_type(tl.int64)) + block, word, mask=row_ok)
    tl.store(scale_ptr + block, best_c.to(tl.uint8), mask=row_ok)
    if WRITE_ERR:
        tl.store(err_ptr + block, best, mask=row_ok)


def hessian_bounds(u: torch.Tensor) -> torch.Tensor:
    """U (K/16, 16, 16) -> per-group lambda: lambda_min of the symmetric H minus the fp32 slack
    2^-16 * max_i sum_j |U_ij|, clamped at 0; 0 where U is not finite (no pruning)."""
    finite = torch.isfinite(u).all(-1).all(-1)
    u64 = torch.where(finite[:, None, None], u, 0).double()
    sym = (u64 + u64.transpose(-1, -2)) / 2  # U + U^T = H + H^T off the diagonal, 2 diag(H) on it
    lam = torch.linalg.eigvalsh(sym)[:, 0] - LAMBDA_SLACK * u64.abs().sum(-1).amax(-1)
    return torch.where(finite, lam.clamp_min(0), 0).float()


def _dynamic_global_scale(x2: torch.Tensor) -> torch.Tensor:
    """Per-tensor g = amax / 2688 of the finite elements, on the device (no host sync)."""
    m, k = x2.shape
    amax_m, amax_k = AMAX_TILE
    num = max(1, min(triton.cdiv(m, amax_m) * triton.cdiv(k, amax_k), MAX_PARTIALS))
    partials = torch.zeros(num, dtype=torch.float32, device=x2.device)
    if m:
        amax_partials_kernel[(num,)](x2, partials, m, k, x2.stride(0), num,
                                      BLOCK_M=amax_m, BLOCK_K=amax_k)
    return global_scale_from_amax(partials.amax())


def hessian_operands(hessian: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """H (K/16, 16, 16) -> (U, lambda) as the kernel reads them. The eigenvalues sync with the
    host (cuSOLVER), so a caller timing or graph-capturing search() prepares these once."""
    u = hessian_operand(hessian).contiguous()
    return u, hessian_bounds(u)


def search(x: torch.Tensor, global_scale: torch.Tensor | None, method: str,
           hessian: torch.Tensor | None = None, prune: bool = True, operands=None):
    """(..., K) weights -> (data uint8 (..., K/2), chosen e4m3 bits uint8 (..., K/16),
    g fp32 (), chosen errors fp32 (..., K/16)); arguments checked by the caller. operands:
    hessian_operands(hessian), if already computed."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, groups = x2.shape[0], k // BLOCK_SIZE
    # a given scale is copied: returned as is, it would alias an input of nvfp4::quantize_weight,
    # which torch.library refuses (and a later in-place change of it would change the result's)
    g = (_dynamic_global_scale(x2) if global_scale is None
         else global_scale.to(torch.float32, copy=True).reshape(()))
    data = torch.empty((*lead, k // 2), dtype=torch.uint8, device=x.device)
    scale = torch.empty((*lead, groups), dtype=torch.uint8, device=x.device)
    errors = torch.empty((*lead, groups), dtype=torch.float32, device=x.device)
    is_hessian = method == "hessian"
    if is_hessian:
        u, lam = operands if operands is not None else hessian_operands(hessian)
    else:
        u = lam = g  # unused pointers
    block_r = INTERPRET_BLOCK_R if os.environ.get("TRITON_INTERPRET") == "1" else BLOCK_R
    if m:
        grid = (triton.cdiv(m, block_r) * groups,)
        _scale_search_kernel[grid](
            x2, data, scale, errors, g, u, lam, m, k, x2.stride(0),
            HESSIAN=is_hessian, PRUNE=prune, WRITE_ERR=True, BLOCK_R=block_r,
            num_warps=NUM_WARPS, enable_fp_fusion=False)
    return data, scale, g, errors

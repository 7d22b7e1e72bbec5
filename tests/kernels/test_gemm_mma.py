"""kernels/device/mma.py: the split-K GEMM's register-fed mainloop (mma.sync from registers, inline
PTX). Its lane maps and row-major addressing run through its helpers under the interpreter; the
whole kernel runs on a GPU (marked gpu) against the reference linear; and the launcher refuses it
where it cannot run."""

import pytest
import torch
import triton
import triton.language as tl

import nvfp4_inductor as nv
from helpers.gemm import pin_splitk_config, splitk
from nvfp4_inductor.reference import tiled as nv_tiled
from nvfp4_inductor.kernels import gemm_splitk, plan
from nvfp4_inductor.kernels.device import mma as gemm_mma


def _rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def _reg_mma_weights(w, layout):
    """-> (codes, scale bits, tiled_n, swizzled, byte offset of row 1's second block scale)."""
    if layout == "tiled":
        data_t, scale_t = nv_tiled.tile(w.data, w.scale.view(torch.uint8))
        return data_t, scale_t, w.shape[0], False, nv_tiled.scale_index(1, 1)  # tile 0, row 1, block 1
    nan_at = 16 + 1 if w.swizzled else w.shape[1] // 16 + 1  # (the swizzled layout: row r % 32 at 16 * r)
    return w.data, w.scale.view(torch.uint8), None, w.swizzled, nan_at


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (3, 80, 208), (5, 96, 1344), (2, 64, 1024), (8, 192, 1040),
                                     (9, 128, 512), (16, 1056, 4160), (17, 64, 320), (32, 208, 1040),
                                     (1, 128, 4160)])
@pytest.mark.parametrize("splits", [1, 3, 33])
@pytest.mark.parametrize("layout", ["tiled", "rows", "rows-swizzled"])
def test_register_fed_mainloop_matches_reference(m, n, k, splits, layout, monkeypatch):
    """gemm_mma's lane mapping, K tails (K not a multiple of the 64-wide tile), N not a tile
    multiple, one, two and four x-row blocks (M <= 8, 9..16, 17..32), NaN-free wide-range inputs and per-row
    weight scales, split K (the last split sums the partials) and not; weights tiled or in the
    row-major interchange layout with plain or swizzled scales (plain scales with K % 64 == 0 at
    M <= 8 are read a word per 4 K-tiles: one and several such groups, K % 256 != 0 too)."""
    gen = torch.Generator().manual_seed(m * 7 + n + k + splits)
    x = (torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, k)).to(torch.bfloat16)
    w = nv.quantize(torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, n)[:, None], per_row=True,
                    swizzle=layout == "rows-swizzled")
    bias = torch.randn(n, generator=gen)
    data, scale, tiled_n, swizzled, nan_at = _reg_mma_weights(w, layout)
    with monkeypatch.context() as patch:
        pin_splitk_config(patch, (16 if m <= 16 else 32, 64, 64, splits, gemm_mma.WARPS, 1))
        y = splitk(x.cuda(), data.cuda(), scale.cuda(), w.global_scale.cuda(), bias.cuda(),
                                    torch.float32, swizzled, tiled_n=tiled_n, mainloop="mma")
    want = x.double() @ w.dequantize(torch.float32).double().T + bias.double()
    assert _rel(y, want) <= 1e-5
    # a NaN block scale makes exactly its own weight row NaN (the default choice of mainloop)
    scale_nan = scale.clone()
    scale_nan.view(-1)[nan_at] = 0x7F
    y = gemm_splitk.gemm_splitk(x.cuda(), data.cuda(), scale_nan.cuda(),
                                w.global_scale.cuda(), None, torch.float32, swizzled, tiled_n=tiled_n)
    assert y[:, 1].isnan().all() and not y[:, [0] + list(range(2, n))].isnan().any()


@triton.jit
def _row_major_reads(w_ptr, s_ptr, x_ptr, codes_ptr, scales_ptr, xs_ptr, M, N, K, scale_cols, stride_xm,
                     TILES: tl.constexpr, LAYOUT: tl.constexpr):
    """What each lane of the register-fed mainloop reads from a row-major W and x (two x-row
    blocks) for K-tiles 0 .. TILES - 1 of tile row program_id(0), through its addressing helpers:
    codes (tile rows, TILES, 64 lanes, 4 rows, 2 words), scale bytes (tile rows, TILES, 64 lanes,
    4 rows), x words (tile rows, TILES, 64 lanes, 2 x rows, 8 words). The grouped scale word is
    split by shifts here (the kernel's byte permute is inline PTX)."""
    pid_n = tl.program_id(0)
    i = tl.arange(0, 64)
    lane = i % 32
    q = lane % 4
    wp, sp = gemm_mma.row_major_pointers(w_ptr, s_ptr, pid_n * 64 + (i // 32) * 32 + lane // 4, q, N, K,
                                         scale_cols, LAYOUT)
    kq = gemm_mma.lane_k(q, LAYOUT)
    x_rows = gemm_mma.lane_x_rows(lane // 4, kq, M, stride_xm, 2)
    held = (tl.zeros([64], tl.uint32),) * 8  # LAYOUT 3: codes of the next tile, from a 16-byte load
    for step in tl.static_range(TILES):
        t = pid_n * 0 + step  # a tensor, as the kernel's loop index is
        _, xw, k = gemm_mma._tile_offsets(t, LAYOUT)
        k_ok = k + kq < K
        at = (pid_n * TILES + step) * 64 + i
        xs = gemm_mma._load_xs(x_ptr.to(tl.pointer_type(tl.uint32)), x_rows, xw, k_ok, 2, False)
        for h in tl.static_range(2):
            for v in tl.static_range(8):
                tl.store(xs_ptr + (at * 2 + h) * 8 + v, xs[h][v].to(tl.int32, bitcast=True))
        w, held = gemm_mma.load_codes_rm(wp, t, held, k_ok, LAYOUT, False)
        for v in tl.static_range(8):
            tl.store(codes_ptr + at * 8 + v, w[v].to(tl.int32, bitcast=True))
        for j in tl.static_range(4):
            if LAYOUT == 3:  # the group's word, loaded at its first tile (t - t % 4 words in)
                byte = (gemm_mma._load_rm(sp[j] + (t - t % 4), k_ok, False) >> (8 * (t % 4))) & 0xFF
            else:
                byte = gemm_mma._load_rm(sp[j] + t * (4 if LAYOUT == 1 else 512), k_ok, False)
            tl.store(scales_ptr + at * 4 + j, byte.to(tl.int32))


@pytest.mark.parametrize("layout, n, k", [(1, 80, 208), (2, 80, 208), (2, 200, 1024), (3, 80, 1344),
                                          (3, 64, 512)])
def test_row_major_addressing(kernel_device, layout, n, k):
    """The register-fed mainloop's row-major addressing (row_major_pointers, _tile_offsets, the
    loads), run on CPU tensors in CI: every lane reads, for each K-tile, the codes and block scale
    of its four rows (clamped to N - 1) at the 16-k block its layout assigns (block 4t + q; grouped:
    4q + t % 4 of group t // 4), zeros past K; swizzled scales at their swizzled offsets; and x's
    rows g, g + 8 (at most M - 1) at the same block."""
    if kernel_device == "cuda":
        pytest.skip("the GPU tests run the whole kernel on these layouts")
    gen = torch.Generator().manual_seed(layout * 1000 + n + k)
    w = nv.quantize(torch.randn(n, k, generator=gen), swizzle=layout == 2)
    plain = (nv.unswizzle_scales(w.scale, n, k // 16) if layout == 2 else w.scale).view(torch.uint8)
    tiles = 4 * -(-k // 256) if layout == 3 else -(-k // 64)
    rows_n = -(-n // 64)
    codes = torch.full((rows_n, tiles, 64, 4, 2), -1, dtype=torch.int32)
    scales = torch.full((rows_n, tiles, 64, 4), -1, dtype=torch.int32)
    xs = torch.full((rows_n, tiles, 64, 2, 8), -1, dtype=torch.int32)
    m = 11
    x = torch.randn(m, k + 32, generator=gen).to(torch.bfloat16)[:, 32:]  # a row stride past K
    scale_bits = w.scale.view(torch.uint8)
    _row_major_reads[(rows_n,)](w.data, scale_bits, x, codes, scales, xs, m, n, k, scale_bits.shape[1],
                                x.stride(0), tiles, layout)
    words = w.data.view(torch.int32)  # (N, K / 8): 8 codes a word, little-endian
    x_words = x.contiguous().view(torch.int32)  # (M, K / 2): 2 bf16 a word
    for pid_n in range(rows_n):
        for t in range(tiles):
            for i in range(64):
                g, q = (i % 32) // 4, i % 4
                block = 16 * (t // 4) + 4 * q + t % 4 if layout == 3 else 4 * t + q
                for j in range(4):
                    row = min(pid_n * 64 + 32 * (i // 32) + g + 8 * j, n - 1)
                    at = (pid_n, t, i, j)
                    if block * 16 < k:
                        assert torch.equal(codes[at], words[row, 2 * block:2 * block + 2]), at
                        assert scales[at] == int(plain[row, block]), at
                    else:  # past K: zeros
                        assert not codes[at].any() and scales[at] == 0, at
                for h in range(2):
                    at, x_row = (pid_n, t, i, h), min(g + 8 * h, m - 1)
                    if block * 16 < k:
                        assert torch.equal(xs[at], x_words[x_row, 8 * block:8 * block + 8]), at
                    else:
                        assert not xs[at].any(), at


def test_register_fed_mainloop_refuses_what_it_cannot_run(kernel_device):
    """Asked for where it cannot run, the launcher refuses: more than plan.MMA_MAX_M rows, weight
    rows or tiled codes off 8-byte boundaries, tiled scales off 4, tiled codes past int32 word
    offsets (and anything off a GPU: inline PTX). Each condition through the checks the plan takes."""
    cuda = torch.device("cuda")
    x = torch.zeros(33, 64, dtype=torch.bfloat16, device=kernel_device)
    data_t, scale_t = (t.to(kernel_device) for t in nv_tiled.tile(torch.zeros(64, 32, dtype=torch.uint8),
                                                                 torch.zeros(64, 4, dtype=torch.uint8)))
    g = torch.ones((), device=kernel_device)
    assert plan.mma_operands_aligned(x[:3], data_t, scale_t, True)
    with pytest.raises(ValueError, match="register-fed mainloop needs"):
        splitk(x, data_t, scale_t, g, None, torch.float32, False, tiled_n=64, mainloop="mma")
    assert not plan.mma_runs(33, tiled=True, device=cuda) and plan.mma_runs(32, tiled=True, device=cuda)
    rows = torch.zeros(64 * 32 + 4, dtype=torch.uint8)[4:].view(64, 32)  # rows 4 bytes off 8-byte boundaries
    assert not plan.mma_operands_aligned(x[:3], rows, torch.zeros(64, 4, dtype=torch.uint8), False)
    odd_scales = torch.zeros(scale_t.numel() + 2, dtype=torch.uint8)[2:]  # 2 bytes off a 4-byte boundary
    assert not plan.mma_operands_aligned(x[:3], data_t.cpu(), odd_scales, True)
    odd_x = torch.zeros(3 * 64 + 1, dtype=torch.bfloat16)[1:].view(3, 64)  # x rows 2 bytes off 4
    assert not plan.mma_operands_aligned(odd_x, data_t.cpu(), scale_t.cpu(), True)
    assert not plan.mma_runs(1, tiled=True, device=cuda, code_bytes=plan.MMA_MAX_CODE_BYTES)
    assert not plan.mma_runs(1, tiled=True, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not multiply an x of format 'bf16'"):
        splitk(x[:3], data_t, scale_t, g, None, torch.float32, False, tiled_n=64,
                                mainloop="dot_scaled")

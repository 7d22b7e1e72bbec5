"""The NVFP4 GEMM against the reference linear.

Without a GPU the sm_90 (dequant) mainloop runs under the Triton interpreter with fp16 operands
(the interpreter computes bf16 tl.dot wrongly); on a GPU the same tests use bf16, plus the
`gpu`-marked tests of nvfp4_inductor.linear on CUDA. The sm_100 path is compiled, not run
(tests/test_compile_targets.py)."""

import pytest
import torch
import triton
import triton.language as tl

import nvfp4_inductor as nv
from nvfp4_inductor import tiled as nv_tiled
from nvfp4_inductor import capability
from nvfp4_inductor.kernels import gemm, gemm_configs, gemm_mma, gemm_splitk, plan
from nvfp4_inductor.kernels._common import round_to
from pdl import late_copy

OPS = torch.ops.nvfp4


def _rel(got, want):
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


def _operand(device):
    return torch.bfloat16 if device == "cuda" else torch.float16


def test_launchers_take_strided_biases_and_empty_weights(kernel_device):
    """A bias view (stride 2, or an expanded stride 0) gives what its contiguous copy gives (the
    epilogues read (N,) with unit stride: other elements or past the storage); a weight of no rows
    gives an (M, 0) output (the split rule divided by the tile count)."""
    gen = torch.Generator().manual_seed(6)
    operand = _operand(kernel_device)
    x = torch.randn(5, 128, generator=gen).to(operand).to(kernel_device)
    w = nv.quantize(torch.randn(64, 128, generator=gen))
    parts = [t.to(kernel_device) for t in (w.data, w.scale.view(torch.uint8), w.global_scale)]
    wide = torch.randn(128, generator=gen).to(kernel_device)
    for bias in (wide[::2], wide[:1].expand(64)):
        want_split = gemm_splitk.gemm_splitk(x, *parts, bias.contiguous(), torch.float32, False)
        assert torch.equal(gemm_splitk.gemm_splitk(x, *parts, bias, torch.float32, False), want_split)
    empty = nv.quantize(torch.randn(0, 128))
    none = [t.to(kernel_device) for t in (empty.data, empty.scale.view(torch.uint8), empty.global_scale)]
    assert gemm_splitk.gemm_splitk(x, *none, None, torch.float32, False).shape == (5, 0)


def test_launchers_refuse_swizzled_scales_beyond_int32_offsets(kernel_device, monkeypatch):
    """The swizzled scale offsets are int32 (2^31 bytes: an x of 2^35 elements); beyond, the
    launchers refuse instead of writing out of bounds. Checked at a lowered limit."""
    from nvfp4_inductor.kernels import _common, quantize

    x = torch.randn(256, 64).to(kernel_device)
    w = nv.quantize(torch.randn(256, 64), swizzle=True)
    parts = [t.to(kernel_device) for t in (w.data, w.scale.view(torch.uint8), w.global_scale)]
    monkeypatch.setattr(_common, "SWIZZLED_MAX_BYTES", 256 * 4 - 1)
    with pytest.raises(ValueError, match="exceed the kernels' 32-bit offsets"):
        quantize.quantize(x, None, False, True)
    with pytest.raises(ValueError, match="exceed the kernels' 32-bit offsets"):
        gemm_splitk.gemm_splitk(x[:4].to(_operand(kernel_device)), *parts, None, torch.float32, True)
    monkeypatch.setattr(_common, "SWIZZLED_MAX_BYTES", 256 * 4)  # exactly fits
    data, scale, _ = quantize.quantize(x, None, False, True)
    assert scale.shape == (256, 4)


# --- GPU: nvfp4_inductor.linear on CUDA ----------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 24, 33, 257])
@pytest.mark.parametrize("n, k", [(48, 64), (80, 160), (96, 1344), (1024, 1056)])
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_linear_on_cuda_matches_reference(m, n, k, activation):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen, dtype=torch.bfloat16)
    bias = torch.randn(n, generator=gen, dtype=torch.bfloat16)
    for swizzled in (False, True):
        w = nv.quantize(torch.randn(n, k, generator=gen), swizzle=swizzled)
        want = nv.linear(x, w, bias, activation=activation)  # CPU: the reference
        w_cuda = nv.NVFP4(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in w))
        got = nv.linear(x.cuda(), w_cuda, bias.cuda(), activation=activation)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        assert _rel(got, want.float()) <= 1e-3


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


def pin_splitk_config(monkeypatch, config):
    """The split-K launcher with this (BLOCK_M, BLOCK_N, BLOCK_K, splits, warps, stages) config."""
    monkeypatch.setattr(gemm_configs, "splitk_config", lambda *args, **kwargs: config)


@pytest.mark.parametrize("m, n, k, swizzled, config", [
    (1, 16, 16, False, (16, 16, 64, 1, 4, 1)),       # K shorter than the tile
    (5, 48, 160, True, (16, 32, 64, 2, 4, 1)),       # odd M, N not a tile multiple, 2 splits
    (16, 130, 512, False, (16, 64, 128, 3, 4, 1)),   # uneven splits (4 tiles over 3)
    (3, 64, 256, True, (16, 64, 256, 1, 4, 1)),      # even: no masks, one split
    (9, 64, 2560, False, (16, 64, 64, 40, 4, 1)),    # more splits than the split sum loads at once
])
def test_splitk_mainloop_matches_reference(kernel_device, m, n, k, swizzled, config, monkeypatch):
    """The skinny kernel's index formulas and fp32 epilogue, at fresh random inputs with a wide
    range of x and per-row weight scales. On a GPU the word decode (inline PTX) runs; under the
    interpreter the byte decode builds the same operand."""
    gen = torch.Generator().manual_seed(m * 31 + n + k)
    operand = torch.bfloat16 if kernel_device == "cuda" else torch.float16
    x = (torch.randn(m, k, generator=gen) * 100).to(operand)
    w = nv.quantize(torch.randn(n, k, generator=gen) * torch.logspace(-2, 2, n)[:, None],
                    swizzle=swizzled, per_row=m % 2 == 1)
    bias = torch.randn(n, generator=gen)
    parts = [t.to(kernel_device) for t in (w.data, w.scale.view(torch.uint8), w.global_scale)]
    pin_splitk_config(monkeypatch, config)
    y = gemm_splitk.gemm_splitk(x.to(kernel_device), *parts, bias.to(kernel_device), torch.float32,
                                swizzled, mainloop="dot")
    assert _rel(y, x.double() @ w.dequantize(torch.float32).double().T + bias.double()) <= 1e-5
    # the last split of each tile left its counter at zero: the next call sums the same way
    counters = gemm_splitk.split_counters(y.device, -(-n // config[1]))
    assert not counters.any()
    again = gemm_splitk.gemm_splitk(x.to(kernel_device), *parts, bias.to(kernel_device), torch.float32,
                                    swizzled, mainloop="dot")
    assert torch.equal(again, y)


def test_captured_splitk_launches_get_counters_of_their_own(kernel_device, monkeypatch):
    """A split-K launch captured in a CUDA graph (capture stood in for here) keeps its tile counters
    for every replay, so it gets a zeroed slice no other launch uses: with the stream's shared
    buffer, graphs captured on one stream (torch.cuda.graph's default: all of them) replayed on two
    streams at once raced on it, and one allocated inside a capture was zeroed only when that graph
    replayed. With the reserve used up, a zeroed tensor of its own (a fill node in the graph)."""
    gen = torch.Generator().manual_seed(41)
    m, n, k, config = 3, 128, 512, (16, 64, 64, 4, 4, 1)  # 2 output tiles, 4 splits
    x = torch.randn(m, k, generator=gen).to(_operand(kernel_device)).to(kernel_device)
    w = nv.quantize(torch.randn(n, k, generator=gen))
    parts = [t.to(kernel_device) for t in (w.data, w.scale.view(torch.uint8), w.global_scale)]
    want = x.double().cpu() @ w.dequantize(torch.float32).double().T
    device = x.device
    eager = gemm_splitk.split_counters(device, 2)  # made outside any capture, with the reserve
    monkeypatch.setattr(gemm_splitk, "_capturing", lambda device: True)
    first, second = gemm_splitk.split_counters(device, 2), gemm_splitk.split_counters(device, 2)
    starts = {t.data_ptr() for t in (eager, first, second)}
    assert len(starts) == 3 and not first.any() and not second.any()
    assert all(t.data_ptr() % 16 == 0 for t in (first, second))  # else the JIT compiles anew in the capture
    pin_splitk_config(monkeypatch, config)
    assert _rel(gemm_splitk.gemm_splitk(x, *parts, None, torch.float32, False, mainloop="dot"), want) <= 1e-5
    reserve = gemm_splitk._reserve[device]
    assert not reserve[0][:reserve[1]].any()  # the captured launch left its counters zeroed
    monkeypatch.setitem(gemm_splitk._reserve, device, [reserve[0], reserve[0].numel()])
    spare = gemm_splitk.split_counters(device, 2)
    assert spare.untyped_storage().data_ptr() != reserve[0].untyped_storage().data_ptr() and not spare.any()


def test_outgrown_splitk_counters_stay_allocated(monkeypatch):
    """An eager stream's counter buffer replaced by a larger one is kept, not freed: it is made by
    another thread (gemm_splitk._zeros_outside_graph_pools), so the allocator would not order its
    reuse after the kernels still reading it on the caller's stream."""
    device = torch.device("cpu")
    monkeypatch.setattr(gemm_splitk, "_counters", {})
    monkeypatch.setattr(gemm_splitk, "_retired", [])
    small = gemm_splitk.split_counters(device, 8)
    large = gemm_splitk.split_counters(device, small.numel() + 1)
    assert large.numel() > small.numel() and gemm_splitk._retired == [small]
    assert gemm_splitk.split_counters(device, 8) is large


@pytest.mark.parametrize("reg_mma", [False, True])
def test_skinny_gemm_reads_any_scale_byte(kernel_device, reg_mma, monkeypatch):
    """Scale bytes this package never writes but a checkpoint's may hold, read as float8_e4m3fn
    (the reference's dequantize): 0xFF NaN, the sign bit a negative scale. The tl.dot mainloop's
    decode (and the interpreter's byte decode); on a GPU the register-fed one (hardware e4m3)."""
    if reg_mma and kernel_device != "cuda":
        pytest.skip("the register-fed mainloop is inline PTX")
    gen = torch.Generator().manual_seed(23)
    operand = torch.bfloat16 if kernel_device == "cuda" else torch.float16
    x = torch.randn(5, 128, generator=gen).to(operand)
    w = nv.quantize(torch.randn(64, 128, generator=gen))
    scale = w.scale.view(torch.uint8).clone()
    scale[0, 0], scale[1, 1], scale[2, 2], scale[3, 3], scale[4, 4] = 0xFF, 0x80, 0xB8, 0x81, 0xC0
    w_f32 = nv.NVFP4(w.data, scale.view(torch.float8_e4m3fn), w.global_scale, w.shape, False).dequantize(torch.float32)
    want = x.double() @ w_f32.double().T
    if not reg_mma:
        pin_splitk_config(monkeypatch, (16, 64, 64, 2, 4, 1))
    y = gemm_splitk.gemm_splitk(x.to(kernel_device), w.data.to(kernel_device), scale.to(kernel_device),
                                w.global_scale.to(kernel_device), None, torch.float32, False,
                                mainloop="mma" if reg_mma else "dot").cpu()
    assert y[:, 0].isnan().all() and not y[:, 1:].isnan().any()
    assert _rel(y[:, 1:], want[:, 1:]) <= 1e-5


@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (5, 80, 208), (16, 128, 512)])
def test_splitk_on_tiled_weights_matches_reference(kernel_device, m, n, k, monkeypatch):
    from nvfp4_inductor import tiled

    gen = torch.Generator().manual_seed(m + n * 3 + k)
    operand = torch.bfloat16 if kernel_device == "cuda" else torch.float16
    x = (torch.randn(m, k, generator=gen) * 10).to(operand)
    w = nv.quantize(torch.randn(n, k, generator=gen))
    data_t, scale_t = tiled.tile(w.data, w.scale.view(torch.uint8))
    block_m, block_n, block_k, _, warps, stages = gemm_configs.splitk_config(m, n, k, 4, tiled=True)
    # several splits: the in-kernel split sum runs
    pin_splitk_config(monkeypatch, (block_m, block_n, block_k, min(3, -(-k // block_k)), warps, stages))
    y = gemm_splitk.gemm_splitk(x.to(kernel_device), data_t.to(kernel_device), scale_t.to(kernel_device),
                                w.global_scale.to(kernel_device), None, torch.float32, False,
                                tiled_n=n, mainloop="dot")
    assert _rel(y, x.double() @ w.dequantize(torch.float32).double().T) <= 1e-5


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
        y = gemm_splitk.gemm_splitk(x.cuda(), data.cuda(), scale.cuda(), w.global_scale.cuda(), bias.cuda(),
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
    assert gemm_splitk._mma_operands_fit(x[:3], data_t, scale_t, True)
    with pytest.raises(ValueError, match="register-fed mainloop needs"):
        gemm_splitk.gemm_splitk(x, data_t, scale_t, g, None, torch.float32, False, tiled_n=64, mainloop="mma")
    assert not plan.mma_runs(33, tiled=True, device=cuda) and plan.mma_runs(32, tiled=True, device=cuda)
    rows = torch.zeros(64 * 32 + 4, dtype=torch.uint8)[4:].view(64, 32)  # rows 4 bytes off 8-byte boundaries
    assert not gemm_splitk._mma_operands_fit(x[:3], rows, torch.zeros(64, 4, dtype=torch.uint8), False)
    odd_scales = torch.zeros(scale_t.numel() + 2, dtype=torch.uint8)[2:]  # 2 bytes off a 4-byte boundary
    assert not gemm_splitk._mma_operands_fit(x[:3], data_t.cpu(), odd_scales, True)
    odd_x = torch.zeros(3 * 64 + 1, dtype=torch.bfloat16)[1:].view(3, 64)  # x rows 2 bytes off 4
    assert not gemm_splitk._mma_operands_fit(odd_x, data_t.cpu(), scale_t.cpu(), True)
    assert not plan.mma_runs(1, tiled=True, device=cuda, code_bytes=plan.MMA_MAX_CODE_BYTES)
    assert not plan.mma_runs(1, tiled=True, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="does not multiply an x of format 'bf16'"):
        gemm_splitk.gemm_splitk(x[:3], data_t, scale_t, g, None, torch.float32, False, tiled_n=64,
                                mainloop="dot_scaled")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 7, 16, 24, 33])
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_linear_tiled_on_cuda_matches_reference(m, activation):
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(2, m, 1040, generator=gen, dtype=torch.bfloat16)  # K padded to 1088 in tiles
    bias = torch.randn(1056, generator=gen, dtype=torch.bfloat16)
    w = nv.quantize(torch.randn(1056, 1040, generator=gen), per_row=m % 2 == 1)
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))
    want = nv.linear(x, w, bias, activation=activation)  # CPU: the reference
    got = OPS.linear_tiled(x.cuda(), data_t.cuda(), scale_t.cuda(), w.global_scale.cuda(), bias.cuda(),
                           1056, activation)
    assert got.dtype == torch.bfloat16 and got.shape == (2, m, 1056)
    assert _rel(got, want.float()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_linear_on_cuda_ignores_a_users_autocast(m, autocast_dtype):
    """The CUDA linears inside torch.autocast give what they give outside it: the dequantize +
    cuBLAS paths (M > 16) multiply through torch.mm, which autocast would run in fp16."""
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, 1024, generator=gen) * 8).to(torch.bfloat16).cuda()
    bias = torch.randn(320, generator=gen).cuda()
    w = nv.quantize(torch.randn(320, 1024, generator=gen).cuda())
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))
    calls = [lambda: nv.linear(x, w, bias), lambda: nv.linear(x.float(), w, bias),
             lambda: OPS.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 320, "bf16")]
    want = [call() for call in calls]
    with torch.autocast("cuda", dtype=autocast_dtype):
        got = [call() for call in calls]
    for g, w_ in zip(got, want):
        assert g.dtype == w_.dtype and torch.equal(g, w_)


@pytest.mark.gpu
def test_linear_tiled_on_cuda_takes_tiled_weights_off_word_boundaries():
    """Tiled codes or scales in views off the register-fed loads' boundaries (8 and 4 bytes) run
    the tl.dot mainloop instead: the same result."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 1024, generator=gen, dtype=torch.bfloat16).cuda()
    w = nv.quantize(torch.randn(192, 1024, generator=gen))
    data_t, scale_t = (t.cuda() for t in OPS.tile_weight(w.data, w.scale.view(torch.uint8)))
    want = nv.linear(x.cpu(), w).float()

    def shifted(t, by):
        out = torch.empty(t.numel() + by, dtype=t.dtype, device=t.device)[by:]
        return out.copy_(t)

    for data, scale in ((data_t, scale_t), (shifted(data_t, 4), scale_t), (data_t, shifted(scale_t, 2))):
        got = OPS.linear_tiled(x, data, scale, w.global_scale.cuda(), None, 192, "bf16")
        assert _rel(got.cpu(), want) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m, tiled, activation", [(1, True, "bf16"), (1, True, "nvfp4"), (16, True, "bf16"),
                                                  (33, True, "bf16"), (1, False, "bf16"), (20, False, "bf16")])
@pytest.mark.parametrize("late", ["x", "codes"])
def test_skinny_gemm_waits_for_a_pdl_producer(m, tiled, activation, late):
    """The skinny GEMM is launched with programmatic dependent launch (on sm_90+): it
    may start while the kernel before it runs, so it must wait before it reads x or the weights. The
    producer releases it at once and writes x (or the weight codes) ~0.5 ms later; a GEMM that read
    early would see zeros. Register-fed (M = 1 / 16 / 20) and tl.dot (M = 33, tiled) mainloops; W4A4
    quantizes x in a kernel of its own first (on PDL too)."""
    assert capability.sm90_or_later(torch.device("cuda"))
    gen = torch.Generator().manual_seed(m + tiled)
    x = torch.randn(m, 1024, generator=gen, dtype=torch.bfloat16).cuda()
    w = nv.quantize(torch.randn(4096, 1024, generator=gen).cuda())
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))
    if tiled:
        def linear(x, codes):
            return OPS.linear_tiled(x, codes, scale_t, w.global_scale, None, 4096, activation)
        codes = data_t
    else:
        def linear(x, codes):
            return nv.linear(x, w._replace(data=codes), activation=activation)
        codes = w.data
    want = linear(x, codes)  # also compiles the kernels outside the timed sequence
    operands = {"x": x, "codes": codes}
    target = torch.zeros_like(operands[late])
    operands[late] = target
    torch.cuda.synchronize()
    late_copy(x if late == "x" else codes, target)
    got = linear(operands["x"], operands["codes"])
    assert torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the gpu-marked tests run these paths")
@pytest.mark.parametrize("m", [1, 5, 20])
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_cuda_linear_launchers_under_the_interpreter(m, activation, monkeypatch):
    """The CUDA implementations of nvfp4::linear / linear_tiled (path choice, activation operand,
    global scales, tiled dequantize) run on CPU tensors through the interpreted kernels; the
    cuBLASLt GEMM is stood in for by an fp32 matmul. Tolerance: the interpreter truncates fp32 ->
    bf16 (up to 1 ulp) where the GPU rounds; the GPU tests hold these paths to 1e-3."""
    from nvfp4_inductor import tiled

    from nvfp4_inductor.kernels import cublaslt

    def scaled_mm(a, b, alpha, bias, out_dtype):  # cuBLASLt's numbers: fp32, rounded once
        y = (a.float() @ b.float().T) * alpha
        return (y if bias is None else y + bias.float()).to(out_dtype)

    monkeypatch.setattr(cublaslt, "scaled_mm", scaled_mm)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 96, generator=gen).to(torch.bfloat16)
    w = nv.quantize(torch.randn(48, 96, generator=gen), per_row=m == 5)
    bias = torch.randn(48, generator=gen).to(torch.bfloat16)
    want = nv.linear(x, w, bias, activation=activation).float()  # the reference
    parts = (w.data, w.scale.view(torch.uint8), w.global_scale)
    got = gemm.linear(x, *parts, bias, False, activation)  # the plan's kernel: split-K at these M
    assert _rel(got, want) <= 1e-2
    if w.global_scale.dim():  # per-row scales as a strided view: each row still gets its own
        strided = torch.stack([w.global_scale, torch.zeros_like(w.global_scale)], 1)[:, 0]
        assert not strided.is_contiguous()
        assert torch.equal(gemm.linear(x, *parts[:2], strided, bias, False, activation), got)
    # dequantize + cuBLASLt, the plan's kernel above the decode sizes, at this M
    monkeypatch.setattr(plan, "SPLITK_MAX_M", 0)
    assert _rel(gemm.linear(x, *parts, bias, False, activation), want) <= 1e-2
    monkeypatch.setattr(plan, "SPLITK_MAX_M", 32)
    data_t, scale_t = tiled.tile(parts[0], parts[1])
    assert _rel(gemm.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 48, activation), want) <= 1e-2
    if activation == "bf16":  # the backend's prefill extern (g read on the device)
        got = gemm.scaled_mm_tiled(x, data_t, scale_t, w.global_scale, bias, 48, torch.bfloat16)
        assert got.dtype == torch.bfloat16 and _rel(got, want) <= 1e-2


def test_splitk_takes_an_nvfp4_x_only_for_the_block_scaled_mma():
    from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

    x = nv.quantize(torch.randn(2, 64))
    w = nv.quantize(torch.randn(64, 64))
    with pytest.raises(ValueError, match="needs tiled weights on sm_100"):
        gemm_splitk(x.data, w.data, w.scale.view(torch.uint8), w.global_scale, None, torch.float32,
                    False, x_scale=x.scale.view(torch.uint8))


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


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, num_splits, M, N, ROWS: tl.constexpr, SPLITS: tl.constexpr):
    cols_n = tl.program_id(0) * 64 + tl.arange(0, 64)
    total = gemm_splitk.sum_splits(partial_ptr, num_splits, M, N, cols_n, 64, ROWS, SPLITS)
    ms = tl.arange(0, ROWS)
    tl.store(out_ptr + ms[None, :] * N + cols_n[:, None], total, mask=(cols_n < N)[:, None] & (ms < M)[None, :])


@pytest.mark.parametrize("m, n, splits", [(1, 64, 33), (1, 80, 5), (3, 96, 9), (16, 64, 7), (16, 70, 1)])
def test_sum_splits_in_split_order(kernel_device, m, n, splits):
    """The last split's sum (several rounds of the shipped loads at once, a partial last round, N
    and M tails) equals the partials summed in split order."""
    rows, at_once = gemm_configs.split_sum_tile(m, splits, 64, gemm_mma.WARPS)
    partial = torch.randn(splits, m, n, device=kernel_device)
    want = partial[0].clone()
    for s in range(1, splits):
        want += partial[s]
    for splits_a_round in sorted({at_once, 2, 4}):
        out = torch.full((m, n), float("nan"), device=kernel_device)
        _sum_splits_kernel[(triton.cdiv(n, 64),)](partial, out, splits, m, n, ROWS=rows, SPLITS=splits_a_round,
                                                  num_warps=gemm_mma.WARPS)
        assert torch.equal(out, want), (splits_a_round, (out - want).abs().max())


@triton.jit
def _silu_mul_halves_kernel(acc_ptr, g_ptr, out_ptr, OUT_DTYPE: tl.constexpr, ROWS: tl.constexpr):
    rows, ms, half = tl.arange(0, 128), tl.arange(0, ROWS), tl.arange(0, 64)
    acc = tl.load(acc_ptr + rows[:, None] * ROWS + ms[None, :])
    y = gemm_splitk.silu_mul_halves(acc, tl.load(g_ptr + rows), OUT_DTYPE, 128, ROWS)
    # the store's rounding (the interpreter's bf16 cast truncates): kept in fp32
    tl.store(out_ptr + half[:, None] * ROWS + ms[None, :], round_to(y, OUT_DTYPE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_mul_halves_rounds_as_eager(kernel_device, dtype):
    """The gated template's epilogue on interleaved gate / up rows: each linear rounded to the
    dtype, silu rounded to it, times up (reference.silu_mul), bit for bit on fresh random sums."""
    gen = torch.Generator().manual_seed(21)
    rows = 2
    acc = torch.randn(128, rows, generator=gen) * 40
    g = torch.rand(128, generator=gen) * 0.1 + 0.01
    out = torch.full((64, rows), float("nan"), device=kernel_device)
    _silu_mul_halves_kernel[(1,)](acc.to(kernel_device), g.to(kernel_device), out,
                                  OUT_DTYPE=tl.bfloat16 if dtype == torch.bfloat16 else tl.float16, ROWS=rows)
    gate, up = nv_tiled.split_halves((acc * g[:, None]).to(dtype).t())
    want = nv.reference.silu_mul(gate, up).t()
    assert torch.equal(out.cpu(), want.float()), int((out.cpu() != want.float()).sum())


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


class _LaunchRecorder:
    """Stands in for gemm_splitk._splitk_kernel: records a launch's grid and arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


@pytest.mark.parametrize("case, m, k, expect", [
    ("plain", 1, 1024, dict(REG_MMA=1, GROUPED=True, EVEN=True)),     # a scale word per 4 K-tiles
    ("plain", 5, 1040, dict(REG_MMA=1, GROUPED=False, EVEN=False)),   # K % 64 != 0: scale bytes
    ("plain", 12, 1024, dict(REG_MMA=2, GROUPED=False)),               # grouped only at M <= 8
    ("plain", 24, 1024, dict(REG_MMA=4, BLOCK_M=32)),                  # four x-row blocks
    ("swizzled", 1, 1024, dict(REG_MMA=1, GROUPED=False, SWIZZLED=True)),
    ("odd-scales", 1, 1024, dict(REG_MMA=1, GROUPED=False)),          # scales 1 byte off a word
    ("odd-rows", 1, 1024, dict(REG_MMA=0)),                            # code rows off 8 bytes: tl.dot
    ("tiled", 16, 1024, dict(REG_MMA=2, TILED=True)),
    ("tiled", 24, 1024, dict(REG_MMA=0, TILED=True, BLOCK_M=32)),      # tiled M > 16: tl.dot
])
def test_skinny_launcher_picks_the_mainloop(case, m, k, expect, monkeypatch):
    """Which mainloop and scale reads the skinny launcher picks by default, per layout and M
    (launch arguments recorded on the CPU, the plan asked as for a GPU; the GPU tests run each
    choice)."""
    recorder = _LaunchRecorder()
    monkeypatch.setattr(gemm_splitk, "_splitk_kernel", recorder)
    as_on_gpu = plan.splitk_mainloop
    monkeypatch.setattr(plan, "splitk_mainloop",
                        lambda m, **kwargs: as_on_gpu(m, **{**kwargs, "device": torch.device("cuda")}))
    n = 128
    w = nv.quantize(torch.randn(n, k), swizzle=case == "swizzled")
    data, scale, tiled_n = w.data, w.scale.view(torch.uint8), None
    if case == "tiled":
        (data, scale), tiled_n = nv_tiled.tile(data, scale), n
    elif case == "odd-scales":
        scale = torch.empty(scale.numel() + 1, dtype=torch.uint8)[1:].view(scale.shape).copy_(scale)
    elif case == "odd-rows":
        data = torch.empty(data.numel() + 4, dtype=torch.uint8)[4:].view(data.shape).copy_(data)
    x = torch.randn(m, k).to(torch.bfloat16)
    gemm_splitk.gemm_splitk(x, data, scale, w.global_scale, None, torch.bfloat16, case == "swizzled",
                            tiled_n=tiled_n)
    (grid, args, kwargs), = recorder.launches
    assert {key: kwargs[key] for key in expect} == expect
    tiles_per_split = args[13]
    if kwargs["GROUPED"]:  # splits cover whole groups of 4 K-tiles, counted as 4 * cdiv(K, 256)
        assert tiles_per_split % 4 == 0 and grid[1] == -(-(-(-k // 256) * 4) // tiles_per_split)
        assert tiles_per_split >= gemm_configs.REG_MMA_GROUPED_MIN_STEPS  # the grouped split rule
    else:
        assert grid[1] == -(-(-(-k // 64)) // tiles_per_split)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [5, 130])  # the skinny kernel; dequantize + cuBLASLt
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_linear_on_cuda_output_dtypes_and_3d(dtype, rows, activation):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(2, rows, 128, generator=gen).to(dtype)
    bias = torch.randn(64, generator=gen).to(dtype)
    w = nv.quantize(torch.randn(64, 128, generator=gen))
    want = nv.linear(x, w, bias, activation=activation)
    w_cuda = nv.NVFP4(*(t.cuda() if isinstance(t, torch.Tensor) else t for t in w))
    got = nv.linear(x.cuda(), w_cuda, bias.cuda(), activation=activation)
    assert got.dtype == dtype and got.shape == (2, rows, 64)
    assert _rel(got, want.float()) <= 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(17, 48, 64), (257, 1056, 1040), (33, 64, 8192)])  # (split K)
@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cublaslt_scaled_mm_rounds_once(m, n, k, per_row, bias_dtype, out_dtype):
    """alpha * (x @ w^T) + bias in fp32, rounded once: against the fp32 product on the same GPU
    (cuBLAS; the order of the sums may differ) with alpha and bias applied by torch. x is a row
    slice (leading stride > K): 32 bytes into its storage (used in place), or 2 bytes (copied to
    an aligned buffer: with the bias epilogue cuBLAS 13.0 failed on it)."""
    from nvfp4_inductor.kernels.cublaslt import scaled_mm

    gen = torch.Generator(device="cuda").manual_seed(m * n + k)
    start = 1 if m == 17 else 16
    x = torch.randn(m, k + 32, generator=gen, device="cuda", dtype=torch.bfloat16)[:, start:start + k]
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    alpha = torch.rand(n if per_row else (), generator=gen, device="cuda") + 0.5
    bias = None if bias_dtype is None else torch.randn(n, generator=gen, device="cuda").to(bias_dtype)
    got = scaled_mm(x, w, alpha, bias, out_dtype)
    want = torch.mm(x, w.T, out_dtype=torch.float32) * alpha
    if bias is not None:
        want = want + bias.float()
    assert got.dtype == out_dtype and got.shape == (m, n)
    # fp32: only the sums' order differs; bf16 / fp16: that, then at most one ulp where it
    # crosses a rounding boundary
    assert _rel(got, want) <= (1e-5 if out_dtype == torch.float32 else 2e-3)
    mismatched = (got.float() != want.to(out_dtype).float()).float().mean().item()
    assert out_dtype == torch.float32 or mismatched < 0.02


@pytest.mark.gpu
@pytest.mark.parametrize("m, n, k", [(65, 1004, 1040), (40, 1, 64), (33, 13, 128)])
def test_cublaslt_scaled_mm_odd_widths_stale_output_memory(m, n, k):
    """Output rows not on 16-byte boundaries (N not a multiple of 8, N = 1: nv.linear takes any N),
    with the bias epilogue, into memory that held NaN (beta is a device zero, so cuBLAS must not
    read the output it is given): alpha * (x @ w^T) + bias, rounded once."""
    from nvfp4_inductor.kernels.cublaslt import scaled_mm

    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    alpha = torch.rand((), generator=gen, device="cuda") + 0.5
    bias = torch.randn(n, generator=gen, device="cuda").to(torch.bfloat16)
    want = torch.mm(x, w.T, out_dtype=torch.float32) * alpha + bias.float()
    for out_dtype in (torch.bfloat16, torch.float32):
        stale = torch.full((m, n), float("nan"), device="cuda", dtype=out_dtype)
        del stale  # its block goes back to the caching allocator, for the output to take
        got = scaled_mm(x, w, alpha, bias, out_dtype)
        assert not got.isnan().any() and got.shape == (m, n) and got.is_contiguous()
        assert _rel(got, want) <= (1e-5 if out_dtype == torch.float32 else 2e-3)
        # rounded once: at most one ulp off where the sums' order crosses a rounding boundary
        mismatched = (got.float() != want.to(out_dtype).float()).float().mean().item()
        assert out_dtype == torch.float32 or mismatched < 0.02


@pytest.mark.gpu
def test_cublaslt_first_call_inside_a_cuda_graph_capture(monkeypatch):
    """No call before the capture: the handle and the plan are made while capturing."""
    from nvfp4_inductor.kernels import cublaslt

    monkeypatch.setattr(cublaslt, "_handles", {})
    monkeypatch.setattr(cublaslt, "_plans", type(cublaslt._plans)())
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(96, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(80, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    alpha = torch.rand((), generator=gen, device="cuda") + 0.5
    bias = torch.randn(80, generator=gen, device="cuda").to(torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cublaslt.scaled_mm(x, w, alpha, bias, torch.bfloat16)
    x.copy_(torch.randn(96, 256, generator=gen, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    torch.cuda.synchronize()
    want = torch.mm(x, w.T, out_dtype=torch.float32) * alpha + bias.float()
    assert _rel(out, want) <= 2e-3


@pytest.mark.gpu
def test_linear_of_one_output_feature_at_large_m():
    """N = 1 above the skinny kernels' M (dequantize + cuBLASLt; torch avoids cuBLASLt there)."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(1, 128, generator=gen).to(torch.bfloat16)
    x = torch.randn(300, 128, generator=gen).to(torch.bfloat16)
    bias = torch.randn(1, generator=gen).to(torch.bfloat16)
    want = nv.linear(x, nv.quantize(w), bias)  # the CPU reference
    got = nv.linear(x.cuda(), nv.quantize(w.cuda()), bias.cuda())
    assert _rel(got.cpu(), want) <= 1e-3


@pytest.mark.gpu
def test_cublaslt_scaled_mm_layouts_and_bad_arguments():
    from nvfp4_inductor.kernels.cublaslt import scaled_mm

    x = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(48, 64, device="cuda", dtype=torch.bfloat16)
    g = torch.ones((), device="cuda")
    want = scaled_mm(x, w, g, None, torch.float32)
    # column-major x, rows broadcast (stride 0), a column-major weight: copied, same result
    assert torch.equal(scaled_mm(x.T.contiguous().T, w.T.contiguous().T, g, None, torch.float32), want)
    row = x[:1].expand(32, 64)
    assert torch.equal(scaled_mm(row, w, g, None, torch.float32), want[:1].expand(32, 48))
    with pytest.raises(ValueError, match="bf16 on one CUDA device"):
        scaled_mm(x.half(), w, g, None, torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 on one CUDA device"):
        scaled_mm(x, w.cpu(), g, None, torch.bfloat16)
    with pytest.raises(ValueError, match="alpha must be fp32"):
        scaled_mm(x, w, g.cpu(), None, torch.bfloat16)
    with pytest.raises(ValueError, match="alpha must be fp32"):
        scaled_mm(x, w, torch.ones(32, device="cuda"), None, torch.bfloat16)
    with pytest.raises(ValueError, match="bias must be"):
        scaled_mm(x, w, g, torch.ones(32, device="cuda"), torch.bfloat16)


@pytest.mark.gpu
def test_splitk_linears_in_two_cuda_graphs_of_one_capture_stream():
    """Two graphs captured on torch.cuda.graph's default stream (two pools), the second replayed
    first: its split-K counters must be its own and zeroed. A buffer kept per capture stream was
    allocated in the first capture, from a pool holding the -7s of freed tensors, its zero fill a
    node of the first graph only, and the second graph read it before that ever ran. (Graphs
    sharing one pool must replay in capture order: PyTorch's rule, not tested here.)"""
    gen = torch.Generator(device="cuda").manual_seed(11)
    w = nv.quantize(torch.randn(4096, 4096, generator=gen, device="cuda"))
    xs = [torch.randn(1, 4096, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    want = [nv.linear(x, w).float() for x in xs]  # also compiles the kernels outside the captures
    pool = torch.cuda.graph_pool_handle()
    g0 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0, pool=pool):
        # 1 MB tensors: the allocator's small blocks (2 MB segments), where the counters come from
        junk = [torch.full((1 << 18,), -7, dtype=torch.int32, device="cuda") for _ in range(8)]
    g0.replay()
    torch.cuda.synchronize()
    del junk  # their blocks go back to the pool, -7s and all
    graphs, outs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()], []
    for graph, x, graph_pool in zip(graphs, xs, (pool, None)):
        with torch.cuda.graph(graph, pool=graph_pool):
            outs.append(nv.linear(x, w))
    graphs[1].replay()
    graphs[0].replay()
    torch.cuda.synchronize()
    for got, expected in zip(outs, want):
        assert _rel(got, expected) <= 1e-6


@pytest.mark.gpu
def test_converted_splitk_linear_under_cuda_graph_trees():
    """A converted model compiled with mode="reduce-overhead" (Inductor's own backend: nvfp4.linear
    stays the eager op) at M = 1, where the op splits K: the tree's warm-up runs the op in the
    tree's memory pool, which must hold nothing the call does not return (a counter buffer cached
    there raised "Detected 1 tensor(s) in the cudagraph pool not tracked as outputs")."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False)).to(device="cuda", dtype=torch.bfloat16).eval()
    nv.convert(model, nv.Config(activations="bf16", skip_output_head=False))
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            for _ in range(3):  # warm up, record, replay
                x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
                y = compiled(x).clone()
                torch.testing.assert_close(y, model(x))
    finally:
        torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["bf16", "nvfp4"])
def test_large_m_linear_in_cuda_graph_without_host_sync(activation):
    """The dequantize + cuBLASLt path reads the global scales on the device: capturable, no sync,
    and each replay uses the x (and for W4A4 its dynamic scale) of that replay."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(257, 1040, generator=gen, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(1056, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = nv.quantize(torch.randn(1056, 1040, generator=gen, device="cuda"), per_row=activation == "bf16")
    data_t, scale_t = OPS.tile_weight(w.data, w.scale.view(torch.uint8))

    def step():
        return (nv.linear(x, w, bias, activation=activation),
                OPS.linear_tiled(x, data_t, scale_t, w.global_scale, bias, 1056, activation))

    step()  # compile the kernels, plan the GEMM outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for scale in (1.0, 3.0):
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda") * scale)
        graph.replay()
        want = nv.linear(x.cpu(), nv.NVFP4(*(t.cpu() if isinstance(t, torch.Tensor) else t for t in w)),
                         bias.cpu(), activation=activation)  # the reference
        for got in outs:
            assert _rel(got, want.float()) <= 1e-3


@pytest.mark.gpu
def test_w4a4_sqnr_against_bf16_on_cuda():
    torch.manual_seed(4)
    x = torch.randn(64, 512, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(256, 512, dtype=torch.bfloat16, device="cuda")
    ref = (x.float() @ w.float().T).double()
    got = nv.linear(x, nv.quantize(w), activation="nvfp4").double()
    sqnr = 10 * torch.log10(ref.pow(2).sum() / (ref - got).pow(2).sum()).item()
    assert sqnr > 14.0  # 17.3 dB measured by the reference on the same data (tests/test_ops.py)


@triton.jit
def _tile_group_probe(w_ptr, w_scale_ptr, w_out_ptr, s_out_ptr, N, K,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, t = tl.program_id(0), tl.program_id(1)
    w, w_bits = gemm_splitk.load_tile_group(w_ptr, w_scale_ptr, N, K, pid_n, t, BLOCK_N, BLOCK_K)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    cols = t * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
    k_pad = tl.cdiv(K, BLOCK_K) * BLOCK_K
    tl.store(w_out_ptr + rows * (k_pad // 2) + cols, w)
    cols = t * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)[None, :]
    tl.store(s_out_ptr + rows * (k_pad // 16) + cols, w_bits)


@pytest.mark.parametrize("n, k", [(256, 256), (192, 320), (80, 48)])
def test_sm100_tile_groups_read_the_tiled_layout(kernel_device, n, k):
    """The sm_100 mainloop's weight reads (128 x 128 groups of 64 x 64 tiles; it only compiles for
    sm_100 here, tests/compile_kernels.py): the blocks it loads are the row-major weight, zeros
    past N and K (tile counts odd and even)."""
    torch.manual_seed(n + k)
    data = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scale = torch.randint(0, 127, (n, k // 16), dtype=torch.uint8)
    data_t, scale_t = (t.to(kernel_device) for t in nv_tiled.tile(data, scale))
    block_n = block_k = 128
    n_pad, k_pad = -(-n // block_n) * block_n, -(-k // block_k) * block_k
    w_out = torch.full((n_pad, k_pad // 2), 7, dtype=torch.uint8, device=kernel_device)
    s_out = torch.full((n_pad, k_pad // 16), 7, dtype=torch.uint8, device=kernel_device)
    _tile_group_probe[(n_pad // block_n, k_pad // block_k)](data_t, scale_t, w_out, s_out, n, k,
                                                            BLOCK_N=block_n, BLOCK_K=block_k)
    want_w = torch.zeros_like(w_out.cpu())
    want_w[:n, : k // 2] = data
    want_s = torch.zeros_like(s_out.cpu())
    want_s[:n, : k // 16] = scale
    assert torch.equal(w_out.cpu(), want_w) and torch.equal(s_out.cpu(), want_s)

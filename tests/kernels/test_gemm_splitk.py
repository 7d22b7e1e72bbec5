"""kernels/gemm_splitk.py: the split-K GEMM against the reference linear. The tl.dot mainloop's
numerics, the launcher (argument checks, strided biases, which mainloop and scale reads it picks),
its tile counters (eager streams, CUDA-graph captures), and the kernel's helpers (the split sum,
the gated epilogue, the sm_100 mainloop's tile reads).

Without a GPU the sm_90 (dequant) mainloop runs under the Triton interpreter with fp16 operands
(the interpreter computes bf16 tl.dot wrongly); on a GPU the same tests use bf16, plus the
`gpu`-marked ones. The sm_100 path is compiled, not run (test_compile_targets.py)."""

import pytest
import torch
import triton
import triton.language as tl

import nvfp4_inductor as nv
from helpers import streams as streams_helper
from helpers.gemm import pin_splitk_config, splitk
from nvfp4_inductor.reference import tiled as nv_tiled
from nvfp4_inductor.kernels import gemm, gemm_configs, gemm_splitk, plan
from nvfp4_inductor.kernels import launch as launches
from nvfp4_inductor.kernels.device import epilogue, mainloops
from nvfp4_inductor.kernels.device import mma as gemm_mma
from nvfp4_inductor.kernels.device.common import round_to


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
    from nvfp4_inductor.kernels import quantize
    from nvfp4_inductor.kernels.device import common as _common

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
    y = splitk(x.to(kernel_device), *parts, bias.to(kernel_device), torch.float32,
                                swizzled, mainloop="dot")
    assert _rel(y, x.double() @ w.dequantize(torch.float32).double().T + bias.double()) <= 1e-5
    # the last split of each tile left its counter at zero: the next call sums the same way
    counters = launches.split_counters(y.device, -(-n // config[1]))
    assert not counters.any()
    again = splitk(x.to(kernel_device), *parts, bias.to(kernel_device), torch.float32,
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
    eager = launches.split_counters(device, 2)  # made outside any capture, with the reserve
    monkeypatch.setattr(launches, "_capturing", lambda device: True)
    first, second = launches.split_counters(device, 2), launches.split_counters(device, 2)
    starts = {t.data_ptr() for t in (eager, first, second)}
    assert len(starts) == 3 and not first.any() and not second.any()
    assert all(t.data_ptr() % 16 == 0 for t in (first, second))  # else the JIT compiles anew in the capture
    pin_splitk_config(monkeypatch, config)
    assert _rel(splitk(x, *parts, None, torch.float32, False, mainloop="dot"), want) <= 1e-5
    reserve = launches._reserve[device]
    assert not reserve[0][:reserve[1]].any()  # the captured launch left its counters zeroed
    monkeypatch.setitem(launches._reserve, device, [reserve[0], reserve[0].numel()])
    spare = launches.split_counters(device, 2)
    assert spare.untyped_storage().data_ptr() != reserve[0].untyped_storage().data_ptr() and not spare.any()


def test_outgrown_splitk_counters_stay_allocated(monkeypatch):
    """An eager stream's counter buffer replaced by a larger one is kept, not freed: it is made by
    another thread (launch._zeros_outside_graph_pools), so the allocator would not order its
    reuse after the kernels still reading it on the caller's stream."""
    device = torch.device("cpu")
    monkeypatch.setattr(launches, "_counters", {})
    monkeypatch.setattr(launches, "_retired", [])
    small = launches.split_counters(device, 8)
    large = launches.split_counters(device, small.numel() + 1)
    assert large.numel() > small.numel() and launches._retired == [small]
    assert launches.split_counters(device, 8) is large


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
    y = splitk(x.to(kernel_device), w.data.to(kernel_device), scale.to(kernel_device),
                                w.global_scale.to(kernel_device), None, torch.float32, False,
                                mainloop="mma" if reg_mma else "dot").cpu()
    assert y[:, 0].isnan().all() and not y[:, 1:].isnan().any()
    assert _rel(y[:, 1:], want[:, 1:]) <= 1e-5


@pytest.mark.parametrize("m, n, k", [(1, 64, 64), (5, 80, 208), (16, 128, 512)])
def test_splitk_on_tiled_weights_matches_reference(kernel_device, m, n, k, monkeypatch):
    from nvfp4_inductor.reference import tiled

    gen = torch.Generator().manual_seed(m + n * 3 + k)
    operand = torch.bfloat16 if kernel_device == "cuda" else torch.float16
    x = (torch.randn(m, k, generator=gen) * 10).to(operand)
    w = nv.quantize(torch.randn(n, k, generator=gen))
    data_t, scale_t = tiled.tile(w.data, w.scale.view(torch.uint8))
    block_m, block_n, block_k, _, warps, stages = gemm_configs.splitk_config(m, n, k, 4)
    # several splits: the in-kernel split sum runs
    pin_splitk_config(monkeypatch, (block_m, block_n, block_k, min(3, -(-k // block_k)), warps, stages))
    y = splitk(x.to(kernel_device), data_t.to(kernel_device), scale_t.to(kernel_device),
                                w.global_scale.to(kernel_device), None, torch.float32, False,
                                tiled_n=n, mainloop="dot")
    assert _rel(y, x.double() @ w.dequantize(torch.float32).double().T) <= 1e-5



@pytest.mark.parametrize("m, n, k, splits", [
    (40, 64, 256, 2),    # one tile of N: K cut in two, the split sum runs
    (64, 130, 192, 2),   # N not a tile multiple; the last K-step holds one tile (masked)
    (100, 80, 320, 1),   # two blocks of rows, an uneven last step
    (128, 64, 128, 1),   # two full blocks, one even step
])
def test_wgmma_mainloop_matches_reference(kernel_device, m, n, k, splits):
    """The wgmma mainloop (two whole tiles a K-step, x's tile the first operand) on fresh random
    tiled weights, with a bias and per-row global scales, against the reference; the split
    (which the rule takes from the SMs: the interpreter has 8) and the blocks of rows as listed."""
    gen = torch.Generator().manual_seed(m + n + k)
    x = (torch.randn(m, k, generator=gen) * 10).to(_operand(kernel_device))
    w = nv.quantize(torch.randn(n, k, generator=gen))
    data_t, scale_t = nv_tiled.tile(w.data, w.scale.view(torch.uint8))
    g = torch.rand(n, generator=gen) + 0.5
    bias = torch.randn(n, generator=gen)
    x, data_t, scale_t = (t.to(kernel_device) for t in (x, data_t, scale_t))
    y = splitk(x, data_t, scale_t, g.to(kernel_device), bias.to(kernel_device), torch.float32,
                                False, tiled_n=n, mainloop="wgmma")
    setup = plan.splitk_launch_for(x, data_t, scale_t, swizzled=False, tiled_n=n, mainloop="wgmma")
    assert setup.grid == (-(-m // gemm_configs.WGMMA_CONFIG[0]), splits, -(-n // 64)), setup.grid
    want = x.double().cpu() @ (w.dequantize(torch.float32) / w.global_scale).double().T * g.double() + bias.double()
    assert _rel(y, want) <= (2e-3 if kernel_device == "cuda" else 1e-5)


def test_wgmma_mainloop_refuses_what_it_does_not_serve(kernel_device):
    """More rows than plan.WGMMA_MAX_M, row-major weights: refused with the reason."""
    w = nv.quantize(torch.randn(64, 128))
    data_t, scale_t = nv_tiled.tile(w.data, w.scale.view(torch.uint8))
    x = torch.randn(plan.WGMMA_MAX_M + 1, 128).to(_operand(kernel_device)).to(kernel_device)
    args = (data_t.to(kernel_device), scale_t.to(kernel_device), w.global_scale.to(kernel_device), None,
            torch.float32, False)
    with pytest.raises(ValueError, match=f"at most {plan.WGMMA_MAX_M} rows"):
        splitk(x, *args, tiled_n=64, mainloop="wgmma")
    row_major = (w.data.to(kernel_device), w.scale.view(torch.uint8).to(kernel_device),
                 w.global_scale.to(kernel_device), None, torch.float32, False)
    with pytest.raises(ValueError, match="reads tiled weights"):
        splitk(x[:40], *row_major, mainloop="wgmma")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 40])
def test_repeated_launches_take_the_cached_kernel(m):
    """After its first launch, a set-up's compiled kernel is launched directly (no JIT binding):
    fresh inputs every call, x at other alignments (another specialization: compiled, then cached
    too), a bias, per-row global scales; each result against the reference."""
    from nvfp4_inductor.reference import tiled

    gen = torch.Generator().manual_seed(m)
    n, k = 192, 320
    w = nv.quantize(torch.randn(n, k, generator=gen))
    data_t, scale_t = (t.cuda() for t in tiled.tile(w.data, w.scale.view(torch.uint8)))
    bias = torch.randn(n, generator=gen).cuda()
    for g in (w.global_scale.cuda(), torch.rand(n, generator=gen).cuda() + 0.5):
        for offset in (0, 0, 0, 2, 2):
            x = (torch.randn(m * k + offset, generator=gen) * 10).to(torch.bfloat16).cuda()[offset:].view(m, k)
            before = len(gemm_splitk._compiled)
            y = gemm_splitk.gemm_splitk(x, data_t, scale_t, g, bias, torch.float32, False, tiled_n=n)
            want = (x.double().cpu() @ (w.dequantize(torch.float32) / w.global_scale).double().T
                    * g.double().cpu() + bias.double().cpu())
            assert _rel(y, want) <= 1e-5, (offset, before)
    assert len(gemm_splitk._compiled) >= 2

def test_splitk_takes_an_nvfp4_x_only_for_the_block_scaled_mma():
    from nvfp4_inductor.kernels.gemm_splitk import gemm_splitk

    x = nv.quantize(torch.randn(2, 64))
    w = nv.quantize(torch.randn(64, 64))
    with pytest.raises(ValueError, match="needs tiled weights on sm_100"):
        gemm_splitk(x.data, w.data, w.scale.view(torch.uint8), w.global_scale, None, torch.float32,
                    False, x_scale=x.scale.view(torch.uint8))


@triton.jit
def _sum_splits_kernel(partial_ptr, out_ptr, num_splits, M, N, ROWS: tl.constexpr, SPLITS: tl.constexpr):
    cols_n = tl.program_id(0) * 64 + tl.arange(0, 64)
    total = epilogue.sum_splits(partial_ptr, num_splits, M, N, cols_n, 64, ROWS, SPLITS)
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
    y = epilogue.silu_mul_halves(acc, tl.load(g_ptr + rows), OUT_DTYPE, 128, ROWS)
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


def _tiled_linear(n, k, seed):
    """nvfp4.linear_tiled's weight arguments for a random (n, k) weight and bias, on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    data, scale, g = torch.ops.nvfp4.quantize(w, None, False, False)
    data, scale = torch.ops.nvfp4.tile_weight(data, scale)
    return data, scale, g, torch.randn(n, generator=gen, device="cuda", dtype=torch.bfloat16), n


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("bound", [False, True])
def test_eager_splitk_launches_on_two_streams_at_once(threads, bound):
    """gemm.linear_tiled at decode size (split K), two weights, on two streams at once (from one
    thread or two), many times; or its bound launches (gemm.bind_linear_tiled): every output bit
    for bit the serial run's. Each stream counts its tiles in counters of its own."""
    weights = [_tiled_linear(4096, 4096, 0), _tiled_linear(2048, 8192, 1)]
    xs = [torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for k in (4096, 8192)]
    for x, w in zip(xs, weights):
        chosen = plan.plan_gemm(1, w[-1], x.shape[1], tiled=True, activation="bf16", device=x.device)
        assert chosen.kernel == "splitk"
    jobs = [lambda x=x, w=w: gemm.linear_tiled(x, *w, "bf16") for x, w in zip(xs, weights)]
    want = [job().clone() for job in jobs]  # (also compiles the kernels for their direct launches)
    if bound:
        jobs = [gemm.bind_linear_tiled(x, *w, "bf16") for x, w in zip(xs, weights)]
        if None in jobs:
            pytest.skip("no direct launch of the split-K kernel here")
        assert all(torch.equal(job(x), y) for job, x, y in zip(jobs, xs, want))
        jobs = [lambda job=job, x=x: job(x) for job, x in zip(jobs, xs)]
    streams = [torch.cuda.Stream() for _ in jobs]
    run = streams_helper.on_threads if threads else streams_helper.on_streams
    outs = run(jobs, streams, 200)
    for got, expected in zip(outs, want):
        assert all(torch.equal(y, expected) for y in got)
    device = xs[0].device
    assert all((device, stream.cuda_stream) in launches._counters for stream in streams)  # K was split


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


@triton.jit
def _tile_group_probe(w_ptr, w_scale_ptr, w_out_ptr, s_out_ptr, N, K,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n, t = tl.program_id(0), tl.program_id(1)
    w, w_bits = mainloops.load_tile_group(w_ptr, w_scale_ptr, N, K, pid_n, t, BLOCK_N, BLOCK_K)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
    cols = t * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)[None, :]
    k_pad = tl.cdiv(K, BLOCK_K) * BLOCK_K
    tl.store(w_out_ptr + rows * (k_pad // 2) + cols, w)
    cols = t * (BLOCK_K // 16) + tl.arange(0, BLOCK_K // 16)[None, :]
    tl.store(s_out_ptr + rows * (k_pad // 16) + cols, w_bits)


@pytest.mark.parametrize("n, k", [(256, 256), (192, 320), (80, 48)])
def test_sm100_tile_groups_read_the_tiled_layout(kernel_device, n, k):
    """The sm_100 mainloop's weight reads (128 x 128 groups of 64 x 64 tiles; it only compiles for
    sm_100 here, test_compile_targets.py): the blocks it loads are the row-major weight, zeros past
    N and K (tile counts odd and even)."""
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

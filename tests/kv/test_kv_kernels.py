"""The NVFP4 KV cache's layout, write and decode attention (reference/kv_cache.py,
kernels/kv_cache.py, ops/kv.py): the write bit for bit against the reference quantizer with
per-row global scales, the decode kernel against the pure-torch attention on fresh random
inputs (grouped-query heads, odd lengths, left padding, several splits), and the attention's
accuracy on keys with per-channel outliers.

On a machine without a GPU the kernels run under the Triton interpreter; on a GPU the same tests
run on CUDA, plus the `gpu`-marked ones.
"""

import math

import pytest
import torch

from helpers.inputs import sample
from nvfp4_inductor.kernels import kv_cache as kernels
from nvfp4_inductor.ops.kv import kv_planes
from nvfp4_inductor.reference import kv_cache as ref
from nvfp4_inductor.reference import quantize

OPS = torch.ops.nvfp4


def _caches(batch, heads, slots, dim, device="cpu"):
    shape = ref.cache_shape(batch, heads, slots, dim)
    return torch.zeros(shape, dtype=torch.uint8, device=device), torch.zeros(shape, dtype=torch.uint8, device=device)


def _special_rows(x):
    """Rows the quantizer treats apart: all zero, a NaN, an Inf, tiny (g below 2^-100), one huge."""
    x = x.clone()
    x[0, 0, 0] = 0.0
    x[0, -1, -1, 5] = math.nan
    x[-1, 0, -1, 3] = math.inf
    if x.shape[2] > 1:
        x[-1, -1, 1] = x[-1, -1, 1] * 1e-33 if x.dtype == torch.float32 else x[-1, -1, 1]
        x[0, 0, 1, 0] = 3.0e4 if x.dtype != torch.float16 else 6.0e4
    return x


def test_layout_planes_tile_the_cache_bytes():
    """cache_shape rounds slots up to SLOT_MULTIPLE; the three planes are disjoint, cover every byte
    of the cache in order, and each starts 16-byte aligned."""
    for batch, heads, slots, dim in ((1, 1, 1, 16), (3, 5, 37, 80), (2, 8, 64, 128)):
        shape = ref.cache_shape(batch, heads, slots, dim)
        assert shape[2] % ref.SLOT_MULTIPLE == 0 and slots <= shape[2] < slots + ref.SLOT_MULTIPLE
        assert ref.row_bytes(dim) == shape[3] and ref.head_dim_of(torch.empty(shape, dtype=torch.uint8)) == dim
        cache = torch.empty(shape, dtype=torch.uint8)
        data, scale, g = ref.planes(cache)
        rows = batch * heads * shape[2]
        assert data.shape == (batch, heads, shape[2], dim // 2) and scale.shape == (batch, heads, shape[2], dim // 16)
        assert g.shape == (batch, heads, shape[2]) and g.dtype == torch.float32
        base = cache.data_ptr()
        offsets = [p.data_ptr() - base for p in (data, scale, g)]
        assert offsets == [0, rows * dim // 2, rows * (dim // 2 + dim // 16)]
        assert all(o % 16 == 0 for o in offsets)
        assert offsets[2] + 4 * rows == cache.numel()
        assert all(p.is_contiguous() for p in (data, scale, g))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [16, 80, 128])
def test_write_is_the_reference_quantizer_per_row(kernel_device, dtype, dim):
    """kv_write (the kernel on CUDA or the interpreter, the op's reference on the CPU) stores, in
    each written slot, exactly reference.quantize(x, per_row=True) of that row: codes, e4m3 scales
    and fp32 global scale; other slots and sequences stay untouched. Values are strided like
    transformers' (a transposed view), batch 2 of 3 allocated, scattered positions."""
    gen = torch.Generator().manual_seed(dim + 7 * dtype.itemsize)
    batch, heads, seq, slots = 2, 3, 5, 37
    key = _special_rows(sample("heavy_tailed", (batch, heads, seq, dim), gen).to(dtype))
    value = sample("normal", (batch, seq, heads, dim), gen).to(dtype).transpose(1, 2)  # strided
    positions = torch.tensor([36, 0, 17, 5, 16])
    fill = torch.randint(0, 256, ref.cache_shape(3, heads, slots, dim), dtype=torch.uint8, generator=gen)
    kv_planes(fill)[2].copy_(torch.randn(kv_planes(fill)[2].shape, generator=gen))  # finite old scales
    for impl in ("op", "kernel"):
        k_cache, v_cache = fill.clone().to(kernel_device), fill.clone().to(kernel_device)
        args = (key.to(kernel_device), value.to(kernel_device))
        if impl == "op":
            OPS.kv_write(*args, k_cache, v_cache, positions.to(kernel_device))
        else:
            kernels.write(*args, kv_planes(k_cache), kv_planes(v_cache), positions.to(kernel_device))
        for x, cache in ((key, k_cache), (value, v_cache)):
            data, scale, g = (p.cpu() for p in kv_planes(cache))
            want_data, want_scale, want_g = quantize(x, None, per_row=True)
            assert torch.equal(data[:batch, :, positions], want_data), impl
            assert torch.equal(scale[:batch, :, positions], want_scale.view(torch.uint8)), impl
            assert torch.equal(g[:batch, :, positions], want_g), impl
            untouched = torch.ones(fill.shape[2], dtype=torch.bool)
            untouched[positions] = False
            for got_plane, fill_plane in zip((data, scale, g), kv_planes(fill)):
                assert torch.equal(got_plane[:, :, untouched], fill_plane[:, :, untouched]), impl
                assert torch.equal(got_plane[batch:], fill_plane[batch:]), impl


def test_write_kernel_drops_slots_outside_the_cache(kernel_device):
    """Positions -1 and T (where a device-side position ran past the cache) write nothing; the op
    refuses them on the CPU, where they can be read without a host sync."""
    gen = torch.Generator().manual_seed(3)
    key = torch.randn(1, 2, 3, 32, generator=gen).to(torch.bfloat16)
    k_cache, v_cache = _caches(1, 2, 16, 32, kernel_device)
    positions = torch.tensor([-1, 4, 16])
    kernels.write(key.to(kernel_device), key.to(kernel_device), kv_planes(k_cache), kv_planes(v_cache),
                  positions.to(kernel_device))
    data, scale, g = (p.cpu() for p in kv_planes(k_cache))
    assert g[0, :, 4].ne(0).all() and torch.count_nonzero(g) == 2  # slot 4 of both heads only
    assert torch.count_nonzero(data[:, :, [i for i in range(16) if i != 4]]) == 0
    k_cpu, v_cpu = _caches(1, 2, 16, 32)
    with pytest.raises(ValueError, match="too short"):
        OPS.kv_write(key, key, k_cpu, v_cpu, positions)


def _filled(batch, heads, slots, dim, gen, kind="normal"):
    k_cache, v_cache = _caches(batch, heads, slots, dim)
    keys = sample(kind, (batch, heads, slots, dim), gen).to(torch.bfloat16)
    values = sample("normal", (batch, heads, slots, dim), gen).to(torch.bfloat16)
    OPS.kv_write(keys, values, k_cache, v_cache, torch.arange(slots))
    return k_cache, v_cache


def _decode_mask(batch, slots, lengths, pads):
    """(B, 1, 1, T) bool: sequence b attends slots pads[b] .. lengths[b] - 1 (left padding)."""
    n = torch.arange(slots)
    return torch.stack([(n >= p) & (n < length) for length, p in zip(lengths, pads)])[:, None, None, :]


@pytest.mark.parametrize("q_heads,kv_heads,dim", [(4, 4, 64), (8, 2, 64), (12, 2, 80), (32, 8, 128)])
def test_decode_kernel_matches_reference_attention(kernel_device, q_heads, kv_heads, dim):
    """The split-KV kernel (one query position) against reference.kv_cache.attention: grouped heads
    (groups 1, 4, 6 padded to 16 rows, 4), lengths that end inside a tile, left padding, one and
    several splits, a sequence that attends nothing (zeros), and mask None (slot 0). fp32 queries
    are compared tightly; bf16 queries within a bf16 rounding of the output."""
    gen = torch.Generator().manual_seed(q_heads * 1000 + dim)
    batch, slots = 4, 150
    k_cache, v_cache = _filled(batch, kv_heads, slots, dim, gen)
    total = k_cache.shape[2]
    mask = _decode_mask(batch, total, lengths=[150, 37, 97, 0], pads=[0, 3, 64, 0])
    for q_dtype in (torch.float32, torch.bfloat16):
        query = torch.randn(batch, q_heads, 1, dim, generator=gen).to(q_dtype)
        want = ref.attention(query, k_cache, v_cache, mask, dim**-0.5)
        assert want[3].abs().max() == 0  # nothing attended
        for splits in (1, 3):
            got = kernels.decode_attention(query.to(kernel_device), kv_planes(k_cache.to(kernel_device)),
                                           kv_planes(v_cache.to(kernel_device)),
                                           mask.to(kernel_device)[:, 0, 0, :], dim**-0.5, splits).cpu()
            assert got.dtype == q_dtype and got.shape == want.shape
            if q_dtype == torch.float32 and kernel_device == "cpu":
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            else:  # bf16 operands on the GPU, a bf16 output
                torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)
    query = torch.randn(2, q_heads, 1, dim, generator=gen)
    got = kernels.decode_attention(query.to(kernel_device), kv_planes(k_cache.to(kernel_device), 2),
                                   kv_planes(v_cache.to(kernel_device), 2), None, 0.5).cpu()
    torch.testing.assert_close(got.float(), ref.attention(query, k_cache, v_cache, None, 0.5).float(),
                               rtol=2**-6, atol=2**-6)


def _outlier_keys(shape, gen):
    """Keys as real models' look after RoPE: most channels N(0, 1), a few channels (4 of D: 2
    rotary pairs) carrying a large per-channel magnitude (x 20) and offset (+ 8), the same for
    every token (massive-activation channels of K), plus token noise. Per-token global scales
    then see the outliers in every row; the block scales keep the other channels' blocks fine."""
    batch, heads, slots, dim = shape
    k = torch.randn(shape, generator=gen)
    channels = torch.randperm(dim // 2, generator=gen)[:2]
    outliers = torch.cat([channels, channels + dim // 2])  # rotate-half pairs (d, d + D/2)
    k[..., outliers] = k[..., outliers] * 20 + 8
    return k.to(torch.bfloat16)


def _sqnr_db(got, want):
    return 10 * math.log10(want.float().pow(2).sum() / (got.float() - want.float()).pow(2).sum())


def test_decode_attention_sqnr_on_outlier_keys(kernel_device):
    """Decode attention over the NVFP4 cache (the kernel) against attention over the bf16 keys and
    values: its SQNR is within 1 dB of that of the NVFP4 round trip itself (reference attention
    on dequantize(quantize(K, V))), and that is above 15 dB on keys with per-channel outliers."""
    gen = torch.Generator().manual_seed(11)
    batch, q_heads, kv_heads, slots, dim = 2, 8, 2, 256, 128
    keys = _outlier_keys((batch, kv_heads, slots, dim), gen)
    values = torch.randn(batch, kv_heads, slots, dim, generator=gen).to(torch.bfloat16)
    query = (torch.randn(batch, q_heads, 1, dim, generator=gen) * 0.3).to(torch.bfloat16)
    k_cache, v_cache = _caches(batch, kv_heads, slots, dim)
    OPS.kv_write(keys, values, k_cache, v_cache, torch.arange(slots))
    mask = _decode_mask(batch, slots, lengths=[slots, 201], pads=[0, 0])

    def exact(q, k, v):  # fp32 attention over given keys and values
        k, v = k.float().repeat_interleave(4, 1), v.float().repeat_interleave(4, 1)
        s = (q.float() @ k.transpose(-1, -2)) * dim**-0.5
        return torch.softmax(s.masked_fill(~mask, -math.inf), -1) @ v

    want = exact(query, keys, values)
    round_trip = exact(query, ref.dequantize(k_cache), ref.dequantize(v_cache))
    got = kernels.decode_attention(query.to(kernel_device), kv_planes(k_cache.to(kernel_device)),
                                   kv_planes(v_cache.to(kernel_device)), mask.to(kernel_device)[:, 0, 0, :],
                                   dim**-0.5).cpu()
    own = _sqnr_db(round_trip, want)
    assert own > 15, own
    assert _sqnr_db(got, want) >= own - 1.0, (_sqnr_db(got, want), own)


def test_attention_op_checks_its_arguments():
    k_cache, v_cache = _caches(2, 2, 16, 32)
    query = torch.randn(2, 4, 1, 32)
    with pytest.raises(ValueError, match="allocated for 2"):
        OPS.kv_attention(torch.randn(3, 4, 1, 32), k_cache, v_cache, None, 1.0)
    with pytest.raises(ValueError, match="head_dim 64"):
        OPS.kv_attention(torch.randn(2, 4, 1, 64), k_cache, v_cache, None, 1.0)
    with pytest.raises(ValueError, match="multiple of 2"):
        OPS.kv_attention(torch.randn(2, 3, 1, 32), k_cache, v_cache, None, 1.0)
    with pytest.raises(TypeError, match="dtype"):
        OPS.kv_attention(query.to(torch.int32), k_cache, v_cache, None, 1.0)
    with pytest.raises(ValueError, match="mask"):
        OPS.kv_attention(query, k_cache, v_cache, torch.ones(2, 1, 1, 15, dtype=torch.bool), 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        OPS.kv_attention(query, k_cache[:, :, :15].contiguous(), v_cache[:, :, :15].contiguous(), None, 1.0)
    with pytest.raises(ValueError, match="no NVFP4 cache rows"):
        OPS.kv_attention(query, k_cache[..., :20].contiguous(), v_cache[..., :20].contiguous(), None, 1.0)


@pytest.mark.gpu
def test_gpu_kernels_match_the_reference():
    """On CUDA: the write kernel bit-exact with the reference quantizer (bf16, strided values),
    decode attention (the split-KV kernel) and prefill attention (dequantize + SDPA) against the
    reference over the same caches."""
    gen = torch.Generator().manual_seed(5)
    batch, q_heads, kv_heads, slots, dim = 3, 32, 8, 1000, 128
    keys = _outlier_keys((batch, kv_heads, slots, dim), gen)
    values = torch.randn(batch, slots, kv_heads, dim, generator=gen).to(torch.bfloat16).transpose(1, 2)
    positions = torch.randperm(slots, generator=gen)
    k_cpu, v_cpu = _caches(batch, kv_heads, slots, dim)
    OPS.kv_write(keys, values, k_cpu, v_cpu, positions)
    k_gpu, v_gpu = _caches(batch, kv_heads, slots, dim, "cuda")
    OPS.kv_write(keys.cuda(), values.cuda(), k_gpu, v_gpu, positions.cuda())
    assert torch.equal(k_gpu.cpu(), k_cpu) and torch.equal(v_gpu.cpu(), v_cpu)
    total = k_cpu.shape[2]
    mask = _decode_mask(batch, total, lengths=[1000, 517, 999], pads=[0, 5, 300])
    query = torch.randn(batch, q_heads, 1, dim, generator=gen).to(torch.bfloat16)
    want = ref.attention(query, k_cpu, v_cpu, mask, dim**-0.5)
    got = OPS.kv_attention(query.cuda(), k_gpu, v_gpu, mask.cuda(), dim**-0.5).cpu()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)
    prefill = torch.randn(batch, q_heads, 9, dim, generator=gen).to(torch.bfloat16)
    causal = torch.ones(9, total, dtype=torch.bool).tril(diagonal=total - 9)[None, None].expand(batch, 1, 9, total)
    want = ref.attention(prefill, k_cpu, v_cpu, causal, dim**-0.5)
    got = OPS.kv_attention(prefill.cuda(), k_gpu, v_gpu, causal.cuda(), dim**-0.5).cpu()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6)

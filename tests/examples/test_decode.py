"""examples/decode.py: the Llama-style model and its decode loop, eager, through backend="nvfp4"
on the CPU, and (marked gpu) captured in CUDA graphs under mode="reduce-overhead"."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import nvfp4_inductor as nv

import decode  # examples/decode.py
import decode_attention  # examples/decode_attention.py

CFG = decode.PRESETS["tiny"]
LINEARS = 7 * CFG.layers  # wq, wk, wv, wo, w1, w2, w3 per layer; lm_head stays bf16
MAX_LEN = 32
# Compiled vs eager NVFP4 logits (|logits| ~ 0.5): max difference 3.4e-3 on the CPU
# (Inductor fuses the norms and rotary embeddings in another order).
TOL = {"rtol": 2e-2, "atol": 2e-2}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _tokens(batch, length, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab, (batch, length), generator=generator)


def _eager_nvfp4(model, activations):
    """A copy of model with its linears converted eagerly (NVFP4Linear): the same quantized
    weights as the backend makes (dynamic per-tensor global scale), and its own KV cache."""
    reference = copy.deepcopy(model)
    report = nv.convert(reference, nv.Config(activations=activations))
    assert len(report.converted) == LINEARS and list(report.skipped) == ["lm_head"]
    return reference


def _run_steps(step, tokens, device, clone=True):
    """Feeds tokens (B, n) one position at a time from position 0 -> list of logits (B, vocab)."""
    pos = torch.zeros(1, dtype=torch.long, device=device)
    out = []
    for i in range(tokens.shape[1]):
        torch.compiler.cudagraph_mark_step_begin()
        logits = step(tokens[:, i:i + 1].to(device), pos)
        out.append(logits.clone() if clone else logits)  # a replay overwrites CUDA-graph outputs
        pos = pos + 1
    return out


# --- the model, eagerly --------------------------------------------------------------------------

def test_attention_matches_sdpa_with_repeated_kv_heads():
    torch.manual_seed(0)
    model = decode.build_model(CFG, MAX_LEN, 2, "cpu").float()
    model.setup_cache(2)
    attn, seq = model.layers[0].attn, 7
    x = torch.randn(2, seq, CFG.hidden)
    pos = torch.arange(seq)
    mask = model.key_pos <= pos[:, None]
    cos, sin = model.rope_cos[pos], model.rope_sin[pos]
    with torch.no_grad():
        out = attn(x, pos, cos, sin, mask)
        q = attn.wq(x).view(2, seq, CFG.heads, CFG.head_dim).transpose(1, 2)
        k = attn.wk(x).view(2, seq, CFG.kv_heads, CFG.head_dim).transpose(1, 2)
        v = attn.wv(x).view(2, seq, CFG.kv_heads, CFG.head_dim).transpose(1, 2)
        q, k = decode.apply_rope(q, cos, sin), decode.apply_rope(k, cos, sin)
        rep = CFG.heads // CFG.kv_heads  # query head h reads KV head h // rep
        ref = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                             is_causal=True)
        ref = attn.wo(ref.transpose(1, 2).reshape(2, seq, -1))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(attn.k_cache[:, :, :seq], k)  # the cache holds the rotated keys
    assert attn.k_cache[:, :, seq:].eq(0).all()


def test_cache_takes_the_model_dtype_with_a_converted_head():
    """With skip_output_head=False the head holds NVFP4 codes (uint8): the cache took its dtype
    from lm_head.weight, and decode_attention refused the uint8 cache."""
    model = decode.build_model(CFG, MAX_LEN, 2, "cpu")
    report = nv.convert(model, nv.Config(activations="bf16", skip_output_head=False))
    assert "lm_head" in report.converted
    with torch.no_grad():
        model.setup_cache(2)
        assert model.layers[0].attn.k_cache.dtype == model.embed.weight.dtype == torch.bfloat16
        prefill = model(_tokens(2, 3), torch.arange(3))
        step = model(_tokens(2, 1, seed=2), torch.tensor([3]))
    assert prefill.shape == step.shape == (2, CFG.vocab) and bool(step.isfinite().all())


def test_decode_steps_match_a_longer_prefill():
    # The KV cache, positions and mask: prefill of 5 tokens + 4 decode steps gives the logits of
    # a 6..9-token prefill. fp32, so only summation order differs.
    model = decode.build_model(CFG, MAX_LEN, 2, "cpu").float()
    tokens = _tokens(2, 9)
    with torch.no_grad():
        model.setup_cache(2)
        model(tokens[:, :5], torch.arange(5))
        for t in range(5, 9):
            stepped = model(tokens[:, t:t + 1], torch.tensor([t]))
            model.setup_cache(2)
            full = model(tokens[:, :t + 1], torch.arange(t + 1))
            torch.testing.assert_close(stepped, full, rtol=1e-4, atol=1e-5)
            model.setup_cache(2)
            model(tokens[:, :t + 1], torch.arange(t + 1))  # the cache as the stepping left it


def test_greedy_teacher_forcing():
    model = decode.build_model(CFG, MAX_LEN, 2, "cpu")
    loop = decode.GreedyStep(model, 2)

    def prefill(tokens, pos):
        with torch.no_grad():
            return model(tokens, pos)

    def step():
        with torch.no_grad():
            loop()

    prompt = _tokens(2, 4)
    free = decode.greedy(prefill, step, loop, prompt, 6)
    assert free.shape == (2, 6) and int(loop.pos) == 9
    assert torch.equal(decode.greedy(prefill, step, loop, prompt, 6, forced=free), free)  # its own choices
    other = torch.randint(0, CFG.vocab, (2, 6))
    forced = decode.greedy(prefill, step, loop, prompt, 6, forced=other)
    assert torch.equal(forced[:, 0], free[:, 0])  # the prefill's choice does not depend on it
    with torch.no_grad():
        model.setup_cache(2)
        model(prompt, torch.arange(4))
        expected = [model(other[:, :1], torch.tensor([4])).argmax(-1)]
        expected.append(model(other[:, 1:2], torch.tensor([5])).argmax(-1))
    assert torch.equal(forced[:, 1], expected[0]) and torch.equal(forced[:, 2], expected[1])


def test_greedy_step_is_the_model_and_argmax():
    # GreedyStep: the model at the buffers' token and position, the argmax written back, the
    # position advanced; free-running from the model's own first choice.
    model = decode.build_model(CFG, MAX_LEN, 2, "cpu")
    loop = decode.GreedyStep(model, 2)
    token, pos = _tokens(2, 1), torch.tensor([0])
    loop.token.copy_(token)
    with torch.no_grad():
        for _ in range(5):
            loop()
        model.setup_cache(2)
        for _ in range(5):
            token = model(token, pos).argmax(-1, keepdim=True)
            pos = pos + 1
    assert torch.equal(loop.token, token) and int(loop.pos) == 5


# --- the decode step's attention op (examples/decode_attention.py) --------------------------------

def _attention_inputs(seed, batch, heads, kv_heads, length, dim, device, dtype=torch.bfloat16):
    """Fresh random op inputs: q (B, H, D), k, v (B, KVH, D), cos, sin of random angles (1, D / 2)
    fp32, caches (B, KVH, L, D)."""
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(shape, generator=generator).to(device, dtype)

    angles = torch.rand(1, dim // 2, generator=generator).to(device) * 6.3
    return (randn(batch, heads, dim), randn(batch, kv_heads, dim), randn(batch, kv_heads, dim), angles.cos(),
            angles.sin(), randn(batch, kv_heads, length, dim), randn(batch, kv_heads, length, dim))


def _expected(q, k, v, cos, sin, k_cache, v_cache, pos):
    """-> (the caches after the op, the op's output in float64): the rotations by the model's own
    apply_rope, attention over keys 0 .. pos."""
    q, k = (decode.apply_rope(t[:, :, None], cos, sin)[:, :, 0] for t in (q, k))
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    k_cache[:, :, pos], v_cache[:, :, pos] = k, v
    rep = q.shape[1] // k_cache.shape[1]
    keys, values = (c[:, :, :pos + 1].double().repeat_interleave(rep, dim=1) for c in (k_cache, v_cache))
    scores = torch.einsum("bhd,bhld->bhl", q.double(), keys) / q.shape[-1] ** 0.5
    return k_cache, v_cache, torch.einsum("bhl,bhld->bhd", scores.softmax(-1), values)


def _check_op(fn, inputs, pos, tol):
    """Runs fn (the op, its kernels or its torch form) on a copy of inputs (caches NaN past pos and
    at pos: slots it must not read) and checks its output and the caches it wrote."""
    q, k, v, cos, sin, k_cache, v_cache = (t.clone() for t in inputs)
    k_cache[:, :, pos:], v_cache[:, :, pos:] = float("nan"), float("nan")
    want_k, want_v, want = _expected(q, k, v, cos, sin, k_cache, v_cache, pos)
    out = fn(q, k, v, cos, sin, k_cache, v_cache, torch.tensor([pos], device=q.device))
    assert out.dtype == q.dtype and out.shape == q.shape
    assert (out.double() - want).abs().max() < tol
    # the new key within a rounding of apply_rope's: the kernel may fuse a multiply-add, which
    # differs by up to an ulp of the products (values ~1) where the difference cancels
    bf16 = q.dtype == torch.bfloat16
    torch.testing.assert_close(k_cache, want_k, rtol=1e-2 if bf16 else 1e-6, atol=8e-3 if bf16 else 1e-6,
                               equal_nan=True)
    assert torch.equal(v_cache.nan_to_num(), want_v.nan_to_num())
    return out


# (B, H, KVH, L, D, pos): one key; several programs per head, the last one partial; keys past the
# last full program; one KV head per query head; the last cache slot
ATTENTION_CASES = [(1, 4, 2, 64, 16, 0), (2, 8, 2, 150, 32, 77), (1, 4, 4, 200, 16, 130), (3, 6, 3, 64, 16, 63)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_attention_kernel_matches_float64(case, dtype, kernel_device):
    # The Triton kernels (the Triton interpreter without a GPU) and the op's torch form, fresh
    # random inputs each; a second launch gives the same bits.
    pos = case[-1]
    inputs = _attention_inputs(sum(case), *case[:-1], kernel_device, dtype)
    # bf16: one rounding of values ~1, of the rotated q and k too; the Triton 3.6 interpreter
    # truncates fp32 -> bf16 (the GPU rounds to nearest), so the rotated q is off by up to one ulp there
    tol = 1e-5 if dtype == torch.float32 else (8e-3 if kernel_device == "cuda" else 1.6e-2)
    out = _check_op(decode_attention.launch, inputs, pos, tol)
    assert torch.equal(_check_op(decode_attention.launch, inputs, pos, tol), out)
    _check_op(decode_attention.reference, [t.cpu() for t in inputs], pos, min(tol, 8e-3))


@pytest.mark.gpu
def test_decode_attention_in_a_cuda_graph():
    # Captured once; replayed with the position and every input changed in place (as decode does).
    inputs = _attention_inputs(5, 2, 8, 2, 300, 128, "cuda")
    pos = torch.tensor([10], device="cuda")
    decode_attention.decode_attention(*inputs, pos)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention.decode_attention(*inputs, pos)
    for p in (0, 63, 64, 200, 299):
        pos.fill_(p)
        for t, new in zip(inputs, _attention_inputs(p, 2, 8, 2, 300, 128, "cuda")):
            t.copy_(new)
        want_k, want_v, want = _expected(*inputs, p)
        graph.replay()
        assert (out.double() - want).abs().max() < 8e-3
        torch.testing.assert_close(inputs[5], want_k, rtol=1e-2, atol=8e-3)
        assert torch.equal(inputs[6], want_v)


def test_decode_attention_op_checks():
    q, k, v, cos, sin, k_cache, v_cache = _attention_inputs(3, 1, 4, 2, 8, 16, "cpu", torch.float32)
    pos = torch.tensor([3])
    torch.library.opcheck(decode_attention.decode_attention, (q, k, v, cos, sin, k_cache, v_cache, pos))
    bad = [((torch.randn(1, 3, 16), k, v, cos, sin, k_cache, v_cache, pos), "multiple of KVH"),
           ((q, k, v, cos, sin, k_cache, torch.randn(1, 2, 9, 16), pos), r"\(B, KVH, L, D\)"),
           ((q, k[:, :1], v[:, :1], cos, sin, k_cache, v_cache, pos), "do not fit"),
           ((q, k, v, cos, sin, k_cache, v_cache, torch.tensor(3)), r"\(1,\) int64"),
           ((q, k, v, cos, sin, k_cache, v_cache, torch.tensor([3], dtype=torch.int32)), r"\(1,\) int64"),
           ((q, k, v, cos[:, :4], sin, k_cache, v_cache, pos), r"cos must be \(1, 8\) float32"),
           ((q, k, v, cos, sin.double(), k_cache, v_cache, pos), r"sin must be \(1, 8\) float32"),
           ((q.bfloat16(), k, v, cos, sin, k_cache, v_cache, pos), "dtype")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            decode_attention.decode_attention(*args)
    odd = _attention_inputs(3, 1, 4, 2, 8, 24, "cpu", torch.float32)
    with pytest.raises(ValueError, match="powers of two"):
        decode_attention.launch(*odd, pos)


def test_decode_attention_position_outside_the_cache(kernel_device, monkeypatch):
    """A CPU pos outside [0, L) is an error (the torch form wrapped -1 to the last slot); the
    kernels, which cannot raise (a device pos, a CUDA-graph replay), write nothing and make every
    output NaN (pos = -1 wrote the slot before the cache). Strided cos / sin are read by their
    strides (the kernel read them packed)."""
    inputs = _attention_inputs(7, 1, 4, 2, 70, 16, "cpu", torch.float32)
    for fn in (decode_attention.reference, decode_attention.launch):
        for pos in (-1, 70):
            with pytest.raises(ValueError, match=f"pos {pos} is outside the cache's positions 0 .. 69"):
                fn(*(t.clone() for t in inputs), torch.tensor([pos]))
    q, k, v, cos, sin, k_cache, v_cache = (t.to(kernel_device) for t in inputs)
    # the caches as views into wider buffers: what lies around them must stay as it was
    k_buf, v_buf = (torch.randn(3, c.numel(), device=kernel_device) for c in (k_cache, v_cache))
    k_buf[1], v_buf[1] = k_cache.reshape(-1), v_cache.reshape(-1)
    before = k_buf.clone(), v_buf.clone()
    k_view, v_view = (b[1].view(k_cache.shape) for b in (k_buf, v_buf))
    monkeypatch.setattr(decode_attention, "_check_position", lambda pos, length: None)
    for pos in (-1, 70):
        out = decode_attention.launch(q, k, v, cos, sin, k_view, v_view, torch.tensor([pos], device=kernel_device))
        assert out.isnan().all()
        assert torch.equal(k_buf, before[0]) and torch.equal(v_buf, before[1])
    angles = torch.randn(1, 16)
    strided = angles.cos()[:, ::2], angles.sin()[:, ::2]  # (1, 8), stride 2
    packed = [t.contiguous() for t in strided]
    pos = torch.tensor([66], device=kernel_device)
    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    outs = [decode_attention.launch(q, k, v, *(t.to(kernel_device) for t in rope), *c, pos)
            for rope, c in zip((strided, packed), caches)]
    assert torch.equal(outs[0], outs[1]) and torch.equal(caches[0][0], caches[1][0])


@pytest.mark.gpu
def test_decode_attention_off_the_kernels_on_cuda():
    # A head dim the kernels do not take (80) and non-contiguous caches: the torch form, on CUDA.
    inputs = _attention_inputs(7, 2, 8, 2, 40, 80, "cuda")
    assert not decode_attention.kernel_applies(*inputs[:3], *inputs[5:])
    _check_op(decode_attention.decode_attention, inputs, 17, 8e-3)
    inputs = list(_attention_inputs(8, 2, 8, 2, 40, 64, "cuda"))
    inputs[5], inputs[6] = (c.transpose(2, 3).contiguous().transpose(2, 3) for c in inputs[5:])
    assert not decode_attention.kernel_applies(*inputs[:3], *inputs[5:])
    _check_op(decode_attention.decode_attention, inputs, 17, 8e-3)


def test_decode_attention_op_matches_the_matmul_form():
    # The model's decode steps with the op and with the two matmuls and softmax it replaces, fp32.
    tokens = _tokens(2, 9)
    logits = []
    for use_op in (True, False):
        cfg = decode.ModelConfig(**{**CFG.__dict__, "decode_attention": use_op})
        model = decode.build_model(cfg, MAX_LEN, 2, "cpu").float()
        with torch.no_grad():
            model(tokens[:, :5], torch.arange(5))
            logits.append([model(tokens[:, t:t + 1], torch.tensor([t])) for t in range(5, 9)])
    for with_op, matmuls in zip(*logits):
        torch.testing.assert_close(with_op, matmuls, rtol=1e-4, atol=1e-5)


# --- through backend="nvfp4" on the CPU ----------------------------------------------------------

def test_decode_through_the_backend_on_cpu(caplog):
    # One graph (every call is a (2, 1) decode step), fullgraph: a graph break is an error.
    model = decode.build_model(CFG, MAX_LEN, 2, "cpu")
    reference = _eager_nvfp4(model, "bf16")
    step = nv.compile(model, nv.Config(activations="bf16"), fullgraph=True, dynamic=False)
    tokens = _tokens(2, 6)
    counters.clear()
    with caplog.at_level(logging.INFO, logger="nvfp4_inductor"):
        (first, *rest), code = run_and_get_code(_run_steps, step, tokens, "cpu")
    source = "\n".join(code)
    # gate and up of each layer are one GEMM with SiLU * mul in its epilogue (k and v, N = 32, are
    # off the 64-row tile: apart)
    assert source.count("torch.ops.nvfp4.linear_tiled.default(") == LINEARS - 2 * CFG.layers
    assert source.count("torch.ops.nvfp4.linear_tiled_silu_mul.default(") == CFG.layers
    assert "torch.ops.nvfp4.quantize" not in source  # weights quantized at compile time
    assert f"converted {LINEARS} linear weights, skipped 1" in caplog.text
    assert counters["stats"]["unique_graphs"] == 1  # no recompiles across positions
    with torch.no_grad():
        expected = _run_steps(reference, tokens, "cpu")
    for got, want in zip([first, *rest], expected):
        torch.testing.assert_close(got, want, **TOL)
    for layer, ref_layer in zip(model.layers, reference.layers):  # the in-place cache writes landed
        torch.testing.assert_close(layer.attn.k_cache, ref_layer.attn.k_cache, **TOL)
        torch.testing.assert_close(layer.attn.v_cache, ref_layer.attn.v_cache, **TOL)
        assert layer.attn.k_cache[:, :, :6].ne(0).any(dim=-1).all()
    # The NVFP4 error is well above the tolerance (0.064 here), so a silent bf16 fall-back
    # would not pass the comparison above.
    bf16 = decode.build_model(CFG, MAX_LEN, 2, "cpu")
    with torch.no_grad():
        bf16_logits = _run_steps(bf16, tokens, "cpu")
    assert max((a - b).abs().max().item() for a, b in zip(bf16_logits, expected)) > 2 * TOL["atol"]


def test_greedy_step_through_the_backend_on_cpu():
    # The example's decode step as it runs (GreedyStep: the argmax and the next position in the
    # graph, no tensor inputs), fullgraph, one graph for every position; the same choices as the
    # eagerly converted model's GreedyStep.
    model = decode.build_model(CFG, MAX_LEN, 2, "cpu")
    reference = decode.GreedyStep(_eager_nvfp4(model, "bf16"), 2)
    loop = decode.GreedyStep(model, 2)
    step = decode.compile_variant(loop, nv.Config(activations="bf16"), "default", fullgraph=True)
    start = _tokens(2, 1)
    loop.token.copy_(start)
    reference.token.copy_(start)
    counters.clear()
    got, want = [], []
    for _ in range(6):
        step()
        got.append(loop.token.clone())
        with torch.no_grad():
            reference()
        want.append(reference.token.clone())
    assert counters["stats"]["unique_graphs"] == 1 and int(loop.pos) == 6
    assert torch.equal(torch.cat(got, 1), torch.cat(want, 1))


def test_example_runs_on_cpu(monkeypatch, capsys):
    # README: `python examples/decode.py --small` (bf16, W4A16, W4A4 on the CPU reference ops).
    monkeypatch.setattr("sys.argv", ["decode.py", "--small", "--steps", "4", "--prompt-len", "4"])
    decode.main()
    out = capsys.readouterr().out
    assert all(f"{name:>12}" in out for name in decode.VARIANTS) and "100.0%" in out


@pytest.mark.parametrize("flag", ["--steps", "--batch", "--prompt-len"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_example_refuses_counts_below_one(flag, value, monkeypatch, capsys):
    # --steps 0 ran the default 64 steps, --steps -2 printed negative tokens/s, --batch 0 and
    # --prompt-len 0 crashed inside the run (ZeroDivisionError, IndexError).
    monkeypatch.setattr("sys.argv", ["decode.py", "--small", flag, value])
    with pytest.raises(SystemExit):
        decode.main()
    assert f"argument {flag}: must be a positive integer; got {value}" in capsys.readouterr().err


# --- on a GPU, captured in CUDA graphs -----------------------------------------------------------

GPU_ACTIVATIONS = ["bf16", "nvfp4"]  # W4A16, W4A4


def _gpu_setup(activations, batch=2):
    model = decode.build_model(CFG, MAX_LEN, batch, "cuda")
    reference = _eager_nvfp4(model, activations)
    step = nv.compile(model, nv.Config(activations=activations), mode="reduce-overhead",
                      fullgraph=True, dynamic=False)
    return model, reference, step


@pytest.mark.gpu
@pytest.mark.parametrize("activations", GPU_ACTIVATIONS)
def test_cudagraph_replay_matches_eager(activations):
    # References: the same graphs compiled without CUDA graphs (same kernels: only capture and
    # replay differ), and for W4A16 also the eager NVFP4 model. Not eager for W4A4: quantizing
    # activations is discontinuous, and a one-ulp change of the embeddings moved the tiny model's
    # W4A4 logits by 5% (on the CPU; compiled vs eager: 5%), vs 0.6% for W4A16.
    model, reference, step = _gpu_setup(activations)
    no_graphs_model = copy.deepcopy(model)
    no_graphs = nv.compile(no_graphs_model, nv.Config(activations=activations), fullgraph=True,
                           dynamic=False)
    prompt, tokens = _tokens(2, 5).cuda(), _tokens(2, 8, seed=2).cuda()
    counters.clear()
    torch.compiler.cudagraph_mark_step_begin()
    got = [step(prompt, torch.arange(5, device="cuda")).clone()]  # the prefill graph
    pos = torch.full((1,), 5, device="cuda")
    ptrs = []
    for i in range(tokens.shape[1]):  # warm-up, record, then replays of the decode graph
        torch.compiler.cudagraph_mark_step_begin()
        logits = step(tokens[:, i:i + 1], pos)
        ptrs.append(logits.data_ptr())
        got.append(logits.clone())
        pos += 1
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(set(ptrs[3:])) == 1, "replays return the graph's static output buffer"
    same_kernels = [no_graphs(prompt, torch.arange(5, device="cuda"))]
    same_kernels += _run_steps_from(no_graphs, tokens, 5)
    for i, (g, e) in enumerate(zip(got, same_kernels)):
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-3, msg=lambda m, i=i: f"step {i}: {m}")
    for layer, ref_layer in zip(model.layers, no_graphs_model.layers):
        torch.testing.assert_close(layer.attn.k_cache, ref_layer.attn.k_cache, rtol=1e-3, atol=1e-3)
    if activations == "bf16":
        with torch.no_grad():
            expected = [reference(prompt, torch.arange(5, device="cuda"))]
            expected += _run_steps_from(reference, tokens, 5)
        for i, (g, e) in enumerate(zip(got, expected)):
            torch.testing.assert_close(g, e, **TOL, msg=lambda m, i=i: f"step {i}: {m}")


def _run_steps_from(model, tokens, start):
    pos = torch.full((1,), start, device=tokens.device)
    out = []
    for i in range(tokens.shape[1]):
        out.append(model(tokens[:, i:i + 1], pos))
        pos = pos + 1
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("activations", GPU_ACTIVATIONS)
def test_decode_step_makes_no_host_sync(activations):
    _, _, step = _gpu_setup(activations)
    token = _tokens(2, 1).cuda()
    pos = torch.zeros(1, dtype=torch.long, device="cuda")
    counters.clear()
    for _ in range(4):  # compile, warm up, record, replay
        torch.compiler.cudagraph_mark_step_begin()
        token = step(token, pos).argmax(-1, keepdim=True)
        pos += 1
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # one full decode step as the generate loop runs it: a sync raises here
        for _ in range(2):
            torch.compiler.cudagraph_mark_step_begin()
            token = step(token, pos).argmax(-1, keepdim=True)
            pos += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert int(pos) == 6


@pytest.mark.gpu
@pytest.mark.parametrize("activations", [None, "bf16", "nvfp4"], ids=["bf16", "W4A16", "W4A4"])
def test_greedy_step_replays_without_sync(activations):
    # The generate loop's step as the benchmark times it (GreedyStep: no tensor inputs, its
    # buffers mutated): recorded and replayed as a CUDA graph, no host sync in a replay, the same
    # choices as the same module compiled without CUDA graphs (the same kernels).
    config = None if activations is None else nv.Config(activations=activations)
    model = decode.build_model(CFG, MAX_LEN, 2, "cuda")
    loops = [decode.GreedyStep(m, 2) for m in (model, copy.deepcopy(model))]
    steps = [decode.compile_variant(loop, config, mode, fullgraph=True)
             for loop, mode in zip(loops, ("reduce-overhead", "default"))]
    start = _tokens(2, 1).cuda()
    counters.clear()
    choices = []
    for loop, step in zip(loops, steps):
        loop.token.copy_(start)
        choices.append([])
        for i in range(8):  # compile, warm up, record, replays
            if i >= 4 and loop is loops[0]:  # replays: a host sync raises
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                torch.compiler.cudagraph_mark_step_begin()
                step()
            finally:
                torch.cuda.set_sync_debug_mode(0)
            choices[-1].append(loop.token.clone())
        assert int(loop.pos) == 8
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert torch.equal(torch.cat(choices[0], 1), torch.cat(choices[1], 1))


@pytest.mark.gpu
def test_batch_size_change_records_a_new_graph():
    model, reference, step = _gpu_setup("bf16", batch=1)
    counters.clear()
    for batch, seed in ((1, 3), (2, 4), (1, 5)):  # back to 1: new cache buffers, same shapes
        model.setup_cache(batch)
        reference.setup_cache(batch)
        tokens = _tokens(batch, 5, seed).cuda()
        got = _run_steps(step, tokens, "cuda")
        with torch.no_grad():
            expected = _run_steps(reference, tokens, "cuda")
        for g, e in zip(got, expected):
            assert g.shape == (batch, CFG.vocab)
            torch.testing.assert_close(g, e, **TOL)
    assert counters["inductor"]["cudagraph_skips"] == 0


@pytest.mark.gpu
def test_bf16_variant_under_cudagraphs_matches_eager():
    # The baseline of the example and the benchmark: plain Inductor, same model and loop.
    model = decode.build_model(CFG, MAX_LEN, 2, "cuda")
    reference = copy.deepcopy(model)
    step = decode.compile_variant(model, None, "reduce-overhead", fullgraph=True)
    tokens = _tokens(2, 6).cuda()
    counters.clear()
    got = _run_steps(step, tokens, "cuda")
    with torch.no_grad():
        expected = _run_steps(reference, tokens, "cuda")
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, **TOL)
    assert counters["inductor"]["cudagraph_skips"] == 0

"""nv.NVFP4Cache with Hugging Face transformers: generate with attn_implementation "nvfp4" on a
tiny random Llama against the bf16 static cache, left-padded batches, the fallback for other
attention implementations, selective dequant (gather) and the errors. On the CPU (the
reference path); the `gpu` tests run the kernels, compiled."""

import inspect

import pytest
import torch

import nvfp4_inductor as nv
from nvfp4_inductor.reference import kv_cache as ref

transformers = pytest.importorskip("transformers")

SHAPES = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
VOCAB = SHAPES["vocab_size"]
STEPS = 32


def _model(seed: int = 0, attn: str = "nvfp4", **kw):
    nv.NVFP4Cache  # noqa: B018  (first use registers attn_implementation "nvfp4")
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SHAPES, **kw})).to(torch.bfloat16).eval()
    model.set_attn_implementation(attn)
    return model


def _cache_kw(model, cache):
    """The cache argument under its name in this transformers (cache in 5.2x, past_key_values before)."""
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    return {name: cache}


def _nvfp4_cache(model, batch, slots):
    return nv.NVFP4Cache(model.config, max_batch_size=batch, max_cache_len=slots, dtype=torch.bfloat16)


def _generate(model, ids, cache, steps=STEPS, **kw):
    out = model.generate(ids, **_cache_kw(model, cache), max_new_tokens=steps, min_new_tokens=steps,
                         do_sample=False, return_dict_in_generate=True, output_logits=True, **kw)
    return out.sequences, torch.stack(out.logits, 1)  # (B, steps, vocab)


def _teacher_forced(model, sequences, prompt_len, cache, attention_mask=None):
    """Logits of each generated position given the same tokens: the prompt, then one token a step."""
    logits = []
    with torch.no_grad():
        for end in range(prompt_len, sequences.shape[1]):
            start = 0 if end == prompt_len else end - 1
            kw = {} if attention_mask is None else {"attention_mask": attention_mask[:, :end]}
            if attention_mask is not None:
                kw["position_ids"] = (attention_mask[:, :end].long().cumsum(-1) - 1).clamp(min=0)[:, start:end]
            out = model(sequences[:, start:end], **_cache_kw(model, cache), use_cache=True, **kw)
            logits.append(out.logits[:, -1])
    return torch.stack(logits, 1)


def _min_cosine(a, b):
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min().item()


def test_generate_keeps_the_bf16_static_cache_logits():
    """32 greedy steps with the NVFP4 cache and attn_implementation "nvfp4": every step's logits
    have cosine >= 0.98 with the bf16 static cache's on the same tokens; the cache holds the
    prompt and the steps' keys as the reference quantizer writes them."""
    model = _model()
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(1))
    cache = _nvfp4_cache(model, 1, 11 + STEPS)
    sequences, logits = _generate(model, ids, cache)
    assert sequences.shape == (1, 11 + STEPS) and cache.get_seq_length() == 11 + STEPS - 1
    want = _teacher_forced(model, sequences, 11, transformers.StaticCache(model.config, max_cache_len=64))
    cos = _min_cosine(logits, want)
    assert cos >= 0.98, cos
    # the stored keys of layer 0 are nonzero exactly in the slots written, zero beyond
    g = ref.planes(cache.layers[0].keys)[2][0]
    assert g[:, : 11 + STEPS - 1].gt(0).all() and g[:, 11 + STEPS - 1:].eq(0).all()


def test_left_padded_batch_matches_each_sequence_alone():
    """Batch 2, prompts of 5 and 13 tokens left-padded: each row's tokens and logits are those of
    its prompt generated alone (per-row scales never mix sequences; padding slots are masked)."""
    model = _model(seed=2)
    gen = torch.Generator().manual_seed(3)
    short, long = torch.randint(0, VOCAB, (1, 5), generator=gen), torch.randint(0, VOCAB, (1, 13), generator=gen)
    ids = torch.cat([torch.cat([torch.zeros(1, 8, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 8, dtype=torch.long), torch.ones(1, 5, dtype=torch.long)], 1),
                      torch.ones(1, 13, dtype=torch.long)])
    steps = 12
    seq2, logits2 = _generate(model, ids, _nvfp4_cache(model, 2, 13 + steps), steps, attention_mask=mask,
                              pad_token_id=0)
    for row, prompt in enumerate((short, long)):
        seq1, logits1 = _generate(model, prompt, _nvfp4_cache(model, 1, 13 + steps), steps)
        assert torch.equal(seq2[row, 13:], seq1[0, prompt.shape[1]:]), row
        assert _min_cosine(logits2[row], logits1[0]) > 0.999, row


def test_other_attention_reads_the_dequantized_cache():
    """With attn_implementation "sdpa" the cache returns its keys and values dequantized (to bf16):
    on the same tokens, the logits of "nvfp4", which reads them packed (in fp32 on the CPU)."""
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    model = _model()
    sequences, _ = _generate(model, ids, _nvfp4_cache(model, 1, 9 + 8), 8)
    logits = []
    for attn in ("nvfp4", "sdpa"):
        model.set_attn_implementation(attn)
        logits.append(_teacher_forced(model, sequences, 9, _nvfp4_cache(model, 1, 9 + 8)))
    assert _min_cosine(logits[0], logits[1]) > 0.999


def test_gather_dequantizes_selected_slots():
    """cache.gather(layer, indices): (n,) or (B, H, n) slot numbers -> keys and values of those slots
    only, equal to the reference dequantize of the whole cache at them; out-of-range slots raise."""
    model = _model()
    cache = _nvfp4_cache(model, 2, 40)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
    with torch.no_grad():
        model(ids, **_cache_kw(model, cache), use_cache=True)
    layer = cache.layers[1]
    full_k, full_v = ref.dequantize(layer.keys, torch.bfloat16), ref.dequantize(layer.values, torch.bfloat16)
    picks = torch.randint(0, 17, (2, 2, 5), generator=gen)
    k, v = cache.gather(1, picks)
    assert k.shape == (2, 2, 5, SHAPES["hidden_size"] // SHAPES["num_attention_heads"]) and k.dtype == torch.bfloat16
    assert torch.equal(k, full_k.gather(2, picks[..., None].expand(*picks.shape, k.shape[-1])))
    assert torch.equal(v, full_v.gather(2, picks[..., None].expand(*picks.shape, v.shape[-1])))
    k1, _ = cache.gather(1, torch.tensor([16, 0, 3]))
    assert torch.equal(k1, full_k[:, :, [16, 0, 3]])
    for bad in (torch.tensor([0, 48]), torch.tensor([-1])):
        with pytest.raises(IndexError, match="out of range"):
            cache.gather(0, bad)
    for bad in (-1, 2, True, 1.0):
        with pytest.raises(IndexError, match="layer must be an int in 0 .. 1"):
            cache.gather(bad, picks)


def test_errors():
    model = _model()
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(6))
    short = _nvfp4_cache(model, 1, 20)  # 32 slots
    with pytest.raises(ValueError, match=r"too short: 33 tokens .* its 32 slots \(max_cache_len, rounded up"):
        model.generate(ids, **_cache_kw(model, short), max_new_tokens=40, do_sample=False)
    # nothing written for the token that did not fit, in any layer
    assert [layer.written for layer in short.layers] == [32, 32]
    assert [int(layer.cumulative_length) for layer in short.layers] == [32, 32]
    with pytest.raises(ValueError, match="allocated for 1"):
        model.generate(ids.expand(2, -1), **_cache_kw(model, _nvfp4_cache(model, 1, 32)), max_new_tokens=2,
                       do_sample=False)
    odd = transformers.LlamaConfig(**{**SHAPES, "head_dim": 40})
    with pytest.raises(ValueError, match="multiple of 16"):
        nv.NVFP4Cache(odd, max_batch_size=1, max_cache_len=16)
    with pytest.raises(TypeError, match="dtype"):
        nv.NVFP4Cache(model.config, max_batch_size=1, max_cache_len=16, dtype=torch.int8)
    with pytest.raises(TypeError, match="allocated for torch.float16"):
        model.generate(ids, **_cache_kw(model, nv.NVFP4Cache(model.config, 1, 32, dtype=torch.float16)),
                       max_new_tokens=2, do_sample=False)
    # a cache built from a config other than the model's, which does not say "nvfp4": it hands the
    # attention dequantized keys, which the "nvfp4" attention refuses instead of running SDPA on them
    other = transformers.LlamaConfig(**SHAPES)
    with pytest.raises(ValueError, match=r"NVFP4Cache dequantized for .* attention.*NVFP4Cache\(model.config"):
        model.generate(ids, **_cache_kw(model, nv.NVFP4Cache(other, 1, 32)), max_new_tokens=2, do_sample=False)
    sliding = transformers.MistralConfig(**SHAPES, sliding_window=8)
    with pytest.raises(NotImplementedError, match="full-attention"):
        nv.NVFP4Cache(sliding, max_batch_size=1, max_cache_len=16)


def test_compiled_model_writes_the_cache_in_place():
    """torch.compile(model, backend="nvfp4") (NVFP4 weights too) with the NVFP4 cache: the graph calls
    nvfp4::kv_write and nvfp4::kv_attention, the cache's own tensors receive the writes (the mutation
    is not lost to a copy), and the prefill and 3 decode steps stay close to eager bf16."""
    from torch._inductor.utils import run_and_get_code

    from helpers.hf import close, nvfp4_ops

    model = _model()
    ids = torch.randint(0, VOCAB, (2, 7), generator=torch.Generator().manual_seed(8))

    def run(m):
        cache = _nvfp4_cache(model, 2, 32)
        with torch.no_grad():
            logits = [m(ids, **_cache_kw(model, cache), use_cache=True).logits[:, -1]]
            logits += [m(ids[:, t:t + 1], **_cache_kw(model, cache), use_cache=True).logits[:, -1] for t in range(3)]
        return torch.stack(logits, 1), cache

    want, _ = run(model)
    torch._dynamo.reset()
    (got, cache), code = run_and_get_code(lambda: run(torch.compile(model, backend="nvfp4")))
    assert {"kv_write", "kv_attention"} <= set(nvfp4_ops(code)), nvfp4_ops(code)
    g = ref.planes(cache.layers[1].values)[2]
    assert g[:, :, :10].gt(0).all() and g[:, :, 10:].eq(0).all()
    ok, err = close(got, want)
    assert ok, err


@pytest.mark.gpu
def test_gpu_compiled_generate_with_the_nvfp4_cache():
    """On CUDA (the kernels): eager generate with the NVFP4 cache keeps cosine >= 0.98 with the bf16
    static cache over 32 steps. Compiled, the weights are NVFP4 too (against bf16 weights that alone
    leaves ~0.97 on this tiny random model), so the references are the eager model converted to
    NVFP4 weights: torch.compile(model, backend="nvfp4") calls both cache ops in its graph and keeps
    cosine > 0.999 with it; the converted model's generate with its own compiled decode
    (CompileConfig(backend="nvfp4", mode="reduce-overhead"), CUDA graphs) runs 32 steps without
    CUDA-graph skips, every step cosine > 0.999 with the eager converted model on the same tokens."""
    import copy

    from torch._dynamo.utils import counters
    from torch._inductor.utils import run_and_get_code

    model = _model().cuda()
    ids = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7)).cuda()

    def cache():
        return nv.NVFP4Cache(model.config, max_batch_size=2, max_cache_len=11 + STEPS, device="cuda")

    eager_seq, eager_logits = _generate(model, ids, cache(), disable_compile=True)
    want = _teacher_forced(model, eager_seq, 11, transformers.StaticCache(model.config, max_cache_len=64))
    assert _min_cosine(eager_logits, want) >= 0.98

    converted = copy.deepcopy(model)
    nv.convert(converted, nv.Config(activations="bf16"))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="nvfp4")
    with torch.no_grad():
        logits, code = run_and_get_code(lambda: compiled(ids, **_cache_kw(model, cache()), use_cache=True).logits)
        want = converted(ids, **_cache_kw(model, cache()), use_cache=True).logits
    assert "torch.ops.nvfp4.kv_write" in "\n".join(code) and "torch.ops.nvfp4.kv_attention" in "\n".join(code)
    assert _min_cosine(logits[:, -1], want[:, -1]) > 0.999

    config = transformers.CompileConfig(backend="nvfp4", mode="reduce-overhead")
    torch._dynamo.reset()
    skips = counters["inductor"]["cudagraph_skips"]
    sequences, logits = _generate(converted, ids, cache(), compile_config=config)
    assert counters["inductor"]["cudagraph_skips"] == skips
    assert _min_cosine(logits, _teacher_forced(converted, sequences, 11, cache())) > 0.999


def test_nvfp4_attention_over_another_cache_traces_whole():
    """attn_implementation "nvfp4" with transformers' bf16 StaticCache (SDPA on its keys) under
    torch.compile(fullgraph=True): no graph break, the same logits as eager."""
    model = _model()
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(8))
    outs = []
    for forward in (model.forward, torch.compile(model.forward, backend="eager", fullgraph=True)):
        cache = transformers.StaticCache(config=model.config, max_cache_len=32)
        with torch.no_grad():
            outs.append(forward(input_ids=ids, **_cache_kw(model, cache), use_cache=True,
                                cache_position=torch.arange(5)).logits)
    assert torch.equal(outs[0], outs[1])

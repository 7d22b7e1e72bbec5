"""Token-by-token greedy decode of a Llama-style model: bf16 vs NVFP4 (W4A16, W4A4).

The model (written here; random weights from a fixed seed, since no weights can be downloaded):
RMSNorm, rotary embeddings, grouped-query attention over a static KV cache, a SiLU-gated MLP, bf16
throughout; the output head stays bf16 (Config skips `lm_head`). The KV cache is preallocated,
(batch, kv_heads, max_len, head_dim), and written in place at a position tensor that lives on the
device: a decode step reads no host scalar and never syncs, so it can be captured in a CUDA graph
and replayed. Every step has the same shapes: the prefill's attention covers the whole cache
(max_len keys, later positions masked, two batched matmuls and a softmax); a decode step's is one
custom op, `decode_attention` (examples/decode_attention.py: the rotary embeddings, the cache
writes and attention over the keys up to the position, two Triton kernels on CUDA;
`ModelConfig(decode_attention=False)` keeps the prefill's form).

Each variant is compiled with static shapes (`dynamic=False`): the model for the prefill (the
prompt in one call), and the decode step as `GreedyStep`, which keeps the (batch, 1) token and the
(1,) position in buffers and writes the step's argmax and the next position back on the device,
so that the loop only replays the step's CUDA graph.

    bf16:  torch.compile(module, mode="reduce-overhead")
    NVFP4: nvfp4_inductor.compile(module, Config(activations="bf16" | "nvfp4"), mode="reduce-overhead")

(`nvfp4_inductor.compile` is `torch.compile(model, backend="nvfp4")` with each call under
no_grad and Dynamo preparing freezing, so the weights are quantized once, at compile time.)

Prints tokens/s of the decode steps and the agreement of the next-token choices with bf16,
teacher-forced: the NVFP4 model is fed the bf16 model's tokens, so one different choice does not
change every later one. Random weights make the logits of many tokens nearly tied, so this is a
rough proxy; `examples/minilm_accuracy.py` measures NVFP4 on real weights.

    python examples/decode.py                 # GPU, the default config (a few seconds of decode)
    python examples/decode.py --small         # CPU: a tiny config, mode="default" (CUDA graphs are GPU-only)
"""

import argparse
import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import nvfp4_inductor as nv
from decode_attention import apply_rope, decode_attention  # apply_rope: (B, H, T, D), cos (T, D/2)


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp: int
    rope_theta: float = 500000.0  # Llama 3
    norm_eps: float = 1e-5
    decode_attention: bool = True  # a decode step's RoPE, cache writes, attention: one op


PRESETS = {
    # Tests: every linear is a multiple of 16, so all of them convert.
    "tiny": ModelConfig(vocab=256, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, mlp=128),
    # --small: the CPU run (NVFP4 ops run the pure-torch reference there).
    "small": ModelConfig(vocab=1024, hidden=256, layers=2, heads=8, kv_heads=2, head_dim=32, mlp=512),
    # The default: modest, so that compiling three variants and decoding takes well under a minute.
    "default": ModelConfig(vocab=32000, hidden=2048, layers=4, heads=16, kv_heads=4, head_dim=128,
                           mlp=5632),
    # benchmarks/bench_decode.py: Llama-3-8B layer shapes (vocab 32000 as in Llama 2), 8 layers.
    "llama3-8b-8layers": ModelConfig(vocab=32000, hidden=4096, layers=8, heads=32, kv_heads=8,
                                     head_dim=128, mlp=14336),
}
VARIANTS = {  # name -> None (bf16) or the NVFP4 Config
    "bf16": None,
    "nvfp4 W4A16": nv.Config(activations="bf16"),
    "nvfp4 W4A4": nv.Config(activations="nvfp4"),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, max_len: int, theta: float):
    """-> cos, sin, each (max_len, head_dim/2) fp32: the angle of position p, pair i is
    p * theta^(-2i/head_dim)."""
    inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.decode_op = cfg.decode_attention
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)
        self.register_buffer("k_cache", None, persistent=False)  # set by setup_cache
        self.register_buffer("v_cache", None, persistent=False)

    def setup_cache(self, batch: int, max_len: int, dtype, device):
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)

    def forward(self, x, pos, cos, sin, mask):
        """x (B, T, hidden); pos (T,) int64 positions; cos, sin (T, D/2); mask (T, max_len) bool."""
        batch, seq, _ = x.shape
        if seq == 1 and self.decode_op:  # RoPE, the cache writes and attention: one op
            q = self.wq(x).view(batch, self.heads, self.head_dim)
            k = self.wk(x).view(batch, self.kv_heads, self.head_dim)
            v = self.wv(x).view(batch, self.kv_heads, self.head_dim)
            out = decode_attention(q, k, v, cos, sin, self.k_cache, self.v_cache, pos)  # (B, H, D)
            return self.wo(out.reshape(batch, 1, self.heads * self.head_dim))
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # In place, at device positions: the step stays capturable and the cache is not copied.
        self.k_cache[:, :, pos] = k
        self.v_cache[:, :, pos] = v
        # GQA without repeating the cache: the `rep` query heads that share a KV head (heads
        # kv * rep .. kv * rep + rep - 1) become extra rows of one (rep * T, D) @ (D, max_len).
        rep, max_len = self.heads // self.kv_heads, self.k_cache.shape[2]
        q = q.reshape(batch, self.kv_heads, rep * seq, self.head_dim)
        scores = (q @ self.k_cache.transpose(-1, -2)).float() * (1.0 / math.sqrt(self.head_dim))
        scores = scores.view(batch, self.kv_heads, rep, seq, max_len).masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1).to(x.dtype).view(batch, self.kv_heads, rep * seq, max_len)
        out = (probs @ self.v_cache).view(batch, self.heads, seq, self.head_dim)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.mlp, bias=False)  # gate
        self.w3 = nn.Linear(cfg.hidden, cfg.mlp, bias=False)  # up
        self.w2 = nn.Linear(cfg.mlp, cfg.hidden, bias=False)  # down

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, pos, cos, sin, mask):
        x = x + self.attn(self.attn_norm(x), pos, cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only LM. forward(tokens (B, T) int64, pos (T,) int64 on the model's device) ->
    logits (B, vocab) of the last position; writes the T positions' keys and values to the cache."""

    def __init__(self, cfg: ModelConfig, max_len: int):
        super().__init__()
        self.cfg, self.max_len = cfg, max_len
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.head_dim, max_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.register_buffer("key_pos", torch.arange(max_len), persistent=False)

    def setup_cache(self, batch: int):
        """(Re)allocates a zeroed KV cache for `batch` sequences. Under torch.compile a new batch
        size fails the shape guards and compiles (and, with CUDA graphs, records) a new graph."""
        weight = self.embed.weight  # the model's dtype (lm_head's is uint8 if it was converted)
        for layer in self.layers:
            layer.attn.setup_cache(batch, self.max_len, weight.dtype, weight.device)

    def forward(self, tokens, pos):
        cos, sin = self.rope_cos[pos], self.rope_sin[pos]
        mask = self.key_pos <= pos[:, None]  # (T, max_len): causal, and hides unwritten slots
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, pos, cos, sin, mask)
        return self.lm_head(self.norm(x[:, -1]))


def build_model(cfg: ModelConfig, max_len: int, batch: int, device, seed: int = 0) -> Transformer:
    """The model in bf16 on `device`, weights N(0, 0.02) from `seed` (norms 1), cache for `batch`."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(cfg, max_len).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if not name.endswith("norm.weight"):
            with torch.no_grad():
                p.normal_(0.0, 0.02)
    cos, sin = rope_tables(cfg.head_dim, max_len, cfg.rope_theta)  # fp32: .to() rounded them
    model.rope_cos, model.rope_sin = cos.to(device), sin.to(device)
    model.setup_cache(batch)
    return model.eval()


class GreedyStep(nn.Module):
    """The generate loop's step, all on the device: the token and the position are buffers; a
    call feeds `token` (B, 1) at `pos` (1,) to the model, writes the argmax of the logits back to
    `token` and advances `pos`. Compiled with mode="reduce-overhead" (the graph has no inputs but
    the model's buffers), a decode step is one CUDA-graph replay: no input copies and no argmax or
    position kernels of its own (a shorter step than with the argmax and `pos += 1` outside)."""

    def __init__(self, model: Transformer, batch: int):
        super().__init__()
        self.model = model
        device = model.lm_head.weight.device
        self.register_buffer("token", torch.zeros(batch, 1, dtype=torch.long, device=device), persistent=False)
        self.register_buffer("pos", torch.zeros(1, dtype=torch.long, device=device), persistent=False)

    def forward(self):
        self.token.copy_(self.model(self.token, self.pos).argmax(-1, keepdim=True))
        self.pos.add_(1)


def compile_variant(model: nn.Module, config: nv.Config | None, mode: str, **compile_kwargs):
    """-> the module compiled in bf16 (config None) or NVFP4, called under no_grad: for a
    Transformer step(tokens, pos) -> logits, for a GreedyStep step() (it updates its buffers)."""
    if config is not None:
        return nv.compile(model, config, mode=mode, dynamic=False, **compile_kwargs)
    compiled = torch.compile(model, mode=mode, dynamic=False, **compile_kwargs)

    def step(*args):
        with torch.no_grad():
            return compiled(*args)

    step.compiled = compiled
    return step


def greedy(prefill, step, loop: GreedyStep, prompt: torch.Tensor, steps: int,
           forced: torch.Tensor | None = None) -> torch.Tensor:
    """-> (B, steps) next-token choices: the first from prefill(prompt (B, T), positions) (the
    model, compiled or not), then one per call of step (loop, compiled or not). With forced
    (B, steps), step i is fed forced[:, i - 1] instead of its own choice."""
    seq = prompt.shape[1]
    torch.compiler.cudagraph_mark_step_begin()
    choices = [prefill(prompt, torch.arange(seq, device=prompt.device)).argmax(-1)]
    loop.pos.fill_(seq)
    for i in range(1, steps):
        loop.token.copy_((forced[:, i - 1] if forced is not None else choices[-1])[:, None])
        torch.compiler.cudagraph_mark_step_begin()
        step()
        choices.append(loop.token[:, 0].clone())  # the next replay overwrites the buffer
    return torch.stack(choices, dim=1)


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def decode_seconds(step, loop: GreedyStep, start: int, steps: int) -> float:
    """Wall time of `steps` calls of step (loop compiled: greedy decode steps), positions start,
    start + 1, ... (host overhead included: that is what CUDA graphs remove)."""
    device = loop.pos.device
    loop.pos.fill_(start)
    _sync(device)
    begin = time.perf_counter()
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        step()
    _sync(device)
    return time.perf_counter() - begin


def positive_int(text: str) -> int:
    """argparse type of the counts: an int >= 1 (0 or less would run the default steps, print
    negative tokens/s or crash inside the model)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer; got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--small", action="store_true", help="the tiny CPU config ('small' preset)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help="decode steps (default 64; 16 with --small)")
    parser.add_argument("--batch", type=positive_int, default=1)
    parser.add_argument("--prompt-len", type=positive_int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    steps = args.steps or (16 if args.small else 64)
    cfg = PRESETS["small" if args.small else "default"]
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    mode = "reduce-overhead" if on_gpu else "default"
    max_len = args.prompt_len + steps + 8  # a few spare positions for the timed runs

    print(f"device: {torch.cuda.get_device_name(device) if on_gpu else 'cpu'}, torch {torch.__version__}")
    print(f"model: {cfg}, batch {args.batch}, prompt {args.prompt_len}, {steps} decode steps")
    print(f"torch.compile mode={mode!r}" + ("" if on_gpu else " (CUDA graphs are GPU-only: 'default' on CPU)"))
    model = build_model(cfg, max_len, args.batch, device, args.seed)
    generator = torch.Generator(device="cpu").manual_seed(args.seed)
    prompt = torch.randint(0, cfg.vocab, (args.batch, args.prompt_len), generator=generator).to(device)

    reference, rows = None, []
    for name, config in VARIANTS.items():
        torch._dynamo.reset()  # one variant's graphs (and CUDA graphs) at a time
        loop = GreedyStep(model, args.batch)
        prefill, step = compile_variant(model, config, mode), compile_variant(loop, config, mode)
        begin = time.perf_counter()
        choices = greedy(prefill, step, loop, prompt, steps, forced=reference)  # compiles both
        _sync(device)
        compile_s = time.perf_counter() - begin
        if reference is None:
            reference = choices
        agreement = (choices == reference).float().mean().item()
        decode_seconds(step, loop, args.prompt_len, 4)  # warm: CUDA graphs recorded
        seconds = decode_seconds(step, loop, args.prompt_len, steps)
        rows.append((name, args.batch * steps / seconds, agreement, compile_s))

    print(f"\n{'variant':>12} {'tokens/s':>10} {'vs bf16':>8} {'agreement':>10} {'first call s':>13}")
    for name, rate, agreement, compile_s in rows:
        print(f"{name:>12} {rate:10.1f} {rate / rows[0][1]:7.2f}x {100 * agreement:9.1f}% {compile_s:13.1f}")
    print("(agreement: next-token choices equal to bf16's, teacher-forced on the bf16 tokens;"
          " first call: compile + prefill + the decode steps)")
    if not on_gpu:
        print("(on the CPU the nvfp4 ops run the pure-torch reference, which dequantizes the weights"
              " at every call: CPU tokens/s say nothing about NVFP4 speed)")


if __name__ == "__main__":
    main()

"""A small Llama-style decoder for the tensor-parallel tests (hidden 128, 2 layers): q / k / v /
o and gate / up / down projections with the names torch's tensor-parallel examples use, heads
counted from the local q / k widths (so that a column-parallel rank runs its own heads)."""

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 128, 2, 4, 2, 64, 256, 96


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=bias)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=bias)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=bias)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=bias)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, HEAD_DIM).transpose(1, 2)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))


class MLPBlock(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, MLP, bias=bias)
        self.up_proj = nn.Linear(HIDDEN, MLP, bias=bias)
        self.down_proj = nn.Linear(MLP, HIDDEN, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.self_attn, self.mlp = Attention(bias), MLPBlock(bias)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class TinyLlama(nn.Module):
    def __init__(self, bias: bool = False):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Layer(bias) for _ in range(LAYERS))
        self.norm = RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def build(seed: int = 0, bias: bool = False, dtype=torch.float32) -> TinyLlama:
    """The model with seeded random weights (norm weights too, biases non-zero)."""
    torch.manual_seed(seed)
    model = TinyLlama(bias)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.uniform_(0.8, 1.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.to(dtype).eval()


def plan(style_colwise, style_rowwise) -> dict:
    """The standard Llama plan: q / k / v, gate / up column-parallel, o / down row-parallel."""
    return {"layers.*.self_attn.q_proj": style_colwise(), "layers.*.self_attn.k_proj": style_colwise(),
            "layers.*.self_attn.v_proj": style_colwise(), "layers.*.self_attn.o_proj": style_rowwise(),
            "layers.*.mlp.gate_proj": style_colwise(), "layers.*.mlp.up_proj": style_colwise(),
            "layers.*.mlp.down_proj": style_rowwise()}

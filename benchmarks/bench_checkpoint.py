"""Loading an NVFP4 checkpoint on the CPU: time and peak host memory, against safetensors reading
the same files in the same run.

    python benchmarks/bench_checkpoint.py                # Llama-3-8B shapes, 32 layers, ModelOpt
    python benchmarks/bench_checkpoint.py --layers 2 --format compressed-tensors

Writes a checkpoint of random NVFP4 weights (codes, valid e4m3 block scales, global scales; bf16
embeddings, norms and head) in shards of about 5 GB to a temporary folder, then measures each
reader in a fresh process (peak RSS from getrusage, so each starts from nothing):

    safetensors   safetensors.torch.load_file on every shard (the floor: reading the bytes)
    load          nv.init_empty_weights + a transformers LlamaForCausalLM + nv.load_checkpoint

Both then touch every byte they hold (safetensors maps the files: untouched pages are not read).

Targets: load's peak memory <= 1.2x the checkpoint's size (no bf16 copy of quantized layers) and
its time <= 2x safetensors'. The model's construction on the meta device (transformers' own work,
before any file is read) is timed apart.
"""

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, rope_theta=500000.0)
SHARD_BYTES = 5 << 30


def write(path: Path, layers: int, fmt: str) -> int:
    """A random checkpoint in fmt; -> its bytes."""
    import transformers
    from safetensors.torch import save_file

    import nvfp4_inductor as nv

    config = transformers.LlamaConfig(**LLAMA3_8B, num_hidden_layers=layers)
    with nv.init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    shard, shards, size, total = {}, [], 0, 0

    def add(key, t):
        nonlocal size, shard, total
        shard[key] = t
        size += t.numel() * t.element_size()
        total += t.numel() * t.element_size()
        if size >= SHARD_BYTES:
            shards.append(shard)
            shard, size = {}, 0

    for name, p in model.named_parameters():
        layer = name.removesuffix(".weight")
        if p.dim() == 2 and "embed" not in name and "lm_head" not in name:
            n, k = p.shape
            codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
            scale = torch.randint(0x28, 0x60, (n, k // 16), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn)
            g = torch.tensor(1e-4)
            add(f"{layer}.{'weight' if fmt == 'modelopt' else 'weight_packed'}", codes)
            add(f"{layer}.weight_scale", scale)
            if fmt == "modelopt":
                add(f"{layer}.weight_scale_2", g)
            else:
                add(f"{layer}.weight_global_scale", (1 / g).reshape(1))
        else:
            add(name, torch.randn(p.shape, generator=gen).to(torch.bfloat16))
    shards.append(shard)
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(part, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if fmt == "modelopt":
        quant = {"quant_algo": "W4A16_NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}
        (path / "hf_quant_config.json").write_text(json.dumps({"quantization": quant}))
        entry = {"quant_method": "modelopt", **quant}
    else:
        args = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}
        entry = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "weights": args}}}
    (path / "config.json").write_text(json.dumps({**config.to_dict(), "quantization_config": entry}))
    return total


def measure(path: str, how: str, layers: int) -> None:
    """Run in a child process: one reader, then print its seconds and peak RSS as JSON."""
    from safetensors.torch import load_file

    if how == "load":  # (imports are not loading)
        import transformers

        import nvfp4_inductor as nv
    build = 0.0
    if how == "load":  # the model's construction (on the meta device) is timed apart
        start = time.perf_counter()
        config = transformers.LlamaConfig(**LLAMA3_8B, num_hidden_layers=layers)
        with nv.init_empty_weights():
            model = transformers.LlamaForCausalLM(config)
        build = time.perf_counter() - start
    start = time.perf_counter()
    if how == "safetensors":
        tensors = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            tensors.update(load_file(file))
    else:
        nv.load_checkpoint(model, path)
        tensors = model.state_dict()
    # safetensors maps the files: every byte is touched, so both have read what they hold
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8).max()
    seconds = time.perf_counter() - start
    print(json.dumps({"seconds": seconds, "build": build,
                      "peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--format", choices=("modelopt", "compressed-tensors"), default="modelopt")
    parser.add_argument("--measure", nargs=2, metavar=("PATH", "HOW"), help=argparse.SUPPRESS)
    parser.add_argument("--write", metavar="PATH", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        measure(*args.measure, args.layers)
        return
    if args.write:
        print(write(Path(args.write), args.layers, args.format))
        return
    import platform

    print(f"CPU: {platform.processor() or platform.machine()}, torch {torch.__version__}")
    with tempfile.TemporaryDirectory() as folder:
        # each step in a process of its own: a child's peak RSS starts from its parent's at fork
        size = int(subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--format", args.format,
                                   "--write", folder], capture_output=True, text=True, check=True
                                  ).stdout.strip().splitlines()[-1])
        print(f"checkpoint: Llama-3-8B shapes, {args.layers} layers, {args.format}, {size / 2**30:.2f} GiB")
        rows = {}
        for how in ("safetensors", "load"):
            out = subprocess.run([sys.executable, __file__, "--layers", str(args.layers), "--measure", folder, how],
                                 capture_output=True, text=True, check=True).stdout
            rows[how] = json.loads(out.strip().splitlines()[-1])
        print(f"\n{'reader':>12} {'seconds':>8} {'peak GiB':>9} {'peak / checkpoint':>18} {'model build s':>14}")
        for how, r in rows.items():
            print(f"{how:>12} {r['seconds']:8.2f} {r['peak_bytes'] / 2**30:9.2f} {r['peak_bytes'] / size:17.2f}x"
                  f" {r['build']:14.2f}")
        ratio = rows["load"]["seconds"] / rows["safetensors"]["seconds"]
        print(f"load time / safetensors time: {ratio:.2f}x (target <= 2x); "
              f"load peak / checkpoint: {rows['load']['peak_bytes'] / size:.2f}x (target <= 1.2x)")


if __name__ == "__main__":
    main()

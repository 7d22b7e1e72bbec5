"""Quantizing a Hugging Face model folder (`python -m nvfp4_inductor quantize`): input MB/s and
peak host memory against the largest input shard.

    python benchmarks/bench_quantize_model.py                       # Llama-3-8B shapes, 2 layers, rtn
    python benchmarks/bench_quantize_model.py --layers 32 --method mse --device cuda

Writes random bf16 weights of Llama-3-8B shapes (hidden 4096, MLP 14336, 32 / 8 heads, vocab
128256, untied head) as Hugging Face shards of about --shard-gb with a config.json to a temporary
folder, then runs the command in a child process (its own peak RSS from wait4, started from a
parent that holds almost nothing) and reports:

    wall        the child's wall time (Python start, transformers import, compile included)
    stream      the command's own streaming time (reading, quantizing and writing the shards)
    MB/s        bf16 input bytes over each
    peak RSS    the child's, and its ratio to the largest input shard (target <= 1.5x)

Targets: >= 100 MB/s of bf16 input with rtn on a 2-core CPU; >= 1 GB/s with mse on an H100 /
H200. The floor is reading the input and writing about 0.28x of it back.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                 num_key_value_heads=8, rope_theta=500000.0, tie_word_embeddings=False)


def write(path: Path, layers: int, shard_bytes: int) -> list[int]:
    """Random bf16 Llama-3-8B-shaped weights as Hugging Face shards; -> each shard's bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    import nvfp4_inductor as nv

    config = transformers.LlamaConfig(**LLAMA3_8B, num_hidden_layers=layers, dtype="bfloat16")
    with nv.init_empty_weights():
        model = transformers.LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    parts, part, size = [], {}, 0
    for name, p in model.named_parameters():
        t = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16) if p.dim() == 2 else \
            torch.ones(p.shape, dtype=torch.bfloat16)
        if part and size + t.nbytes > shard_bytes:
            parts.append(part)
            part, size = {}, 0
        part[name] = t
        size += t.nbytes
    parts.append(part)
    weight_map, sizes = {}, []
    for i, tensors in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors"
        save_file(tensors, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        sizes.append(sum(t.nbytes for t in tensors.values()))
    parts.clear()
    index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    config.save_pretrained(path)
    return sizes


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--method", default="rtn", choices=("rtn", "mse"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--format", default="modelopt", choices=("modelopt", "compressed-tensors"))
    parser.add_argument("--shard-gb", type=float, default=2.0, help="input shard size (default 2 GB)")
    parser.add_argument("--write-to", help=argparse.SUPPRESS)  # (the child that writes the input)
    args = parser.parse_args()
    if args.write_to:
        import torch
        import triton

        device = torch.cuda.get_device_name() if args.device == "cuda" else \
            f"{cpu_name()}, {torch.get_num_threads()} threads"
        print(f"torch {torch.__version__}, triton {triton.__version__}, device: {device}", file=sys.stderr)
        print(json.dumps(write(Path(args.write_to), args.layers, int(args.shard_gb * 1e9))))
        return
    # This process stays small and reads each child's own peak (os.wait4): a child's peak RSS
    # counts its parent's memory at the time it was started.
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "src", Path(tmp) / "dst"
        src.mkdir()
        made = subprocess.run([sys.executable, __file__, "--write-to", str(src), "--layers", str(args.layers),
                               "--shard-gb", str(args.shard_gb), "--device", args.device],
                              stdout=subprocess.PIPE, text=True, check=True)
        sizes = json.loads(made.stdout)
        total = sum(sizes)
        command = [sys.executable, "-m", "nvfp4_inductor", "quantize", str(src), str(dst), "--device", args.device,
                   "--weight-method", args.method, "--format", args.format]
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        start = time.perf_counter()
        with open(out, "w") as stdout_file, open(err, "w") as stderr_file:
            child = subprocess.Popen(command, stdout=stdout_file, stderr=stderr_file, cwd=Path(__file__).parents[1])
            _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - start
        peak = usage.ru_maxrss * 1024
        stdout = out.read_text()
        if os.waitstatus_to_exitcode(status):
            sys.exit(f"quantize failed ({os.waitstatus_to_exitcode(status)}):\n{stdout}\n{err.read_text()[-4000:]}")
        found = re.search(r"in ([\d.]+) s", stdout)
        stream = float(found.group(1)) if found else float("nan")
        written = sum(f.stat().st_size for f in dst.glob("*.safetensors"))
    largest = max(sizes)
    print(f"Llama-3-8B shapes, {args.layers} layers, {len(sizes)} input shards (largest {largest / 1e9:.2f} GB), "
          f"{args.format}, method {args.method}, --device {args.device}")
    print("| input GB | output GB | wall s | wall MB/s | stream s | stream MB/s | peak RSS GB | RSS / largest shard |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(f"| {total / 1e9:.2f} | {written / 1e9:.2f} | {wall:.1f} | {total / wall / 1e6:.0f} | {stream:.1f} | "
          f"{total / stream / 1e6:.0f} | {peak / 1e9:.2f} | {peak / largest:.2f}x (target <= 1.5x) |")


if __name__ == "__main__":
    main()

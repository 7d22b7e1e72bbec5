"""Quickstart: quantize a tensor and a small MLP's linear weights to NVFP4.

Prints the error against bf16 (SQNR in dB: higher is better, ~20 dB is typical for NVFP4 on
Gaussian data) and the bytes saved; on a GPU, also the time of quantize and linear.

    python examples/quickstart.py
"""

import torch
from torch import nn

import nvfp4_inductor as nv


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    ref, approx = ref.double(), approx.double()
    return (10 * torch.log10(ref.pow(2).sum() / (ref - approx).pow(2).sum())).item()


def nbytes(q: nv.NVFP4) -> int:
    return sum(t.numel() * t.element_size() for t in (q.data, q.scale, q.global_scale))


def median_ms(fn, reps: int = 20) -> float:
    """Median CUDA-event time of fn() in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    print(f"device: {device}, torch {torch.__version__}")

    # 1. One tensor.
    x = torch.randn(2048, 2048, dtype=torch.bfloat16, device=device)
    q = nv.quantize(x)
    print(f"\ntensor {tuple(x.shape)} bf16 -> NVFP4")
    print(f"  SQNR of dequantize(quantize(x)) vs x: {sqnr_db(x, q.dequantize()):.2f} dB")
    bf16_bytes = x.numel() * x.element_size()
    print(f"  bytes: bf16 {bf16_bytes:,} -> NVFP4 {nbytes(q):,} ({bf16_bytes / nbytes(q):.2f}x smaller)")

    # 2. A small MLP's linear weights.
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))
    model = model.to(device=device, dtype=torch.bfloat16).eval()
    inputs = torch.randn(64, 1024, dtype=torch.bfloat16, device=device)
    weights = [nv.quantize(layer.weight.detach()) for layer in (model[0], model[2])]

    def nvfp4_mlp(h: torch.Tensor, activation: str) -> torch.Tensor:
        h = nv.linear(h, weights[0], model[0].bias, activations=activation)
        return nv.linear(torch.nn.functional.gelu(h), weights[1], model[2].bias, activations=activation)

    with torch.no_grad():
        ref = model(inputs)
        print("\nMLP 1024 -> 4096 -> 1024, 64 tokens")
        for layer, w_q in zip((model[0], model[2]), weights):
            print(f"  weight {tuple(layer.weight.shape)}: SQNR {sqnr_db(layer.weight, w_q.dequantize()):.2f} dB")
        for activation, name in (("bf16", "W4A16"), ("nvfp4", "W4A4")):
            print(f"  output {name} vs bf16: SQNR {sqnr_db(ref, nvfp4_mlp(inputs, activation)):.2f} dB")
        w_bf16 = sum(layer.weight.numel() * 2 for layer in (model[0], model[2]))
        w_nvfp4 = sum(nbytes(w_q) for w_q in weights)
        print(f"  weight bytes: bf16 {w_bf16:,} -> NVFP4 {w_nvfp4:,} (saved {w_bf16 - w_nvfp4:,})")

        if device == "cuda":
            print(f"\ntimes on {torch.cuda.get_device_name()} (median of 20)")
            print(f"  quantize 2048x2048:        {median_ms(lambda: nv.quantize(x)):.3f} ms")
            print(f"  MLP bf16 (nn.Linear):      {median_ms(lambda: model(inputs)):.3f} ms")
            print(f"  MLP NVFP4 W4A16:           {median_ms(lambda: nvfp4_mlp(inputs, 'bf16')):.3f} ms")


if __name__ == "__main__":
    main()

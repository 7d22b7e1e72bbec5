"""Tensor parallelism (nvfp4_inductor.parallel) on the CPU: 2 processes over gloo, the reference
kernels, a small Llama-style model (tests/helpers/tp_model.py) sharded with the standard plan
(q / k / v, gate / up column-parallel; o / down row-parallel). The processes are spawned once
for the module (tests/helpers/tp_worker.py runs every check); the tests read their results.

Tolerances: a share's codes and scales are exactly the slice of the unsharded quantization (a
test), so the sharded fp32 model differs from the single-process one only in how its fp32 sums
are ordered (the row-parallel GEMM sums K/2 products per rank, then the all-reduce adds the two
partial sums; the bias is a separate add): a few fp32 roundings per output, through 2 layers,
< 2e-5 of the largest logit. In bf16 each rank's partial product is rounded to bf16 before the
all-reduce (as the bf16 model's row-parallel linears do): a bf16 rounding (2^-9 relative) per
row-parallel layer, < 2e-2 of the largest logit.
"""

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from helpers import tp_worker

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Each rank's results of tp_worker.checks."""
    tmp = str(tmp_path_factory.mktemp("tp"))
    mp.spawn(tp_worker.run, args=(tmp,), nprocs=tp_worker.WORLD, join=True)
    found = []
    for rank in range(tp_worker.WORLD):
        with open(os.path.join(tmp, f"results_{rank}.json")) as file:
            found.append(json.load(file))
        assert "crash" not in found[-1], found[-1].get("crash")
    return found


@pytest.mark.parametrize("bias", [False, True])
def test_sharded_matches_single_process(results, bias):
    for rank in results:
        r = rank[f"fp32 bias={bias}"]
        assert r["shares"] == 14  # 7 linears x 2 layers
        assert r["rel"] < 2e-5, r
        # converted then sharded, or sharded in bf16 then converted: the same shares
        assert r["sharded_first_layers"] == 14 and r["kinds"] == ["Linear", "NVFP4LinearShard"], r
        assert r["same_both_orders"], r
        assert r["sharded_first_rel"] < 2e-5, r


def test_bf16_all_reduce(results):
    for rank in results:
        assert rank["bf16"]["dtype"] == "torch.bfloat16"
        assert rank["bf16"]["rel"] < 2e-2, rank["bf16"]


def test_shares_are_slices_of_the_whole_quantization(results):
    for rank in results:
        assert all(rank["state_dict"].values()), rank["state_dict"]


@pytest.mark.parametrize("case, error, words", [
    ("odd_colwise", "ValueError", ["layer '0'", "ColwiseParallel over 2 ranks", "out_features", "96", "128"]),
    ("odd_rowwise", "ValueError", ["layer '1'", "RowwiseParallel over 2 ranks", "in_features", "96", "128"]),
    ("twice", "ValueError", ["layer 'layers.0.mlp.up_proj'", "sharded already"]),
    ("odd_bf16_then_convert", "ValueError", ["RowwiseParallel over 2 ranks", "in_features", "96"]),
    ("torch_style_on_nvfp4", "NotImplementedError", ["nn.Linear"]),
    ("compile_sharded_bf16", "ValueError", ["layers.0.self_attn.q_proj.weight", "tensor-parallel", "convert"]),
    ("save_sharded", "ValueError", ["save_checkpoint", "layers.0.self_attn.q_proj", "tensor-parallel shares"]),
    ("from_linear_sharded", "TypeError", ["DTensor", "shard_from_linear", "nv.convert"]),
])
def test_bad_shardings_refused(results, case, error, words):
    for rank in results:
        message = rank[f"refused {case}"]
        assert message.startswith(error) or f"{error}:" in message, message
        for word in words:
            assert word in message, message


def test_checkpoint_loads_each_rank_share(results):
    for rank in results:
        r = rank["checkpoint"]
        assert r["layers"] == 14 and r["shares"] == 14, r
        assert r["codes_read_whole"] == [], r  # codes and block scales only through get_slice
        assert r["equal"], r  # the same shares as converting the whole model, then sharding it
        assert r["rel"] < 2e-5, r


def test_compiled_with_nvfp4_backend(results):
    for rank in results:
        assert rank["compiled"]["rel"] < 2e-5, rank["compiled"]
        assert rank["compiled"]["rel_single"] < 2e-5, rank["compiled"]

"""The tensor-parallel checks, run by each of 2 gloo processes (tests/test_tensor_parallel.py
spawns them once: starting the processes and importing torch in each is most of the cost). Every
check stores what the test asserts in results[name]; each rank writes its results as JSON."""

import json
import os
import traceback

import torch
import torch.distributed as dist

from helpers import tp_model

WORLD = 2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _error(fn) -> str:
    try:
        fn()
    except Exception as error:  # noqa: BLE001  (the test checks the type and the message)
        return f"{type(error).__name__}: {error}"
    return "no error"


def checks(rank: int, tmp: str) -> dict:
    from safetensors import safe_open
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import parallel as torch_tp
    from torch.distributed.tensor.parallel import parallelize_module

    import nvfp4_inductor as nv
    from nvfp4_inductor import parallel as nvp

    mesh = init_device_mesh("cpu", (WORLD,))
    config = nv.Config(activations="bf16")
    nv_plan = tp_model.plan(nvp.ColwiseParallel, nvp.RowwiseParallel)
    torch_plan = tp_model.plan(torch_tp.ColwiseParallel, torch_tp.RowwiseParallel)
    tokens = torch.randint(0, tp_model.VOCAB, (2, 7), generator=torch.Generator().manual_seed(1))
    results = {}

    def single(bias, dtype=torch.float32):
        model = tp_model.build(bias=bias, dtype=dtype)
        nv.convert(model, config)
        return model

    with torch.no_grad():
        for bias in (False, True):
            want = single(bias)(tokens)
            converted = single(bias)
            parallelize_module(converted, mesh, nv_plan)
            got = converted(tokens)
            sharded = tp_model.build(bias=bias)
            parallelize_module(sharded, mesh, torch_plan)
            report = nv.convert(sharded, config)
            got_sharded_first = sharded(tokens)
            shares = [m for m in converted.modules() if isinstance(m, nvp.NVFP4LinearShard)]
            results[f"fp32 bias={bias}"] = {
                "rel": _rel(got, want), "sharded_first_rel": _rel(got_sharded_first, want),
                "same_both_orders": torch.equal(got, got_sharded_first), "shares": len(shares),
                "sharded_first_layers": report.layers,
                "kinds": sorted({type(m).__name__ for m in sharded.modules() if "Linear" in type(m).__name__})}

        # bf16: the partial products rounded to bf16 and all-reduced in bf16, as the bf16 model's
        want = single(True, torch.bfloat16)(tokens)
        converted = single(True, torch.bfloat16)
        parallelize_module(converted, mesh, nv_plan)
        results["bf16"] = {"rel": _rel(converted(tokens), want), "dtype": str(converted(tokens).dtype)}

        # a share's state dict: its rows / columns of the whole layer's, the whole global scale
        whole = single(True, torch.bfloat16).state_dict()
        share = converted.state_dict()
        q, o = "layers.0.self_attn.q_proj.", "layers.0.self_attn.o_proj."
        n, k = whole[q + "weight"].shape[0] // WORLD, whole[o + "weight"].shape[1] * 2 // WORLD  # rows, K elements
        rows, cols = slice(rank * n, (rank + 1) * n), slice(rank * k, (rank + 1) * k)
        results["state_dict"] = {
            "colwise_codes": torch.equal(share[q + "weight"], whole[q + "weight"][rows]),
            "colwise_scales": torch.equal(share[q + "weight_scale"].view(torch.uint8),
                                          whole[q + "weight_scale"].view(torch.uint8)[rows]),
            "colwise_bias": torch.equal(share[q + "bias"].float(), whole[q + "bias"][rows].float()),
            "rowwise_codes": torch.equal(share[o + "weight"], whole[o + "weight"][:, cols.start // 2: cols.stop // 2]),
            "rowwise_scales": torch.equal(share[o + "weight_scale"].view(torch.uint8),
                                          whole[o + "weight_scale"].view(torch.uint8)[:, cols.start // 16: cols.stop // 16]),
            "rowwise_bias": torch.equal(share[o + "bias"].float(), whole[o + "bias"].float()),
            "global_scale": torch.equal(share[o + "weight_scale_2"], whole[o + "weight_scale_2"])}

    # shardings refused
    def odd_colwise():
        model = nn.Sequential(nn.Linear(128, 96), nn.Linear(96, 128))
        nv.convert(model, config)
        parallelize_module(model, mesh, {"0": nvp.ColwiseParallel()})

    def odd_rowwise():
        model = nn.Sequential(nn.Linear(128, 128), nn.Linear(96, 128))
        nv.convert(model, config)
        parallelize_module(model, mesh, {"1": nvp.RowwiseParallel()})

    def twice():
        model = single(False)
        parallelize_module(model, mesh, nv_plan)
        parallelize_module(model, mesh, {"layers.0.mlp.up_proj": nvp.ColwiseParallel()})

    def odd_bf16_then_convert():
        model = nn.Sequential(nn.Linear(128, 96), nn.Linear(96, 128))
        parallelize_module(model, mesh, {"1": torch_tp.RowwiseParallel()})
        nv.convert(model, config)

    def torch_style_on_nvfp4():
        parallelize_module(single(False), mesh, torch_plan)

    def compile_sharded_bf16():
        model = tp_model.build()
        parallelize_module(model, mesh, torch_plan)
        torch._dynamo.reset()
        nv.compile(model, config)(tokens)

    def from_linear_sharded():
        model = nn.Sequential(nn.Linear(128, 128))
        parallelize_module(model, mesh, {"0": torch_tp.ColwiseParallel()})
        nv.NVFP4Linear.from_linear(model[0], "bf16")

    def save_sharded():
        model = single(False)
        parallelize_module(model, mesh, nv_plan)
        nv.save_checkpoint(model, os.path.join(tmp, f"sharded_{rank}"))

    for name, fn in (("odd_colwise", odd_colwise), ("odd_rowwise", odd_rowwise), ("twice", twice),
                     ("odd_bf16_then_convert", odd_bf16_then_convert),
                     ("torch_style_on_nvfp4", torch_style_on_nvfp4), ("compile_sharded_bf16", compile_sharded_bf16),
                     ("save_sharded", save_sharded), ("from_linear_sharded", from_linear_sharded)):
        results[f"refused {name}"] = _error(fn)

    # a checkpoint loaded straight into the sharded model, each rank reading its share
    path = os.path.join(tmp, "checkpoint")
    reference = single(True)
    if rank == 0:
        nv.save_checkpoint(reference, path)
    dist.barrier()
    read_whole = []
    real_safe_open = safe_open

    class Spy:
        """safe_open that records the tensors read whole (get_tensor)."""

        def __init__(self, *args, **kwargs):
            self.handle = real_safe_open(*args, **kwargs)

        def get_tensor(self, key):
            read_whole.append(key)
            return self.handle.get_tensor(key)

        def __getattr__(self, name):
            return getattr(self.handle, name)

    import safetensors

    safetensors.safe_open = Spy
    try:
        with nv.init_empty_weights():
            empty = tp_model.TinyLlama(bias=True)
        report = nvp.load_sharded_checkpoint(empty, path, mesh, nv_plan)
    finally:
        safetensors.safe_open = real_safe_open
    with torch.no_grad():
        converted = single(True)
        parallelize_module(converted, mesh, nv_plan)
        want_sharded = converted(tokens)
        results["checkpoint"] = {
            "layers": report.layers, "equal": torch.equal(empty(tokens), want_sharded),
            "rel": _rel(empty(tokens), reference(tokens)),
            "codes_read_whole": [key for key in read_whole if key.endswith((".weight_scale", "proj.weight"))],
            "shares": sum(isinstance(m, nvp.NVFP4LinearShard) for m in empty.modules())}
    dist.barrier()

    # compiled with backend="nvfp4": the converted sharded model (the all-reduce in the graph)
    torch._dynamo.reset()
    with torch.no_grad():
        want = converted(tokens)
        got = nv.compile(converted, config, fullgraph=True)(tokens)
    results["compiled"] = {"rel": _rel(got, want), "rel_single": _rel(got, reference(tokens))}
    return results


def run(rank: int, tmp: str) -> None:
    """One process of the mp.spawn: gloo over an init file; results -> tmp/results_{rank}.json."""
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'init')}", rank=rank,
                            world_size=WORLD)
    try:
        results = checks(rank, tmp)
    except Exception:  # noqa: BLE001  (reported to the test, which fails with it)
        results = {"crash": traceback.format_exc()}
    with open(os.path.join(tmp, f"results_{rank}.json"), "w") as file:
        json.dump(results, file)
    dist.destroy_process_group()

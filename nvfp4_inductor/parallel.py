"""Tensor parallelism for NVFP4 layers, with torch.distributed.tensor.parallel's plans.

    from nvfp4_inductor.parallel import ColwiseParallel, RowwiseParallel
    parallelize_module(model, mesh, {"q_proj": ColwiseParallel(), "o_proj": RowwiseParallel(), ...})

torch's ColwiseParallel / RowwiseParallel shard `nn.Linear` only (an NVFP4Linear, whose weight is
a set of buffers, is refused with NotImplementedError). The two classes here are those plans
(subclasses: an nn.Linear or nn.Embedding goes to torch's code unchanged) that also shard an
NVFP4Linear, in place (parallelize_module keeps the module objects it is given): the layer keeps
its LOCAL share as an ordinary NVFP4Linear would (tiled codes and scales, plain tensors), and
becomes an NVFP4LinearShard, whose call follows the contract of a sharded nn.Linear under those
plans: the plan's own input hook hands it x as a DTensor in the layout it needs, it returns its
output as a DTensor (column-parallel: Shard(-1); row-parallel: Partial, the partial products of
its K-slice), and the plan's output hook redistributes that (row-parallel: the all-reduce, in the
output's dtype, as for the bf16 model). So the same layer also results from `nv.convert` on a
model sharded in bf16 first (its nn.Linear weights DTensors, the plan's hooks carried over).

    column-parallel (Shard(0)): rank r holds output rows [r N/P, (r+1) N/P): N/P a multiple of TILE_N
    row-parallel (Shard(1)):    rank r holds input columns [r K/P, (r+1) K/P): K/P a multiple of TILE_K

Whole tiles keep the tiled layout of each share the tiling of its own (N/P, K) or (N, K/P) weight
and whole 16-element blocks (TILE_K = 4 blocks) keep every block scale as the unsharded weight
has it. Every share keeps the global scale of the WHOLE weight (amax all-reduced where a share is
quantized from bf16), so a share's codes and scales are exactly the slice of the unsharded
quantization: outputs equal the single-process model's up to the all-reduce's summation order,
and a checkpoint's tensors keep their meaning. A row-parallel bias is added once, on mesh rank 0's
partial product, before the all-reduce.
"""

from fnmatch import fnmatchcase
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DeviceMesh
from torch.distributed.tensor.parallel import style as _torch_style

from nvfp4_inductor import api
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.io import checkpoint as ck
from nvfp4_inductor.modules.common import replace_module
from nvfp4_inductor.modules.convert import ConversionReport
from nvfp4_inductor.modules.linear import NVFP4Linear
from nvfp4_inductor.modules.sharded import (COLWISE, ROWWISE, ColwiseParallel, NVFP4LinearShard, RowwiseParallel,
                                            become_shard, install_plan_hooks, mesh_position,
                                            share_length, shard_from_linear)

__all__ = ["ColwiseParallel", "RowwiseParallel", "NVFP4LinearShard", "shard_from_linear", "load_sharded_checkpoint"]


def _plan_styles(model: nn.Module, plan: dict) -> dict:
    """{module path: style} for the modules plan's keys name (fnmatch per dotted component, as
    parallelize_module resolves them)."""
    if not isinstance(plan, dict):
        raise TypeError(f"plan must be a dict of module path -> ColwiseParallel / RowwiseParallel; got {type(plan).__name__}")
    styles = {}
    for name, _ in model.named_modules():
        parts = name.split(".")
        for key, style in plan.items():
            tokens = key.split(".")
            if name and len(tokens) == len(parts) and all(map(fnmatchcase, parts, tokens)):
                styles[name] = style
    return styles


def _style_dim(style, who: str) -> int:
    if isinstance(style, _torch_style.ColwiseParallel):
        return COLWISE
    if isinstance(style, _torch_style.RowwiseParallel):
        return ROWWISE
    raise ValueError(f"{who}: an NVFP4 layer is sharded by ColwiseParallel or RowwiseParallel; the plan gives "
                     f"{type(style).__name__}")


def _read_share(handle, key: str, shape: tuple, dtypes: tuple, rows: slice, cols: slice) -> torch.Tensor:
    """rows x cols of the checkpoint tensor key (whole shape `shape`, a safetensors dtype of
    dtypes), reading only those bytes."""
    view = handle.get_slice(key)
    if tuple(view.get_shape()) != shape:
        raise ValueError(f"{key} has shape {tuple(view.get_shape())}; the model's layer needs {shape}")
    if view.get_dtype() not in dtypes:
        raise TypeError(f"{key} is stored as {view.get_dtype()}; NVFP4 reads {' or '.join(dtypes)}")
    return view[rows, cols]


def load_sharded_checkpoint(model: nn.Module, path, device_mesh: DeviceMesh, plan: dict):
    """nvfp4_inductor.load_checkpoint for a tensor-parallel model, each rank reading its share only.

    model: the unsharded model (on the meta device from init_empty_weights, or not); plan: the
    parallelize_module plan ({module path or glob: ColwiseParallel() / RowwiseParallel()}, these
    or torch's). Each checkpoint NVFP4 layer the plan shards becomes this rank's NVFP4LinearShard,
    built from its rows (column-parallel) or columns (row-parallel) of the stored codes and scales
    (safetensors get_slice); the other tensors are read whole and the plan's other entries applied
    with parallelize_module. -> the ConversionReport of the NVFP4 layers."""
    path = Path(path)
    rank, size = mesh_position(device_mesh, f"load_sharded_checkpoint({str(path)!r})")
    spec = ck.quantization(path)
    fmt, w4a4, excluded = spec.format, spec.w4a4, spec.excluded
    handles = {}
    for file in ck.safetensors_files(path):
        handle = safe_open(str(file), framework="pt")
        handles.update(dict.fromkeys(handle.keys(), handle))
    codes_sfx, scale_sfx, g_sfx, x_sfx = ck.SUFFIXES[fmt]
    quantized = sorted(key[:-len(g_sfx) - 1] for key in handles if key.endswith("." + g_sfx))
    modules, styles = dict(model.named_modules()), _plan_styles(model, plan)
    layers = {}
    for name in quantized:
        linear, who = modules.get(name), f"layer {name!r}"
        if not isinstance(linear, nn.Linear) or excluded(name):
            raise ValueError(f"the checkpoint quantizes {name!r}, which is not an nn.Linear of the model or "
                             "which its config excludes")
        n, k = linear.out_features, linear.in_features
        dim = _style_dim(styles[name], who) if name in styles else None
        share = n if dim is None else share_length(dim, n, k, size, f"{who} ({k} -> {n})")
        lo, hi = (0, share) if dim is None else (rank * share, (rank + 1) * share)
        rows, cols = (slice(lo, hi), slice(None)) if dim != ROWWISE else (slice(None), slice(lo, hi))
        byte_cols = cols if dim != ROWWISE else slice(lo // 2, hi // 2)
        block_cols = cols if dim != ROWWISE else slice(lo // BLOCK_SIZE, hi // BLOCK_SIZE)
        key = f"{name}."
        codes = _read_share(handles[key + codes_sfx], key + codes_sfx, (n, k // 2), ("U8",), rows, byte_cols)
        scale = _read_share(handles[key + scale_sfx], key + scale_sfx, (n, k // BLOCK_SIZE), ("F8_E4M3", "U8"),
                            rows, block_cols)
        g = ck.stored_global_scale(key + g_sfx, handles[key + g_sfx].get_tensor(key + g_sfx), fmt)
        x_key = key + x_sfx
        input_scale = (ck.stored_global_scale(x_key, handles[x_key].get_tensor(x_key), fmt)
                       if w4a4 and x_key in handles else None)
        bias = handles[key + "bias"].get_slice(key + "bias")[rows if dim == COLWISE else slice(None)] \
            if key + "bias" in handles else None
        if (bias is None) != (linear.bias is None):
            raise ValueError(f"{who}: the checkpoint {'lacks' if bias is None else 'has'} a bias the model's "
                             f"layer {'has' if bias is None else 'lacks'}")
        if bias is not None and linear.bias.dtype.is_floating_point:
            bias = bias.to(linear.bias.dtype)
        local_shape = torch.Size((codes.shape[0], codes.shape[1] * 2))
        weight = api.NVFP4(codes, scale.view(torch.float8_e4m3fn), g, local_shape, False)
        layer = NVFP4Linear(weight, bias if dim != ROWWISE else None, "nvfp4" if w4a4 else "bf16", input_scale)
        if dim is not None:
            layer = become_shard(layer, device_mesh, dim, n, k, bias if dim == ROWWISE else None)
        layers[name] = layer
    prefixes = tuple(f"{name}." for name in quantized)
    expected = model.state_dict(keep_vars=True)
    rest = {key: handles[key].get_tensor(key) for key in handles if not key.startswith(prefixes)}
    unexpected = [key for key in rest if key not in expected]
    loaded = {id(expected[key]) for key in rest if key in expected}
    missing = [key for key, t in expected.items()
               if key not in rest and not key.startswith(prefixes) and id(t) not in loaded]
    if unexpected or missing:
        raise ValueError(f"the checkpoint and the model differ: tensors the model lacks {unexpected[:8]}, "
                         f"tensors the checkpoint lacks {missing[:8]}")
    meta = any(t.device.type == "meta" for t in expected.values())
    model.load_state_dict(rest, strict=False, assign=meta)
    report = ConversionReport()
    for name, layer in layers.items():
        old = modules[name]
        layer.to(old.weight.device if old.weight.device.type != "meta" else "cpu")
        replace_module(model, name, old, layer)  # (which gives it old's hooks: the plan's come after)
        if isinstance(layer, NVFP4LinearShard):
            install_plan_hooks(layer, styles[name], device_mesh)
        report.converted.append(name)
        report.layers += 1
    from torch.distributed.tensor.parallel import parallelize_module

    for name, style in styles.items():
        if name not in layers:  # every rank holds the whole tensors: no scatter from a source rank
            parallelize_module(model.get_submodule(name), device_mesh, style, src_data_rank=None)
    return report

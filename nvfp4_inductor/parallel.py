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

import sys
from fnmatch import fnmatchcase
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import style as _torch_style

from . import api
from .convert import NVFP4Linear
from .format import BLOCK_SIZE
from .reference import finite_amax, global_scale_from_amax
from .tiled import TILE_K, TILE_N

__all__ = ["ColwiseParallel", "RowwiseParallel", "NVFP4LinearShard", "shard_from_linear", "load_sharded_checkpoint"]

COLWISE, ROWWISE = 0, 1  # the weight dimension a style splits: N (rows of W) or K (its columns)
_STYLE_NAMES = {COLWISE: "ColwiseParallel", ROWWISE: "RowwiseParallel"}
_TILE = {COLWISE: TILE_N, ROWWISE: TILE_K}


class NVFP4LinearShard(NVFP4Linear):
    """One rank's share of a tensor-parallel NVFP4Linear: in_features / out_features and the
    buffers are the local ones; full_in_features / full_out_features, tp_dim (0: column-parallel,
    1: row-parallel), tp_rank, tp_size and device_mesh describe the whole layer. x (a DTensor from
    the plan's input hook, or its local tensor) -> the local GEMM -> a DTensor: Shard(-1)
    (column-parallel) or Partial (row-parallel, the bias in rank 0's share). Its state dict holds
    the local share, in the interchange layout (a row-parallel bias under `bias`, whole)."""

    def forward(self, x: torch.Tensor):
        if isinstance(x, DTensor):
            x = x.to_local()  # the plan's input hook gave it the layout this share reads
        if x.shape[-1] != self.in_features:
            raise ValueError(f"{_describe(self)}: x has {x.shape[-1]} features in its last dimension; this "
                             f"rank's share reads {self.in_features} (did the plan's input hook run?)")
        y = super().forward(x)
        if self.tp_dim == COLWISE:
            return DTensor.from_local(y, self.device_mesh, [Shard(-1)], run_check=False)
        if self.partial_bias is not None and self.tp_rank == 0:
            y = y + self.partial_bias.to(y.dtype)
        return DTensor.from_local(y, self.device_mesh, [Partial()], run_check=False)

    # A row-parallel bias is held as partial_bias (the GEMM of every rank must run without it)
    # and saved and loaded under the nn.Linear name.
    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if prefix + "partial_bias" in destination:
            destination[prefix + "bias"] = destination.pop(prefix + "partial_bias")

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        if self.tp_dim == ROWWISE and self.partial_bias is not None and prefix + "bias" in state_dict:
            state_dict[prefix + "partial_bias"] = state_dict.pop(prefix + "bias")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, {_STYLE_NAMES[self.tp_dim]} share {self.tp_rank} of "
                f"{self.tp_size} (whole layer {self.full_in_features} -> {self.full_out_features})")


def _describe(module: nn.Module, name: str | None = None) -> str:
    shape = (f"{getattr(module, 'full_in_features', module.in_features)} -> "
             f"{getattr(module, 'full_out_features', module.out_features)}")
    return f"layer {name!r} ({shape})" if name else f"{type(module).__name__} ({shape})"


def _plan_path() -> str | None:
    """The module path parallelize_module is applying a style to, for error messages (torch does
    not pass it to the style): the child names its recursive calls are iterating over."""
    from torch.distributed.tensor.parallel import api as _torch_api

    frame, names, code = sys._getframe(1), [], _torch_api.parallelize_module.__code__
    while frame is not None:
        if frame.f_code is code and isinstance(frame.f_locals.get("_"), str) and "module_path" in frame.f_locals:
            names.append(frame.f_locals["_"])
        frame = frame.f_back
    return ".".join(reversed(names)) or None


def _mesh_position(mesh: DeviceMesh, what: str) -> tuple[int, int]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: device_mesh must be a torch.distributed.DeviceMesh; got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{what}: tensor parallelism takes a 1-D DeviceMesh (slice a N-D mesh, e.g. "
                         f"mesh['tp']); got a {mesh.ndim}-D mesh")
    return mesh.get_local_rank(), mesh.size()


def _share(dim: int, n: int, k: int, size: int, who: str) -> int:
    """The length of each rank's share of N (dim 0) or K (dim 1), checked: whole tiles."""
    full = (n, k)[dim]
    tile = _TILE[dim]
    if full % (size * tile):
        feature = ("out_features (N, the rows of W)", "in_features (K, the columns of W)")[dim]
        raise ValueError(f"{who}: {_STYLE_NAMES[dim]} over {size} ranks splits {feature} = {full} into "
                         f"{full / size:g} a rank; each rank's share must be a whole number of "
                         f"{tile}-wide NVFP4 tiles, so {feature} must be a multiple of {size} x {tile} = "
                         f"{size * tile}")
    return full // size


def _become_shard(module: NVFP4Linear, mesh: DeviceMesh, dim: int, n: int, k: int,
                  row_bias: torch.Tensor | None) -> NVFP4LinearShard:
    """module, holding its local share already, -> that module as an NVFP4LinearShard (in place)."""
    rank, size = _mesh_position(mesh, "NVFP4 tensor parallelism")
    module.__class__ = NVFP4LinearShard  # in place: parallelize_module keeps the module it is given
    module.full_out_features, module.full_in_features = n, k
    module.tp_dim, module.tp_rank, module.tp_size, module.device_mesh = dim, rank, size, mesh
    module.register_parameter("partial_bias", None)
    if row_bias is not None:
        module.bias = None
        module.partial_bias = nn.Parameter(row_bias.detach(), requires_grad=row_bias.requires_grad)
    return module


def _local_slice(module: NVFP4Linear, dim: int, rank: int, share: int):
    """The plain codes (N', K'/2), scale bits (N', K'/16) and bias of rank's share of module."""
    data, scale = module.plain_weight()
    scale = scale.view(torch.uint8)
    lo, hi = rank * share, (rank + 1) * share
    if dim == COLWISE:
        bias = None if module.bias is None else module.bias.detach()[lo:hi]
        return data[lo:hi], scale[lo:hi], bias
    return data[:, lo // 2: hi // 2], scale[:, lo // BLOCK_SIZE: hi // BLOCK_SIZE], None


def _broadcast_layer(module: NVFP4Linear, mesh: DeviceMesh, src: int) -> None:
    """Every rank's module gets mesh rank src's NVFP4 tensors and bias (torch's plans likewise
    distribute the src rank's weights: src_data_rank)."""
    group, src_global = mesh.get_group(), mesh.mesh.flatten()[src].item()
    tensors = [module.weight, module.weight_scale, module.weight_scale_2]
    tensors += [t for t in (module.input_scale, module.bias) if t is not None]
    with torch.no_grad():
        for t in tensors:
            dist.broadcast(t.data, src=src_global, group=group)


def _shard_nvfp4(style, module: NVFP4Linear, mesh: DeviceMesh, dim: int) -> NVFP4LinearShard:
    who = _describe(module, _plan_path())
    if isinstance(module, NVFP4LinearShard):
        raise ValueError(f"{who} is sharded already ({_STYLE_NAMES[module.tp_dim]} over {module.tp_size} ranks)")
    rank, size = _mesh_position(mesh, who)
    n, k = module.out_features, module.in_features
    share = _share(dim, n, k, size, who)
    if style.src_data_rank is not None and size > 1:
        _broadcast_layer(module, mesh, style.src_data_rank)
    data, scale, bias = _local_slice(module, dim, rank, share)
    with torch.no_grad():
        if dim == COLWISE:
            module.out_features = share
            module.bias = None if bias is None else nn.Parameter(bias.clone(), module.bias.requires_grad)
        else:
            module.in_features = share
        module._set_plain(data, scale)
    row_bias = module.bias if dim == ROWWISE else None
    return _install_plan_hooks(_become_shard(module, mesh, dim, n, k, row_bias), style, mesh)


def _install_plan_hooks(module: NVFP4LinearShard, style, mesh: DeviceMesh) -> NVFP4LinearShard:
    """The plan's own input / output handling, as distribute_module installs it (which would also
    turn every plain buffer into a replicated DTensor: the shares must stay local tensors)."""
    if module.tp_dim == ROWWISE:
        style.desired_input_layouts = (Shard(-1),)  # as torch's RowwiseParallel sets it for an nn.Linear
    input_fn = partial(style._prepare_input_fn, style.input_layouts, style.desired_input_layouts)
    output_fn = partial(style._prepare_output_fn, style.output_layouts, style.use_local_output)
    module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, mesh))
    module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, mesh))
    module._distribute_module_applied = True
    return module


class ColwiseParallel(_torch_style.ColwiseParallel):
    """torch's ColwiseParallel (same arguments) that also shards an NVFP4Linear: each rank keeps
    N / world size whole rows (a multiple of 64), with the whole weight's global scale."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, NVFP4Linear):
            return _shard_nvfp4(self, module, device_mesh, COLWISE)
        return super()._apply(module, device_mesh)


class RowwiseParallel(_torch_style.RowwiseParallel):
    """torch's RowwiseParallel (same arguments) that also shards an NVFP4Linear: each rank keeps
    K / world size whole columns (a multiple of 64), with the whole weight's global scale; the
    partial products are all-reduced in the output's dtype, the bias added once."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, NVFP4Linear):
            return _shard_nvfp4(self, module, device_mesh, ROWWISE)
        return super()._apply(module, device_mesh)


def _whole_amax(local: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """amax over the finite elements of the whole weight, from each rank's share (an all-reduce)."""
    amax = finite_amax(local.detach()).reshape(1).clone()
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return amax.reshape(())


def shard_from_linear(linear: nn.Linear, activations: str = "auto", method: str = "rtn",
                      hessian: torch.Tensor | None = None, global_scale=None,
                      name: str | None = None) -> NVFP4LinearShard:
    """An nn.Linear sharded by torch's ColwiseParallel (weight Shard(0)) or RowwiseParallel
    (Shard(1)) -> this rank's NVFP4LinearShard: the local share quantized with the global scale of
    the whole weight (its amax all-reduced over the mesh), or with global_scale where given (a
    group's shared one). hessian: the whole layer's (K/16, 16, 16), as collect_hessians gives it.
    NVFP4Linear.from_linear calls this for a DTensor weight (nv.convert of a sharded model)."""
    weight = linear.weight
    who = _describe(linear, name)
    if not isinstance(weight, DTensor):
        raise TypeError(f"{who}: its weight is not a DTensor (not sharded); use NVFP4Linear.from_linear")
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    rank, size = _mesh_position(mesh, who)
    if placements == (Shard(0),):
        dim = COLWISE
    elif placements == (Shard(1),):
        dim = ROWWISE
    else:
        raise ValueError(f"{who}: a weight with placements {placements}; NVFP4 converts tensor-parallel "
                         "linears sharded Shard(0) (ColwiseParallel) or Shard(1) (RowwiseParallel)")
    n, k = weight.shape
    share = _share(dim, n, k, size, who)
    local = weight.to_local()
    if tuple(local.shape) != ((share, k) if dim == COLWISE else (n, share)):
        raise ValueError(f"{who}: this rank's share has shape {tuple(local.shape)}; an even split over "
                         f"{size} ranks gives {(share, k) if dim == COLWISE else (n, share)}")
    if global_scale is None:
        global_scale = global_scale_from_amax(_whole_amax(local, mesh))
    elif isinstance(global_scale, DTensor):
        global_scale = global_scale.full_tensor()
    if hessian is not None and dim == ROWWISE:
        hessian = hessian[rank * share // BLOCK_SIZE: (rank + 1) * share // BLOCK_SIZE]
    q = api.quantize(local.detach(), global_scale, method=method, hessian=hessian)
    bias = linear.bias
    if isinstance(bias, DTensor):
        bias = bias.to_local() if dim == COLWISE else bias.full_tensor()
    layer = NVFP4Linear(q, bias if dim == COLWISE else None, activations)
    return _become_shard(layer, mesh, dim, n, k, bias if dim == ROWWISE else None)


def sharded_graph_inputs(gm: torch.fx.GraphModule, example_inputs) -> set[int]:
    """backend="nvfp4": the indices of a Dynamo graph's DTensor inputs (tensors of a model sharded
    by a tensor-parallel plan), which stay graph inputs, compiled as torch.compile compiles them
    (a vocabulary-parallel embedding, ...). A linear's sharded bf16 weight is refused: the rewrite
    quantizes each constant weight on its own, so a rank's share would get the global scale of its
    share, not the whole weight's (nv.convert of the sharded model quantizes each share with the
    whole weight's global scale, after an all-reduce of the amax)."""
    from .inductor.backend import _module_path

    linear_ops = {torch._C._nn.linear, torch.nn.functional.linear}
    found = set()
    for i, (node, t) in enumerate(zip(gm.graph.find_nodes(op="placeholder"), example_inputs)):
        if not isinstance(t, DTensor):
            continue
        found.add(i)
        if any(p.is_shard() for p in t.placements) and any(
                user.op == "call_function" and user.target in linear_ops
                and (user.args[1:2] == (node,) or user.kwargs.get("weight") is node) for user in node.users):
            raise ValueError(
                f"backend='nvfp4': the linear weight {_module_path(node)!r} is sharded by a tensor-parallel plan "
                f"(a DTensor, {tuple(t.placements)}); compiled as it is, each rank would quantize its share with a "
                "global scale of its own. Convert the sharded model first (nvfp4_inductor.convert: each share "
                "quantized with the whole weight's global scale), then compile it (docs/parallel.md)")
    return found


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
    from safetensors import safe_open

    from . import checkpoint as ck
    from .convert import ConversionReport, _replace

    path = Path(path)
    rank, size = _mesh_position(device_mesh, f"load_sharded_checkpoint({str(path)!r})")
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
        share = n if dim is None else _share(dim, n, k, size, f"{who} ({k} -> {n})")
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
            layer = _become_shard(layer, device_mesh, dim, n, k, bias if dim == ROWWISE else None)
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
        _replace(model, name, old, layer)  # (which gives it old's hooks: the plan's come after)
        if isinstance(layer, NVFP4LinearShard):
            _install_plan_hooks(layer, styles[name], device_mesh)
        report.converted.append(name)
        report.layers += 1
    from torch.distributed.tensor.parallel import parallelize_module

    for name, style in styles.items():
        if name not in layers:  # every rank holds the whole tensors: no scatter from a source rank
            parallelize_module(model.get_submodule(name), device_mesh, style, src_data_rank=None)
    return report

"""Tensor-parallel NVFP4 layers: NVFP4LinearShard (one rank's share of an NVFP4Linear) and the
plans that make them (ColwiseParallel, RowwiseParallel: torch's, extended to NVFP4Linear);
nvfp4_inductor.parallel is the public entry point, and describes the layout.
"""

import sys
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Shard
from torch.distributed.tensor.parallel import style as _torch_style

from nvfp4_inductor import api
from nvfp4_inductor.format import BLOCK_SIZE
from nvfp4_inductor.modules.linear import NVFP4Linear
from nvfp4_inductor.reference import finite_amax, global_scale_from_amax
from nvfp4_inductor.reference.tiled import TILE_K, TILE_N

__all__ = ["ColwiseParallel", "RowwiseParallel", "NVFP4LinearShard", "shard_from_linear", "COLWISE", "ROWWISE",
           "mesh_position", "share_length", "become_shard", "install_plan_hooks", "describe"]

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
            raise ValueError(f"{describe(self)}: x has {x.shape[-1]} features in its last dimension; this "
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


def describe(module: nn.Module, name: str | None = None) -> str:
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


def mesh_position(mesh: DeviceMesh, what: str) -> tuple[int, int]:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{what}: device_mesh must be a torch.distributed.DeviceMesh; got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{what}: tensor parallelism takes a 1-D DeviceMesh (slice a N-D mesh, e.g. "
                         f"mesh['tp']); got a {mesh.ndim}-D mesh")
    return mesh.get_local_rank(), mesh.size()


def share_length(dim: int, n: int, k: int, size: int, who: str) -> int:
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


def become_shard(module: NVFP4Linear, mesh: DeviceMesh, dim: int, n: int, k: int,
                  row_bias: torch.Tensor | None) -> NVFP4LinearShard:
    """module, holding its local share already, -> that module as an NVFP4LinearShard (in place)."""
    rank, size = mesh_position(mesh, "NVFP4 tensor parallelism")
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
    who = describe(module, _plan_path())
    if isinstance(module, NVFP4LinearShard):
        raise ValueError(f"{who} is sharded already ({_STYLE_NAMES[module.tp_dim]} over {module.tp_size} ranks)")
    rank, size = mesh_position(mesh, who)
    n, k = module.out_features, module.in_features
    share = share_length(dim, n, k, size, who)
    if style.src_data_rank is not None and size > 1:
        _broadcast_layer(module, mesh, style.src_data_rank)
    data, scale, bias = _local_slice(module, dim, rank, share)
    with torch.no_grad():
        if dim == COLWISE:
            module.out_features = share
            module.bias = None if bias is None else nn.Parameter(bias.clone(), module.bias.requires_grad)
        else:
            module.in_features = share
        module.set_plain(data, scale)
    row_bias = module.bias if dim == ROWWISE else None
    return install_plan_hooks(become_shard(module, mesh, dim, n, k, row_bias), style, mesh)


def install_plan_hooks(module: NVFP4LinearShard, style, mesh: DeviceMesh) -> NVFP4LinearShard:
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
    who = describe(linear, name)
    if not isinstance(weight, DTensor):
        raise TypeError(f"{who}: its weight is not a DTensor (not sharded); use NVFP4Linear.from_linear")
    mesh, placements = weight.device_mesh, tuple(weight.placements)
    rank, size = mesh_position(mesh, who)
    if placements == (Shard(0),):
        dim = COLWISE
    elif placements == (Shard(1),):
        dim = ROWWISE
    else:
        raise ValueError(f"{who}: a weight with placements {placements}; NVFP4 converts tensor-parallel "
                         "linears sharded Shard(0) (ColwiseParallel) or Shard(1) (RowwiseParallel)")
    n, k = weight.shape
    share = share_length(dim, n, k, size, who)
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
    return become_shard(layer, mesh, dim, n, k, bias if dim == ROWWISE else None)

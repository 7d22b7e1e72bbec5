"""Quantize a Hugging Face model folder to an NVFP4 checkpoint, streaming (tensor group by group).

`python -m nvfp4_inductor quantize SRC DST` reads SRC (config.json and safetensors shards) one
fused group of tensors at a time and writes DST, an NVFP4 checkpoint (ModelOpt or
compressed-tensors) with the same tensors, bit for bit, as nv.convert(model,
Config(share_global_scales=True, weight_method=...)) followed by nv.save_checkpoint would
write, without ever holding the model: which layers convert is decided on an empty (meta)
model built from config.json, by convert's own rules; q / k / v, gate / up and each expert's
gate / up share one global scale (the largest of theirs); DST has SRC's shards, each tensor in
the shard of its input. Peak memory is about one output shard plus one fused group.
"""

import argparse
import fnmatch
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from nvfp4_inductor import api, reference
from nvfp4_inductor.config import Config
from nvfp4_inductor.io import checkpoint
from nvfp4_inductor.kernels import quantize_cpu
from nvfp4_inductor.modules import hf_names
from nvfp4_inductor.modules.convert import fused_groups, linear_targets
from nvfp4_inductor.modules.experts import experts_to_convert, is_experts
from nvfp4_inductor.reference.scale_search import METHODS

__all__ = ["add_arguments", "main", "plan", "Plan", "read_tensor"]

# SRC files copied to DST as they are (tokenizer, chat template, generation settings)
COPIED_FILES = ("generation_config.json", "tokenizer*", "special_tokens_map.json", "*.jinja", "vocab.*",
                "merges.txt", "preprocessor_config.json", "chat_template*")
WRITTEN_FILES = ("config.json", "hf_quant_config.json", "model.safetensors.index.json", "*.safetensors")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", metavar="SRC", help="a Hugging Face model folder (config.json, *.safetensors)")
    parser.add_argument("dst", metavar="DST", help="the NVFP4 checkpoint folder to write (new or empty)")
    parser.add_argument("--format", choices=checkpoint.FORMATS, default="modelopt",
                        help="checkpoint format (default: modelopt)")
    parser.add_argument("--weight-method", choices=METHODS, default="rtn",
                        help="block scales: rtn (round to nearest, default) or mse (smallest squared error "
                             "per block); hessian needs calibration data and is refused here")
    parser.add_argument("--exclude", metavar="GLOB", action="append", default=[],
                        help="leave modules matching GLOB (fnmatch, the model's or the files' name) in bf16; "
                             "repeatable")
    parser.add_argument("--device", default=None,
                        help="where to quantize: cuda (default where available) or cpu")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a non-empty DST (its NVFP4 checkpoint files are deleted first)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.set_defaults(run=main)


@dataclass
class Plan:
    """What to write. units: [(model layer names, their weights' keys in SRC, "linear" or
    "gate_up")], each a group of weights sharing one global scale; excluded: the files' names
    of the modules left in bf16; src_files: SRC's shards; shard_of: {SRC key: index into src_files}."""

    units: list[tuple[list[str], list[str], str]]
    excluded: list[str]
    src_files: list[Path]
    shard_of: dict[str, int]


def _exclude_filter(globs: list[str], to_file):
    """Config.include for --exclude: a module converts unless a glob matches its model or file name."""
    if not globs:
        return None

    def include(name: str, module) -> bool:
        return not any(fnmatch.fnmatchcase(n, g) for g in globs for n in (name, to_file(name)))
    return include


def empty_model(src: Path) -> nn.Module:
    """The model SRC's config.json describes, on the meta device (no weights allocated)."""
    try:
        import transformers
    except ImportError:
        raise ValueError("quantize builds the model of config.json with transformers, which is not installed "
                         "(pip install 'nvfp4-inductor[transformers]')") from None

    hf_config = transformers.AutoConfig.from_pretrained(str(src))
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(hf_config)
        except ValueError:  # (not a causal LM: the base model class of its config)
            return transformers.AutoModel.from_config(hf_config)


def plan(src: Path, method: str, exclude: list[str]) -> Plan:
    """Which SRC tensors become NVFP4 and which share a global scale, by nv.convert's rules on
    the meta model of SRC's config.json."""
    model = empty_model(src)
    to_file = hf_names.module_renamer(model, to_checkpoint=True)
    to_file_key = hf_names.key_renamer(model, to_checkpoint=True)
    config = Config(share_global_scales=True, weight_method=method, include=_exclude_filter(exclude, to_file))
    files = checkpoint.safetensors_files(src)
    shard_of = {}
    for i, file in enumerate(files):
        for key in _keys(file):
            if key in shard_of:
                raise ValueError(f"{key!r} is in both {files[shard_of[key]].name} and {file.name}")
            shard_of[key] = i
    targets = linear_targets(model, config)
    converting = {own[0]: module for own, module, reasons in targets if not reasons}
    grouped = fused_groups(converting)
    in_group = {name for members in grouped for name in members}
    units = [(members, "linear") for members in grouped]
    units += [([name], "linear") for name in converting if name not in in_group]
    experts, _ = experts_to_convert(model, config)  # (those it cannot convert stay bf16, as in convert)
    namer = hf_names.expert_namer(model)
    for names, module in experts:
        gate, up, down = namer(names[0])
        for e in range(module.gate_up_proj.shape[0]):
            prefix = f"{names[0]}.{e}"
            units.append(([f"{prefix}.{gate}", f"{prefix}.{up}"], "gate_up"))
            units.append(([f"{prefix}.{down}"], "linear"))
    keyed = []
    for members, kind in units:
        keys = [to_file_key(f"{name}.weight") for name in members]
        absent = [key for key in keys if key not in shard_of]
        if absent:
            raise ValueError(f"{src}'s safetensors files lack {absent[:4]}, which the model of its config.json "
                             "holds (per-expert weights as Hugging Face writes them are expected for experts)")
        keyed.append((members, keys, kind))
    converted = set(converting) | {names[0] for names, _ in experts}
    excluded = sorted(to_file(name) for name, m in model.named_modules()
                      if (type(m) is nn.Linear or is_experts(m)) and name not in converted)
    return Plan(keyed, excluded, files, shard_of)


def _keys(file: Path) -> list[str]:
    """The tensor names of a safetensors file."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{file} is not a readable safetensors file: {error}") from None


def read_tensor(file: Path, key: str) -> torch.Tensor:
    """One tensor of a safetensors file. The file is opened for each tensor: safetensors maps it,
    and the pages a read touches count as this process's memory for as long as the mapping lives
    (a handle kept open per shard holds the whole shard by the end)."""
    with safe_open(str(file), framework="pt") as f:
        return f.get_tensor(key)


def _check_device(device: str | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device}: not a device (cuda or cpu)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine (torch "
                         f"{torch.__version__}); use --device cpu")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {device}: cuda or cpu")
    return device


def _global_scale(weights: list[torch.Tensor], kind: str) -> torch.Tensor:
    """The global scale a unit's weights share, as nv.convert computes it: the largest of the
    members' (a fused group, convert's shared scales), or that of their concatenation (an
    expert's gate_up, quantized as one tensor)."""
    amaxes = [quantize_cpu.finite_amax(w) if w.device.type == "cpu" else reference.finite_amax(w) for w in weights]
    if kind == "gate_up":
        return reference.global_scale_from_amax(torch.stack(amaxes).max())
    return torch.stack([reference.global_scale_from_amax(a) for a in amaxes]).max()


def _quantize(w: torch.Tensor, g: torch.Tensor, method: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight on its device + fp32 g () -> (codes uint8 (N, K/2), e4m3 scales (N, K/16)) on the CPU."""
    if method == "rtn" and w.device.type == "cpu":
        data, scale, _ = quantize_cpu.quantize(w, g)
        return data, scale
    q = api.quantize(w, g, method=method)
    return q.data.cpu(), q.scale.cpu()


def _stored(fmt: str, key: str, data, scale, g) -> dict[str, torch.Tensor]:
    """A quantized weight's tensors under fmt's names (save_checkpoint's, values included)."""
    return checkpoint.stored_layer(fmt, key.removesuffix(".weight"),
                                   {"weight": data, "weight_scale": scale, "weight_scale_2": g.cpu().clone()})


class _Progress:
    """tqdm over SRC's tensors with the GB/s of input read, or nothing (quiet)."""

    def __init__(self, total: int, quiet: bool):
        from tqdm import tqdm

        self.bar = tqdm(total=total, unit="tensor", disable=quiet, dynamic_ncols=True)
        self.start, self.bytes = time.perf_counter(), 0

    def update(self, tensors: int, nbytes: int) -> None:
        self.bytes += nbytes
        rate = self.bytes / max(time.perf_counter() - self.start, 1e-9) / 1e9
        self.bar.set_postfix_str(f"{rate:.2f} GB/s", refresh=False)
        self.bar.update(tensors)

    def close(self) -> None:
        self.bar.close()


class _ShardWriter:
    """Builds DST's shards one at a time: SRC shard i's tensors, copied or quantized."""

    def __init__(self, plan_: Plan, fmt: str, method: str, device: torch.device, progress: "_Progress"):
        self.plan, self.fmt, self.method, self.device, self.progress = plan_, fmt, method, device, progress
        self.unit_of = {key: u for u, (_, keys, _) in enumerate(plan_.units) for key in keys}
        self.pending: dict[int, dict[str, torch.Tensor]] = {}  # shard -> what a straddling unit left there
        self.done: set[int] = set()

    def shard(self, i: int) -> dict[str, torch.Tensor]:
        """-> output shard i's tensors (only it is held, and the other shards' parts of its units)."""
        out = self.pending.pop(i, {})
        file = self.plan.src_files[i]
        for key in _keys(file):
            u = self.unit_of.get(key)
            if u is None:
                out[key] = read_tensor(file, key)
                self.progress.update(1, out[key].nbytes)
            elif u not in self.done:
                self.done.add(u)
                self._unit(u, i, out)
        return out

    def _unit(self, u: int, i: int, out: dict) -> None:
        """Quantize unit u (its weights read from whichever shards hold them) into out (shard i)
        and the pending parts of later shards."""
        _, keys, kind = self.plan.units[u]
        shard_of = self.plan.shard_of
        weights = [read_tensor(self.plan.src_files[shard_of[k]], k) for k in keys]
        nbytes = sum(w.nbytes for w in weights)
        weights = [w.to(self.device) for w in weights]
        g = _global_scale(weights, kind)
        for k, w in zip(keys, weights):
            data, scale = _quantize(w, g, self.method)
            target = out if shard_of[k] == i else self.pending.setdefault(shard_of[k], {})
            target.update(_stored(self.fmt, k, data, scale, g))
        self.progress.update(len(keys), nbytes)


def write(plan_: Plan, dst: Path, fmt: str, method: str, device: torch.device, quiet: bool) -> int:
    """Read SRC's tensors, quantize plan_'s units, write DST's shards (one held at a time) and
    index; -> the bytes read."""
    from safetensors.torch import save_file

    weight_map, total_size = {}, 0
    progress = _Progress(len(plan_.shard_of), quiet)
    try:
        writer = _ShardWriter(plan_, fmt, method, device, progress)
        for i, file in enumerate(plan_.src_files):
            tensors = writer.shard(i)
            save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file.name))
            total_size += sum(t.nbytes for t in tensors.values())
            del tensors  # (before the next shard is read)
    finally:
        progress.close()
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return progress.bytes


def _check_dst(src: Path, dst: Path, overwrite: bool) -> None:
    if dst.exists() and not dst.is_dir():
        raise ValueError(f"DST {dst} is a file, not a folder")
    if dst.resolve() == src.resolve() or src.resolve().is_relative_to(dst.resolve()):
        raise ValueError(f"DST {dst} is SRC or holds it: write the checkpoint elsewhere")
    if dst.is_dir() and any(dst.iterdir()) and not overwrite:
        raise ValueError(f"DST {dst} exists and is not empty: pass --overwrite to replace it, or give a "
                         "new folder")


def _clear(dst: Path) -> None:
    """With --overwrite: remove the files a checkpoint folder has (this command's, SRC's copied
    ones); a folder holding anything else is refused rather than emptied."""
    if not dst.is_dir():
        return
    ours = (*WRITTEN_FILES, *COPIED_FILES)
    others = [p.name for p in dst.iterdir() if p.is_dir() or not any(fnmatch.fnmatch(p.name, g) for g in ours)]
    if others:
        raise ValueError(f"--overwrite: DST {dst} holds files that are not a checkpoint's ({others[:4]}): "
                         "remove them yourself or choose another folder")
    for p in dst.iterdir():
        p.unlink()


def main(args) -> int:
    """Run `quantize` from parsed arguments -> the exit status."""
    try:
        src, dst = Path(args.src), Path(args.dst)
        if not src.is_dir():
            raise ValueError(f"SRC {src} is not a folder")
        if not (src / "config.json").is_file():
            raise ValueError(f"SRC {src} has no config.json (a Hugging Face model folder has one)")
        config = json.loads((src / "config.json").read_text())
        quantized = config.get("quantization_config")
        if quantized:
            raise ValueError(f"SRC {src} is already quantized (config.json's quantization_config: "
                             f"{quantized.get('quant_method', quantized) if isinstance(quantized, dict) else quantized}): "
                             "quantize reads a bf16 / fp16 / fp32 model")
        if args.weight_method == "hessian":
            raise ValueError("--weight-method hessian needs calibration Hessians (nv.collect_hessians on "
                             "the loaded model, then nv.convert): use rtn or mse here")
        device = _check_device(args.device)
        _check_dst(src, dst, args.overwrite)
        the_plan = plan(src, args.weight_method, args.exclude)
        partial = dst.with_name(dst.name + ".partial")  # an interrupted run leaves this, never a DST
        if partial.exists():
            if not args.overwrite:
                raise ValueError(f"{partial} is left from an interrupted run: pass --overwrite to remove it")
            _clear(partial)
        if args.overwrite:
            _clear(dst)  # (before writing: a refusal here must not cost the whole run)
        partial.mkdir(parents=True, exist_ok=True)
    except (ValueError, FileNotFoundError, NotADirectoryError, OSError) as error:
        print(f"quantize: error: {error}", file=sys.stderr, flush=True)
        return 2
    start = time.perf_counter()
    read = write(the_plan, partial, args.format, args.weight_method, device, args.quiet)
    seconds = time.perf_counter() - start
    for pattern in COPIED_FILES:
        for file in src.glob(pattern):
            if file.is_file():
                shutil.copyfile(file, partial / file.name)
    checkpoint.write_configs(partial, config, args.format, False, the_plan.excluded)
    if dst.exists():
        dst.rmdir()  # (empty: checked or cleared above)
    os.replace(partial, dst)
    if not args.quiet:
        print(f"wrote {dst} ({args.format}, weight method {args.weight_method}, {device.type}): read "
              f"{read / 1e9:.2f} GB of tensors in {seconds:.1f} s ({read / seconds / 1e6:.0f} MB/s)")
    return 0

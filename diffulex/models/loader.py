"""Loading safetensors checkpoints into a model, and building a ready-to-run model from a checkpoint folder.

Only ``.safetensors`` files are read: ``.bin``/``.pt`` files are Python pickles, and unpickling a file from a
downloaded folder can execute arbitrary code. Loading is strict: before any tensor is copied, the checkpoint's
names and shapes are compared with the model's and every problem (missing, mis-shaped, unexpected tensors) is
reported in one ``ValueError``, because a silently half-loaded model produces fluent garbage that is much
harder to diagnose than an error.

``load_format="dummy"`` skips the files altogether and fills the model with seeded random weights of the
checkpoint's shapes (like vLLM's dummy format): a folder holding only ``config.json`` and the tokenizer is then
enough to measure speed and memory of a multi-billion-parameter geometry without downloading it.
"""

from __future__ import annotations

import contextlib
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from diffulex.checkpoint_folder import checkpoint_path
from diffulex.layers import merge_projections
from diffulex.layers.moe import expert_of, held_elsewhere, mixture_layers
from diffulex.models.family import FAMILIES
from diffulex.models.hf_config import read_config_dict
from diffulex.models.safetensors_header import TensorHeader, read_safetensors_header
from diffulex.validation import check_choice

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")

# Repeated modules whose count a config states, found in checkpoint tensor names by their index: the config.json
# keys that state the count (in any family) and the pattern whose group is the index. ``.experts.`` does not match
# ``shared_experts``.
COUNTED_MODULES = (
    (("num_hidden_layers", "n_layers"), re.compile(r"\.(?:layers|blocks)\.(\d+)\.")),
    (("num_experts",), re.compile(r"\.experts\.(\d+)\.")),
)

# name -> (the file holding it, its header entry)
CheckpointTensors = dict[str, tuple[Path, TensorHeader]]

# How weights are obtained: the safetensors files, or random weights of the checkpoint's shapes (benchmarks).
LOAD_FORMATS = ("safetensors", "dummy")


def _weight_files(folder: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The weight files, and the index's tensor -> shard map when the checkpoint is sharded with an index."""
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    single = checkpoint_path(folder, SINGLE_FILE)
    if single.is_file():
        return [single], None
    index = checkpoint_path(folder, INDEX_FILE)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} has no valid 'weight_map': {e}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
        shard_of = {name: checkpoint_path(folder, shard) for name, shard in weight_map.items()}
        shards = sorted(set(shard_of.values()))
        missing = [str(p.relative_to(folder)) for p in shards if not p.is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are not in {folder}: {', '.join(missing)}")
        return shards, shard_of
    files = [checkpoint_path(folder, p.name) for p in sorted(folder.glob("*.safetensors")) if p.is_file()]
    if files:
        return files, None
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
    hint = (
        f" (found {', '.join(pickles)}: pickle checkpoints are not loaded because unpickling can execute "
        "code; convert them to safetensors)"
        if pickles
        else ""
    )
    raise ValueError(f"{folder} has no safetensors weights{hint}")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors``, else the shards named by the index file,
    else every ``*.safetensors`` in the folder (sorted). Each is confined to the folder (`checkpoint_path`): an
    index naming ``../x.safetensors`` or an absolute path, or a link out of the folder, is a ``ValueError``."""
    return _weight_files(Path(model_dir))[0]


def checkpoint_tensors(model_dir: str | Path) -> CheckpointTensors:
    """Every tensor of the checkpoint with its file, dtype and shape, from the file headers only (no tensor data
    is read). Each header is checked (`read_safetensors_header`), a tensor may appear in one file only, and every
    tensor the index maps to a shard must be in that shard."""
    folder = Path(model_dir)
    files, shard_of = _weight_files(folder)
    found: CheckpointTensors = {}
    for path in files:
        for name, header in read_safetensors_header(path).items():
            if name in found:
                raise ValueError(f"tensor {name!r} appears in both {found[name][0]} and {path}")
            found[name] = (path, header)
    for name, shard in (shard_of or {}).items():
        if found.get(name, (None,))[0] != shard:
            raise ValueError(
                f"{folder / INDEX_FILE} maps tensor {name!r} to {shard.relative_to(folder)}, which does not hold it"
            )
    return found


def check_config_against_weights(config: dict[str, Any], tensors: CheckpointTensors, model_dir: str | Path) -> None:
    """Refuse a ``config.json`` (`config`, as parsed) that asks for more layers or experts than the weights hold.

    Runs before the config is even validated: building the model costs time and memory in proportion to those
    counts (a ``num_hidden_layers`` of 10**6 takes minutes even on the meta device), the strict loader would refuse
    the result anyway, and counting the indices in the checkpoint's tensor names is free, so the message can give
    the weights' value. A config asking for fewer is left to the strict loader, which names the surplus tensors (or
    ignores them where the model says so); a value that is not an integer is left to the config reader.
    """
    for keys, pattern in COUNTED_MODULES:
        field = next((key for key in keys if key in config), None)
        wanted = config.get(field) if field is not None else None
        indices = {int(m.group(1)) for name in tensors if (m := pattern.search(name))}
        if isinstance(wanted, bool) or not isinstance(wanted, int) or not indices or wanted <= len(indices):
            continue
        files = sorted({str(path.name) for path, _ in tensors.values()})
        raise ValueError(
            f"{Path(model_dir) / CONFIG_FILE}: config field {field!r} is {wanted}, but the weights "
            f"({', '.join(files)}) hold {len(indices)} (indices {min(indices)}..{max(indices)}); the config does "
            "not describe these weights"
        )


def _load_targets(model: nn.Module) -> tuple[dict[str, torch.Tensor], set[str]]:
    """The tensors a checkpoint must provide (parameters and persistent buffers, by name), and the alias
    names of tied tensors (e.g. ``lm_head.weight`` when it is the embedding), which are never loaded."""
    targets: dict[str, torch.Tensor] = {}
    aliases: set[str] = set()
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            aliases.add(name)
            continue
        seen.add(id(tensor))
        targets[name] = tensor
    return targets, aliases


def _owners(model: nn.Module) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """Each load target's name -> the module holding it directly and the tensor."""
    owners: dict[str, tuple[nn.Module, torch.Tensor]] = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for leaf, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            owners.setdefault(prefix + leaf, (module, tensor))
    return owners


def checkpoint_shape(owner: nn.Module, tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape of ``tensor`` in a checkpoint: the whole tensor, also where a tensor-parallel layer holds only
    its rank's slice of it (`diffulex.layers.linear`)."""
    shape_of = getattr(owner, "checkpoint_shape", None)
    return shape_of(tensor) if shape_of is not None else tuple(tensor.shape)


def _load_into(owner: nn.Module, tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Hand a full checkpoint tensor to its parameter: the owner's ``weight_loader`` keeps this rank's slice; a
    tensor without one is copied whole. (A routed expert's tensor goes through its layer's
    `SparseMoE.expert_weight_loader` instead: `_load_named`.)"""
    loader = getattr(owner, "weight_loader", None)
    if loader is not None:
        loader(tensor, value)
    else:
        tensor.copy_(value)


def _check_embedding(model: nn.Module, tensors: CheckpointTensors, model_dir: str | Path) -> None:
    """A token embedding of another width or vocabulary than the config's is reported as that config field, with
    the weights' value: it is the one mismatch whose cause is always the config's size, not a single tensor."""
    embedding = next(((n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding)), None)
    if embedding is None or f"{embedding[0]}.weight" not in tensors:
        return
    name = f"{embedding[0]}.weight"
    path, header = tensors[name]
    if len(header.shape) != 2:
        return
    config = getattr(model, "config", None)
    json_name = config.json_name if hasattr(config, "json_name") else str
    rows, width = checkpoint_shape(embedding[1], embedding[1].weight)
    for attr, model_value, weight_value in (
        ("hidden_size", width, header.shape[1]),
        ("vocab_size", rows, header.shape[0]),
    ):
        if model_value != weight_value:
            raise ValueError(
                f"{Path(model_dir) / CONFIG_FILE}: config field {json_name(attr)!r} is {model_value}, but the weights "
                f"say {weight_value} ({name} in {path.name} has shape {list(header.shape)})"
            )


def check_checkpoint_matches(model: nn.Module, tensors: CheckpointTensors, model_dir: str | Path) -> None:
    """Compare the checkpoint's tensors with the model's, from shapes alone (a meta-device model will do).

    Raises ``ValueError`` listing tensors the model needs that the checkpoint lacks, tensors whose shapes differ
    (both shapes and the file given), tensors of the wrong kind of dtype (integer data for a floating-point
    parameter or the reverse), and checkpoint tensors the model has no place for, except those matching a regex
    in the model's ``ignored_checkpoint_keys`` and aliases of tied weights. A token embedding that disagrees is
    reported first, as the config field it contradicts.
    """
    _check_embedding(model, tensors, model_dir)
    targets, aliases = _load_targets(model)
    owners = _owners(model)
    shapes = {name: checkpoint_shape(owners[name][0], tensor) for name, tensor in targets.items()}
    ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_keys", ())]
    layers = mixture_layers(model)

    missing = sorted(set(targets) - set(tensors))
    mismatched = [
        f"{name} in {path.name}: checkpoint {list(header.shape)} vs model {list(shapes[name])}"
        for name, (path, header) in sorted(tensors.items())
        if name in targets and shapes[name] != header.shape
    ]
    wrong_dtype = [
        f"{name} in {path.name}: checkpoint {header.dtype} vs model {targets[name].dtype}"
        for name, (path, header) in sorted(tensors.items())
        if name in targets and header.is_floating_point != targets[name].is_floating_point()
    ]
    unexpected = sorted(
        name
        for name in tensors
        if name not in targets
        and name not in aliases
        and not any(p.search(name) for p in ignored)
        and not held_elsewhere(name, layers)  # another expert-parallel rank's expert: checked there
    )
    problems = []
    if missing:
        files = sorted({path.name for path, _ in tensors.values()})
        problems.append(f"missing tensors: {', '.join(missing)} (in none of {', '.join(files)})")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched)}")
    if wrong_dtype:
        problems.append(f"dtype mismatches (integer vs floating point): {'; '.join(wrong_dtype)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if problems:
        where = f"checkpoint {Path(model_dir)} does not match {type(model).__name__}"
        hint = getattr(model, "load_error_hint", "")
        if hint:
            problems.append(f"hint: {hint}")
        raise ValueError(f"{where}: " + " | ".join(problems))


def _copy_tensors(model: nn.Module, tensors: CheckpointTensors, model_dir: str | Path) -> None:
    """Copy every target's tensor from its file, then refuse non-finite values.

    The finiteness check is the minimum and maximum of each copied (cast) tensor, on its device, read back once per
    file: NaN propagates to both, +Inf shows in the maximum, -Inf in the minimum, so the check is exact, and one
    reduction in the tensor's own dtype costs about half a copy (``isfinite`` or a float32 sum of a bf16 tensor
    cost 25-50 copies on CPU). Only a tensor found non-finite is scanned again, to count its bad values.
    """
    targets, _ = _load_targets(model)
    owners = _owners(model)
    layers = mixture_layers(model)
    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(tensors[name][0], []).append(name)
    non_finite: list[str] = []
    with torch.no_grad():
        for path, names in by_file.items():
            extremes: dict[str, torch.Tensor] = {}
            try:
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    for name in names:
                        target = targets[name]
                        _load_named(name, owners[name][0], target, f.get_tensor(name), layers)
                        if target.is_floating_point() and target.numel() > 0:
                            extremes[name] = torch.stack(torch.aminmax(target)).float()
            except (SafetensorError, OSError) as e:
                raise ValueError(f"{path}: cannot be read as safetensors: {e}") from None
            if not extremes:
                continue
            finite = torch.stack(list(extremes.values())).isfinite().all(dim=1).tolist()
            for name, ok in zip(extremes, finite, strict=True):
                bad = 0 if ok else int((~torch.isfinite(targets[name])).sum())
                if bad:
                    non_finite.append(f"{name} in {path.name} ({bad} of {targets[name].numel()} values)")
    if non_finite:
        raise ValueError(
            f"checkpoint {Path(model_dir)} has non-finite weights (NaN or Inf), which make the model's output "
            f"meaningless: {'; '.join(non_finite)}"
        )


def _load_named(
    name: str, owner: nn.Module, tensor: torch.Tensor, value: torch.Tensor, layers: dict[str, nn.Module]
) -> None:
    """Load the checkpoint tensor ``name``: a routed expert's through its layer's `expert_weight_loader` (only this
    rank's experts are load targets, so it always keeps it), anything else through `_load_into`."""
    found = expert_of(name, layers)
    if found is not None:
        layer, relative = found
        if not layer.expert_weight_loader(relative, value):
            raise RuntimeError(f"{name} is a load target of this rank, but its expert is not held here")
        return
    _load_into(owner, tensor, value)


def load_checkpoint(model: nn.Module, model_dir: str | Path) -> None:
    """Copy the checkpoint's tensors into `model` (casting to each parameter's dtype and device).

    Everything that can be checked from the file headers is checked before any tensor is copied
    (`check_checkpoint_matches`; a problem leaves the model untouched). NaN or Inf in a weight is found while
    copying and raised as a ``ValueError`` naming the tensors and files after the copy (the model is then not fit
    for use). Unreadable files are a ``ValueError`` naming the file.
    """
    tensors = checkpoint_tensors(model_dir)
    check_checkpoint_matches(model, tensors, model_dir)
    _copy_tensors(model, tensors, model_dir)


DEFAULT_INIT_STD = 0.02
# `tensor_seed`: an odd 64-bit multiplier spreading the model's seed over the generator's range, so that seeds
# differing in any bit give streams apart from the name's contribution
SEED_MIX = 0x9E3779B97F4A7C15
SEED_RANGE = 1 << 63


def _initializer_range(model_dir: str | Path) -> float:
    """The checkpoint's ``initializer_range`` (top level or ``text_config``), else 0.02 (the HF default)."""
    try:
        data = read_config_dict(model_dir)
    except (OSError, ValueError):
        return DEFAULT_INIT_STD
    for section in (data, data.get("text_config")):
        value = section.get("initializer_range") if isinstance(section, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return DEFAULT_INIT_STD


def tensor_seed(seed: int, name: str) -> int:
    """The seed of the random values of the tensor ``name`` under the model's ``seed``: the same on every rank and
    whatever other tensors the model holds."""
    return (seed * SEED_MIX + zlib.crc32(name.encode())) % SEED_RANGE


def init_dummy_weights(model: nn.Module, std: float = DEFAULT_INIT_STD, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer with seeded random values, on the device it lives on.

    Matrices and embeddings get normal(0, `std`) (the scale of a freshly initialized checkpoint, so activations
    and logits stay in a realistic range), norm weights 1 and biases 0. Tied tensors are filled once. The values
    are drawn by a generator on the model's device, so no host memory and no host-to-device copy is needed.
    A tensor-parallel rank draws each sharded tensor whole and keeps its slice: every rank count gets the weights
    of one rank, and the replicated tensors (norms, routers) are the same on every rank. Each tensor is drawn from
    its own stream, seeded by `seed` and its name (`tensor_seed`), so that an expert-parallel rank, which holds
    only some experts and so skips the others' draws, still gets the values one rank holding them all would.
    """
    targets, _ = _load_targets(model)
    if not targets:
        return
    norm_tensors = {
        id(tensor)
        for module in model.modules()
        if "Norm" in type(module).__name__
        for tensor in module.parameters(recurse=False)
    }
    device = next(iter(targets.values())).device
    generator = torch.Generator(device=device)
    owners = _owners(model)
    with torch.no_grad():
        for name, tensor in targets.items():
            if id(tensor) in norm_tensors:
                tensor.fill_(1.0)
            elif name.endswith("bias") or not tensor.is_floating_point():
                tensor.zero_()
            else:
                generator.manual_seed(tensor_seed(seed, name))
                owner = owners[name][0]
                shape = checkpoint_shape(owner, tensor)
                if shape == tuple(tensor.shape):
                    tensor.normal_(0.0, std, generator=generator)
                else:  # a tensor-parallel slice: draw the whole tensor, as one rank would, and keep this rank's
                    full = torch.empty(shape, dtype=tensor.dtype, device=device).normal_(0.0, std, generator=generator)
                    _load_into(owner, tensor, full)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class _SkipMetaInit(TorchFunctionMode):
    """Random initializers on meta tensors are dropped: they have no data to fill, but torch runs them through
    Python decompositions whose first use imports ``torch._dynamo`` (1-2 s of every CPU engine build)."""

    _INITIALIZERS = frozenset(
        {
            torch.Tensor.normal_,
            torch.Tensor.uniform_,
            nn.init.normal_,
            nn.init.uniform_,
            nn.init.trunc_normal_,
            nn.init.kaiming_uniform_,
            nn.init.kaiming_normal_,
        }
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._INITIALIZERS:
            target = args[0] if args else kwargs.get("tensor")  # `nn.init` passes its tensor by keyword
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_DTYPE_ALIASES = {
    "float": "float32",
    "fp32": "float32",
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
}


def resolve_dtype(dtype: torch.dtype | str | None, hf_config: object) -> torch.dtype:
    """An explicit dtype wins; else the checkpoint's ``torch_dtype``; else bfloat16."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = dtype if dtype not in (None, "auto") else getattr(hf_config, "torch_dtype", None) or "bfloat16"
    name = str(name).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"unsupported model dtype {dtype!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def materialize(model: nn.Module, device: torch.device | str) -> None:
    """Give a meta-device model real (uninitialized) storage on `device`, keeping tied parameters tied.

    ``Module.to_empty`` replaces each parameter separately, which would silently untie e.g. the LM head from
    the embedding; the aliases are recorded first and re-pointed at their shared parameter afterwards.
    Buffers come back uninitialized too: models must not keep derived state in non-persistent buffers (compute
    it lazily, as `RotaryEmbedding` does) or must load it from the checkpoint as persistent buffers.
    """
    first_name: dict[int, str] = {}
    ties: list[tuple[str, str]] = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            ties.append((name, first_name[id(param)]))
        else:
            first_name[id(param)] = name
    # `Module.to_empty` without its `empty_like`, whose meta-tensor path imports torch's symbolic shapes (about 1 s)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    for alias, canonical in ties:
        owner_name, _, leaf = alias.rpartition(".")
        setattr(model.get_submodule(owner_name), leaf, model.get_parameter(canonical))


def build_model(
    model_name: str,
    model_dir: str | Path,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str = "cpu",
    lora_path: str | Path | None = None,
    merge_lora: bool = False,
    load_format: str = "safetensors",
    seed: int = 0,
) -> nn.Module:
    """Read the checkpoint's config, build the registered model for `model_name` and load its weights.

    The model is first built on the meta device (no memory, no random init, which takes minutes for a
    multi-billion-parameter model on CPU), then materialized on `device` in `dtype` and filled by the strict
    loader, which guarantees every parameter is overwritten. The checkpoint is compared with the config
    (`check_config_against_weights`) before the model is built, and with the built meta model
    (`check_checkpoint_matches`) before any memory is allocated, both from the file headers alone.
    ``load_format="dummy"`` fills it instead with random weights drawn on `device` from `seed`
    (`init_dummy_weights`, std = the config's ``initializer_range``), reading no weight file. With
    `lora_path`, the PEFT adapter in that folder is then applied (`diffulex.lora.apply_lora`): merged into the
    weights if `merge_lora`, else added at every forward. Last, projections of the same input are joined for
    one-GEMM execution (`diffulex.layers.merge_projections`; names and values unchanged). Returned in eval mode.
    """
    check_choice("load_format", load_format, LOAD_FORMATS)
    tensors = None if load_format == "dummy" else checkpoint_tensors(model_dir)
    if tensors is not None:
        check_config_against_weights(read_config_dict(model_dir), tensors, model_dir)
    family = FAMILIES.get(model_name)
    hf_config = family.read_config(model_dir)
    model_cls = family.model
    torch_dtype = resolve_dtype(dtype, hf_config)
    with _default_dtype(torch_dtype), torch.device("meta"), _SkipMetaInit():
        model = model_cls(hf_config)
    if tensors is not None:
        check_checkpoint_matches(model, tensors, model_dir)
    materialize(model, device)
    if tensors is None:
        init_dummy_weights(model, _initializer_range(model_dir), seed)
    else:
        _copy_tensors(model, tensors, model_dir)
    if lora_path is not None:
        from diffulex.lora import apply_lora

        apply_lora(model, lora_path, merge=merge_lora)
    merge_projections(model)
    return model.eval()

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
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from torch.overrides import TorchFunctionMode

from diffulex.config import LOAD_FORMATS, check_choice
from diffulex.layers import merge_projections
from diffulex.models.hf_config import load_hf_config
from diffulex.registry import AutoModelForDiffusionLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: ``model.safetensors``, else the shards named by the index file,
    else every ``*.safetensors`` in the folder (sorted)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
    single = folder / SINGLE_FILE
    if single.is_file():
        return [single]
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} has no valid 'weight_map': {e}") from None
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise ValueError(f"{index} lists shards that are not in {folder}: {', '.join(missing)}")
        return shards
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
    hint = (
        f" (found {', '.join(pickles)}: pickle checkpoints are not loaded because unpickling can execute "
        "code; convert them to safetensors)"
        if pickles
        else ""
    )
    raise ValueError(f"{folder} has no safetensors weights{hint}")


def _checkpoint_shapes(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) from the file headers only (no tensor data is read)."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                if name in found:
                    raise ValueError(f"tensor {name!r} appears in both {found[name][0].name} and {path.name}")
                found[name] = (path, tuple(f.get_slice(name).get_shape()))
    return found


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


def load_checkpoint(model: nn.Module, model_dir: str | Path) -> None:
    """Copy the checkpoint's tensors into `model` (casting to each parameter's dtype and device).

    Raises ``ValueError`` listing tensors the model needs that the checkpoint lacks, tensors whose shapes
    differ (both shapes given), and checkpoint tensors the model has no place for, except those matching a
    regex in the model's ``ignored_checkpoint_keys`` and aliases of tied weights.
    """
    files = checkpoint_files(model_dir)
    available = _checkpoint_shapes(files)
    targets, aliases = _load_targets(model)
    ignored = [re.compile(p) for p in getattr(model, "ignored_checkpoint_keys", ())]

    missing = sorted(set(targets) - set(available))
    mismatched = [
        f"{name}: checkpoint {list(shape)} vs model {list(targets[name].shape)}"
        for name, (_, shape) in sorted(available.items())
        if name in targets and tuple(targets[name].shape) != shape
    ]
    unexpected = sorted(
        name
        for name in available
        if name not in targets and name not in aliases and not any(p.search(name) for p in ignored)
    )
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing)}")
    if mismatched:
        problems.append(f"shape mismatches: {'; '.join(mismatched)}")
    if unexpected:
        problems.append(f"unexpected tensors: {', '.join(unexpected)}")
    if problems:
        where = f"checkpoint {Path(model_dir)} does not match {type(model).__name__}"
        hint = getattr(model, "load_error_hint", "")
        if hint:
            problems.append(f"hint: {hint}")
        raise ValueError(f"{where}: " + " | ".join(problems))

    by_file: dict[Path, list[str]] = {}
    for name in targets:
        by_file.setdefault(available[name][0], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in names:
                    targets[name].copy_(f.get_tensor(name))


DEFAULT_INIT_STD = 0.02


def _initializer_range(model_dir: str | Path) -> float:
    """The checkpoint's ``initializer_range`` (top level or ``text_config``), else 0.02 (the HF default)."""
    try:
        data = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return DEFAULT_INIT_STD
    for section in (data, data.get("text_config")):
        value = section.get("initializer_range") if isinstance(section, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            return float(value)
    return DEFAULT_INIT_STD


def init_dummy_weights(model: nn.Module, std: float = DEFAULT_INIT_STD, seed: int = 0) -> None:
    """Fill every parameter and persistent buffer with seeded random values, on the device it lives on.

    Matrices and embeddings get normal(0, `std`) (the scale of a freshly initialized checkpoint, so activations
    and logits stay in a realistic range), norm weights 1 and biases 0. Tied tensors are filled once. The values
    are drawn by a generator on the model's device, so no host memory and no host-to-device copy is needed.
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
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, tensor in targets.items():
            if id(tensor) in norm_tensors:
                tensor.fill_(1.0)
            elif name.endswith("bias") or not tensor.is_floating_point():
                tensor.zero_()
            else:
                tensor.normal_(0.0, std, generator=generator)


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
    loader, which guarantees every parameter is overwritten. ``load_format="dummy"`` fills it instead with
    random weights drawn on `device` from `seed` (`init_dummy_weights`, std = the config's ``initializer_range``),
    reading no weight file. With `lora_path`, the PEFT adapter in that folder is then applied
    (`diffulex.lora.apply_lora`): merged into the weights if `merge_lora`, else added at every forward. Last,
    projections of the same input are joined for one-GEMM execution (`diffulex.layers.merge_projections`; names
    and values unchanged). Returned in eval mode.
    """
    check_choice("load_format", load_format, LOAD_FORMATS)
    hf_config = load_hf_config(model_dir, model_name)
    model_cls = AutoModelForDiffusionLM.get(model_name)
    torch_dtype = resolve_dtype(dtype, hf_config)
    with _default_dtype(torch_dtype), torch.device("meta"), _SkipMetaInit():
        model = model_cls(hf_config)
    materialize(model, device)
    if load_format == "dummy":
        init_dummy_weights(model, _initializer_range(model_dir), seed)
    else:
        load_checkpoint(model, model_dir)
    if lora_path is not None:
        from diffulex.lora import apply_lora

        apply_lora(model, lora_path, merge=merge_lora)
    merge_projections(model)
    return model.eval()

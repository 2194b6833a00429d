"""LoRA adapters in the PEFT folder format, applied to a loaded model: merged into the weights or added at
every forward.

A PEFT LoRA folder holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...) and
``adapter_model.safetensors`` with, for every adapted linear layer ``<module>``, the tensors
``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and ``base_model.model.<module>.lora_B.weight``
(``[out, r]``). ``<module>`` is the layer's name in the HF model, which is also its name here (every family keeps
the checkpoint's module names), e.g. ``model.layers.0.self_attn.q_proj`` for Dream or
``model.transformer.blocks.0.q_proj`` for LLaDA. The adapted layer computes ``W x + s * B (A x)`` with
``s = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``); merging adds ``s * B @ A`` to ``W`` once.
Dropout is a training-time operation and is ignored.

Over tensor-parallel ranks each rank keeps the part of the adapter its shard of the layer needs: a layer split by
its output features (q/k/v, gate/up, the LM head) its rows of ``B`` (``A`` whole, the delta its slice of the
output), a layer split by its input features (o, down) its columns of ``A`` (``B`` whole), whose product with the
rank's input is then a partial delta summed over the ranks like the layer's own product. The slices are the ones the
layer's ``weight_loader`` takes of its weight, so a fused matrix's parts and replicated K/V heads need nothing more.

Loading is strict, like the checkpoint loader: every problem (adapter tensors naming no layer of the model,
layers outside ``target_modules``, targets that match no layer, targeted layers without tensors, shapes that do
not fit) is collected and reported in one ``ValueError``, because an adapter that silently applies to part of a
model (or to none of it) produces plausible but wrong text.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from diffulex.layers import LMHead
from diffulex.layers.linear import RowParallelLinear
from diffulex.layers.moe import held_elsewhere, mixture_layers

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Names PEFT uses for the numbered layer list when matching ``layers_to_transform``.
_DEFAULT_LAYER_PATTERNS = ("layers", "h", "blocks", "layer", "block")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.(?P<adapter>[A-Za-z0-9_]+))?\.weight$")


@dataclass
class LoRAConfig:
    """The fields of ``adapter_config.json`` that decide what the adapter computes."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str | None
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: list[int] | None = None
    layers_pattern: list[str] | None = None
    modules_to_save: list[str] | None = None
    base_model_name_or_path: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> LoRAConfig:
        peft_type = d.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ValueError(f"{where}: peft_type={peft_type!r}; only LoRA adapters are supported")
        unsupported = []
        if d.get("use_dora"):
            unsupported.append("use_dora=true (DoRA)")
        if d.get("bias", "none") not in ("none", None):
            unsupported.append(f"bias={d.get('bias')!r} (trained biases)")
        if d.get("fan_in_fan_out"):
            unsupported.append("fan_in_fan_out=true (Conv1D layers)")
        if d.get("layer_replication"):
            unsupported.append("layer_replication")
        if unsupported:
            raise ValueError(f"{where}: not supported: {', '.join(unsupported)}")
        r, alpha = d.get("r", 8), d.get("lora_alpha", 8)
        if isinstance(r, bool) or not isinstance(r, int) or r <= 0:
            raise ValueError(f"{where}: 'r' must be a positive integer, got {r!r}")
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or alpha <= 0:
            raise ValueError(f"{where}: 'lora_alpha' must be a positive number, got {alpha!r}")
        targets = d.get("target_modules")
        if targets is not None and not isinstance(targets, str):
            if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
                raise ValueError(f"{where}: 'target_modules' must be a string or a list of strings, got {targets!r}")
        layers = d.get("layers_to_transform")
        if isinstance(layers, int) and not isinstance(layers, bool):
            layers = [layers]
        pattern = d.get("layers_pattern")
        if isinstance(pattern, str):
            pattern = [pattern]
        to_save = d.get("modules_to_save")
        return cls(
            r=r,
            lora_alpha=float(alpha),
            target_modules=targets,
            use_rslora=bool(d.get("use_rslora", False)),
            rank_pattern=dict(d.get("rank_pattern") or {}),
            alpha_pattern=dict(d.get("alpha_pattern") or {}),
            layers_to_transform=list(layers) if layers else None,
            layers_pattern=list(pattern) if pattern else None,
            modules_to_save=list(to_save) if to_save else None,
            base_model_name_or_path=d.get("base_model_name_or_path"),
        )

    # --- PEFT's name matching -----------------------------------------------------------------------------

    @staticmethod
    def _suffix_match(key: str, name: str) -> bool:
        return name == key or name.endswith("." + key)

    def target_matches(self, target: str, name: str) -> bool:
        """Does the list entry `target` select the module `name` (equal, or a dotted suffix)."""
        return self._suffix_match(target, name)

    def _layer_allowed(self, name: str) -> bool:
        if self.layers_to_transform is None:
            return True
        patterns = self.layers_pattern or list(_DEFAULT_LAYER_PATTERNS)
        for pattern in patterns:
            m = re.search(rf"(?:^|\.){re.escape(pattern)}\.(\d+)\.", name)
            if m:
                return int(m.group(1)) in self.layers_to_transform
        return False

    def targets(self, name: str, linear_names: set[str]) -> bool:
        """Whether the adapter config selects the linear layer `name` (PEFT semantics: a regex string must match
        the whole name; list entries match the name or a dotted suffix; ``"all-linear"`` selects every
        projection but not the LM head; ``layers_to_transform`` restricts to the listed layer indices)."""
        t = self.target_modules
        if t is None:
            return False
        if t == "all-linear":
            hit = name in linear_names
        elif isinstance(t, str):
            hit = re.fullmatch(t, name) is not None
        else:
            hit = any(self.target_matches(target, name) for target in t)
        return hit and self._layer_allowed(name)

    def _pattern_value(self, patterns: dict[str, Any], name: str) -> Any:
        for key, value in patterns.items():
            if name == key or re.fullmatch(rf"(?:.*\.)?{key}", name):
                return value
        return None

    def rank(self, name: str) -> int:
        value = self._pattern_value(self.rank_pattern, name)
        return int(value) if value is not None else self.r

    def scaling(self, name: str) -> float:
        rank = self.rank(name)
        alpha = self._pattern_value(self.alpha_pattern, name)
        alpha = float(alpha) if alpha is not None else self.lora_alpha
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


@dataclass
class LoRAModule:
    """The adapter of one linear layer: ``A [r, in]``, ``B [out, r]``, and the scale of ``B @ A``."""

    name: str
    lora_A: torch.Tensor
    lora_B: torch.Tensor
    scaling: float


def read_adapter(lora_path: str | Path) -> tuple[LoRAConfig, dict[str, torch.Tensor]]:
    """``adapter_config.json`` and the tensors of ``adapter_model.safetensors`` (keys as stored)."""
    folder = Path(lora_path)
    if not folder.is_dir():
        raise ValueError(f"LoRA adapter folder {folder} does not exist")
    config_path = folder / ADAPTER_CONFIG
    if not config_path.is_file():
        present = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise ValueError(f"{folder} is not a PEFT LoRA adapter: it has no {ADAPTER_CONFIG} (it holds: {present})")
    try:
        raw = json.loads(config_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_path} does not hold a JSON object")
    config = LoRAConfig.from_dict(raw, str(config_path))
    weights_path = folder / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt", ".pth"))
        hint = (
            f" (found {', '.join(pickles)}: pickle files are not loaded because unpickling can execute code; "
            "convert the adapter to safetensors)"
            if pickles
            else ""
        )
        raise ValueError(f"{folder} has no {ADAPTER_WEIGHTS}{hint}")
    return config, load_file(str(weights_path), device="cpu")


def _adaptable(model: nn.Module) -> dict[str, nn.Module]:
    """Modules a LoRA can wrap: every linear projection and the LM head, by name."""
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear | LMHead)}


def _module_name(key: str) -> str:
    return key[len(PEFT_PREFIX) :] if key.startswith(PEFT_PREFIX) else key


def resolve_adapter(model: nn.Module, config: LoRAConfig, tensors: dict[str, torch.Tensor]) -> list[LoRAModule]:
    """Match the adapter tensors to the model's layers; every mismatch is reported in one ``ValueError``."""
    adaptable = _adaptable(model)
    linear_names = {n for n, m in adaptable.items() if isinstance(m, nn.Linear)}
    found: dict[str, dict[str, torch.Tensor]] = {}
    saved_modules: list[tuple[str, torch.Tensor]] = []
    problems: list[str] = []
    unknown_keys: list[str] = []
    for key, tensor in tensors.items():
        m = _LORA_KEY.match(key)
        if m is None:
            name = _module_name(key)
            owner = name.rpartition(".")[0]
            if config.modules_to_save and any(config.target_matches(t, owner) for t in config.modules_to_save):
                saved_modules.append((name, tensor))
            else:
                unknown_keys.append(key)
            continue
        found.setdefault(_module_name(m.group("module")), {})[m.group("which")] = tensor
    if unknown_keys:
        problems.append(f"tensors that are not LoRA A/B weights: {', '.join(sorted(unknown_keys))}")

    elsewhere = mixture_layers(model)  # routed experts another expert-parallel rank holds: adapted there
    no_module = sorted(n for n in found if n not in adaptable and not held_elsewhere(n, elsewhere))
    if no_module:
        problems.append(f"adapter tensors for layers the model does not have: {', '.join(no_module)}")
    untargeted = sorted(n for n in found if n in adaptable and not config.targets(n, linear_names))
    if untargeted:
        problems.append(f"adapter tensors for layers outside target_modules={config.target_modules!r}: "
                        f"{', '.join(untargeted)}")
    if isinstance(config.target_modules, list):
        unmatched = [t for t in config.target_modules if not any(config.target_matches(t, n) for n in adaptable)]
        if unmatched:
            problems.append(f"target_modules that match no layer of the model: {', '.join(unmatched)}")
    elif config.target_modules is not None and not any(config.targets(n, linear_names) for n in adaptable):
        problems.append(f"target_modules={config.target_modules!r} matches no layer of the model")
    elif config.target_modules is None:
        problems.append("adapter_config.json names no target_modules")
    targeted = sorted(n for n in adaptable if config.targets(n, linear_names))
    without = [n for n in targeted if n not in found]
    if without:
        problems.append(f"targeted layers without adapter tensors: {', '.join(without)}")

    modules: list[LoRAModule] = []
    for name in sorted(found):
        if name not in adaptable:
            continue
        pair = found[name]
        if set(pair) != {"A", "B"}:
            have, lack = ("A", "B") if "A" in pair else ("B", "A")
            problems.append(f"{name}: has lora_{have} but not lora_{lack}")
            continue
        module = adaptable[name]
        out_features, in_features = _whole_shape(module)
        a, b = pair["A"], pair["B"]
        rank = config.rank(name)
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            problems.append(
                f"{name}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit the layer "
                f"[{out_features}, {in_features}] with r={rank} (expected A [{rank}, {in_features}], "
                f"B [{out_features}, {rank}])"
            )
            continue
        if isinstance(module, LMHead) and any(
            p is module.weight and n != f"{name}.weight" for n, p in model.named_parameters(remove_duplicate=False)
        ):
            problems.append(f"{name}: the LM head is tied to the embedding; LoRA on a tied head is not supported")
            continue
        modules.append(LoRAModule(name, a, b, config.scaling(name)))

    params = dict(model.named_parameters())
    for name, tensor in saved_modules:
        if name not in params:
            problems.append(f"modules_to_save tensor {name} names no parameter of the model")
        elif tuple(params[name].shape) != tuple(tensor.shape):
            problems.append(f"modules_to_save tensor {name}: {list(tensor.shape)} vs model "
                            f"{list(params[name].shape)}")
    if problems:
        raise ValueError(f"LoRA adapter does not match {type(model).__name__}: " + " | ".join(problems))
    with torch.no_grad():
        for name, tensor in saved_modules:
            params[name].copy_(tensor)
    return modules


def _whole_shape(module: nn.Module) -> tuple[int, int]:
    """``(out, in)`` of the layer's whole weight, also where a tensor-parallel rank holds a slice of it."""
    shape_of = getattr(module, "checkpoint_shape", None)
    out_features, in_features = shape_of(module.weight) if shape_of is not None else module.weight.shape
    return out_features, in_features


def _rank_part(module: nn.Module, lora: LoRAModule) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A, B)`` as this rank's shard of ``module`` needs them (the module docstring): the rows of ``B`` of a
    layer split by output features, the columns of ``A`` of one split by input features, both whole otherwise;
    sliced by the layer's own ``weight_loader``, as its weight was."""
    held_out, held_in = module.weight.shape
    out_features, in_features = _whole_shape(module)
    a, b = lora.lora_A, lora.lora_B
    if held_out != out_features:
        part = torch.empty(held_out, b.shape[1], dtype=b.dtype)
        module.weight_loader(part, b)
        b = part
    if held_in != in_features:
        part = torch.empty(a.shape[0], held_in, dtype=a.dtype)
        module.weight_loader(part, a)
        a = part
    return a, b


def _lora_forward_hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
    x = inputs[0]
    delta = nn.functional.linear(nn.functional.linear(x.to(module.lora_A.dtype), module.lora_A), module.lora_B)
    if isinstance(module, RowParallelLinear):  # this rank's input columns: a partial delta, summed like the output
        delta = module.tp.all_reduce(delta)
    return output + (module.lora_scaling * delta).to(output.dtype)


def apply_lora(model: nn.Module, lora_path: str | Path, merge: bool = False) -> list[str]:
    """Apply the PEFT LoRA adapter in `lora_path` to `model` (already loaded); returns the adapted layer names.

    ``merge=True``: ``W += s * B @ A`` (computed in float32, then cast to the weight's dtype); the model is then
    an ordinary model with new weights. ``merge=False``: the layer keeps ``W`` and adds ``s * B (A x)`` to its
    output at every forward (A and B are non-persistent buffers of the layer, in the weight's dtype, so
    ``state_dict`` still holds exactly the base weights).
    """
    config, tensors = read_adapter(lora_path)
    modules = resolve_adapter(model, config, tensors)
    adaptable = _adaptable(model)
    for lora in modules:
        module = adaptable[lora.name]
        if hasattr(module, "lora_A"):
            raise ValueError(f"{lora.name} already carries a LoRA adapter; apply one adapter per model")
    with torch.no_grad():
        for lora in modules:
            module = adaptable[lora.name]
            weight = module.weight
            a, b = _rank_part(module, lora)
            if merge:
                delta = lora.scaling * (b.float() @ a.float())
                weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))
            else:
                module.register_buffer("lora_A", a.to(weight.device, weight.dtype), persistent=False)
                module.register_buffer("lora_B", b.to(weight.device, weight.dtype), persistent=False)
                module.lora_scaling = lora.scaling
                module.register_forward_hook(_lora_forward_hook)
    model.lora_modules = [m.name for m in modules]
    model.lora_merged = merge
    return [m.name for m in modules]

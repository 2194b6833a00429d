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
model (or to none of it) produces plausible but wrong text. Before that, every field of ``adapter_config.json`` is
checked where it is read (`LoRAConfig.from_dict`: type and range, each error naming the file and the field), the
tensors must be finite floats of one adapter (the file and the tensor named), and each layer's scale and delta
must fit the dtypes they are applied in (`_scale_problem`): a NaN or Inf there would make every logit NaN.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from diffulex.layers import LMHead
from diffulex.layers.linear import RowParallelLinear
from diffulex.layers.moe import held_elsewhere, mixture_layers
from diffulex.validation import is_int, is_number, shown_value

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
# Names PEFT uses for the numbered layer list when matching ``layers_to_transform``.
_DEFAULT_LAYER_PATTERNS = ("layers", "h", "blocks", "layer", "block")
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>A|B)(?:\.(?P<adapter>[A-Za-z0-9_]+))?\.weight$")
# The scale is a Python float multiplied into float32 (merging) or the weight's dtype (per forward), where the
# computation runs in float32: outside float32's normal range it turns into Inf or a (near) zero, so that the model
# decodes nothing or silently runs without the adapter.
_FLOAT32 = torch.finfo(torch.float32)
# Tensors named in one error at most; the count of the others follows.
_LISTED = 10


def _invalid(where: str, name: str, value: Any, requirement: str) -> ValueError:
    """The project's ``name=value is invalid: requirement``, prefixed by the file."""
    return ValueError(f"{where}: {name}={shown_value(value)} is invalid: {requirement}")


def _flag(d: dict[str, Any], name: str, where: str) -> bool:
    value = d.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise _invalid(where, name, value, "must be true or false")
    return value


def _positive_int(where: str, name: str, value: Any) -> int:
    if not is_int(value) or value <= 0:
        raise _invalid(where, name, value, "must be an integer > 0")
    return value


def _positive_finite(where: str, name: str, value: Any) -> float:
    try:
        number = float(value) if is_number(value) else math.nan
    except OverflowError:  # an int beyond float's range
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise _invalid(where, name, value, "must be a finite number > 0")
    return number


def _regex_problem(pattern: str) -> str | None:
    """Why `pattern` is not a regular expression Python compiles, or None."""
    try:
        re.compile(pattern)
    except re.error as e:
        return e.msg
    except (RecursionError, OverflowError):
        return "nested or repeated too deeply"
    return None


def _pattern_regex(key: str) -> str:
    """PEFT's match of a ``rank_pattern``/``alpha_pattern`` key (``get_pattern_key``): the key as a regex, matching
    the whole name or a dotted suffix of it, alternatives included."""
    return rf"(?:.*\.)?(?:{key})"


def _patterns(d: dict[str, Any], name: str, where: str, check: Any, kind: str) -> dict[str, Any]:
    """``rank_pattern``/``alpha_pattern``: a mapping of module-name regexes to values that `check` validates."""
    value = d.get(name)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _invalid(where, name, value, f"must be a mapping of module-name patterns to {kind}")
    out = {}
    for key, item in value.items():
        problem = "it is empty" if key == "" else _regex_problem(_pattern_regex(key))
        if problem is not None:
            raise ValueError(
                f"{where}: {name} has the key {shown_value(key)}, which is not a valid regular expression "
                f"({problem}); PEFT matches each key to a module name's dotted suffix as a regex"
            )
        out[key] = check(where, f"{name}[{shown_value(key)}]", item)
    return out


def _module_selection(d: dict[str, Any], name: str, where: str, keywords: str = "") -> list[str] | str | None:
    """A PEFT module selection (``target_modules``, ``exclude_modules``): a regular expression over whole module
    names, a list of module names (each matching a name or its dotted suffix), or one of ``keywords``."""
    value = d.get(name)
    if isinstance(value, str):
        problem = None if value == "all-linear" and keywords else _regex_problem(value)
        if problem is not None:
            raise _invalid(where, name, value, f"not a valid regular expression ({problem}); a string is matched "
                           "to whole module names as a regex")  # fmt: skip
    elif value is not None and (not isinstance(value, list) or not all(isinstance(t, str) and t for t in value)):
        raise _invalid(where, name, value,
                       f"must be a regular expression, {keywords}or a list of module names (non-empty strings)")
    return value


@dataclass
class LoRAConfig:
    """The fields of ``adapter_config.json`` that decide what the adapter computes."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str | None
    exclude_modules: list[str] | str | None = None
    use_rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    layers_to_transform: list[int] | None = None
    layers_pattern: list[str] | None = None
    modules_to_save: list[str] | None = None
    base_model_name_or_path: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> LoRAConfig:
        """Read and check every field this engine acts on; a bad value is a ``ValueError`` naming `where` (the
        file), the field, the value and what is allowed."""
        peft_type = d.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise ValueError(f"{where}: peft_type={shown_value(peft_type)}; only LoRA adapters are supported")
        bias = d.get("bias", "none")
        if bias is not None and bias not in ("none", "all", "lora_only"):
            raise _invalid(where, "bias", bias, "must be 'none' (PEFT's 'all' and 'lora_only' are not supported)")
        unsupported = []
        if _flag(d, "use_dora", where):
            unsupported.append("use_dora=true (DoRA)")
        if bias not in ("none", None):
            unsupported.append(f"bias={bias!r} (trained biases)")
        if _flag(d, "lora_bias", where):
            unsupported.append("lora_bias=true (trained biases)")
        if _flag(d, "fan_in_fan_out", where):
            unsupported.append("fan_in_fan_out=true (Conv1D layers)")
        if d.get("layer_replication"):
            unsupported.append("layer_replication")
        # adapters of raw parameters (MoE experts' stacked weights), trained embedding rows, and activated LoRA
        # (the adapter switched on after invocation tokens) each compute something the merged layers do not
        for name, what in (("target_parameters", "adapted parameters"),
                           ("trainable_token_indices", "trained token embeddings"),
                           ("alora_invocation_tokens", "activated LoRA")):  # fmt: skip
            if d.get(name):
                unsupported.append(f"{name} ({what})")
        if unsupported:
            raise ValueError(f"{where}: not supported: {', '.join(unsupported)}")
        # PEFT's defaults where a field is absent: r=8, lora_alpha=8
        r = _positive_int(where, "r", d.get("r", 8))
        alpha = _positive_finite(where, "lora_alpha", d.get("lora_alpha", 8))

        targets = _module_selection(d, "target_modules", where, "'all-linear', ")
        excluded = _module_selection(d, "exclude_modules", where)

        layers = d.get("layers_to_transform")
        if layers is not None:
            as_list = [layers] if is_int(layers) else layers
            if not isinstance(as_list, list) or not as_list or not all(is_int(i) and i >= 0 for i in as_list):
                raise _invalid(where, "layers_to_transform", layers,
                               "must be a layer index (an integer >= 0) or a non-empty list of them (an empty list "
                               "selects no layer)")  # fmt: skip
            layers = as_list
        pattern = d.get("layers_pattern")
        if pattern is not None:
            as_list = [pattern] if isinstance(pattern, str) else pattern
            if not isinstance(as_list, list) or not all(isinstance(p, str) and p for p in as_list):
                raise _invalid(where, "layers_pattern", pattern,
                               "must be the name of the numbered layer list (e.g. 'layers') or a list of such "
                               "names")  # fmt: skip
            pattern = as_list
        to_save = d.get("modules_to_save")
        if to_save is not None and (
            not isinstance(to_save, list) or not all(isinstance(m, str) and m for m in to_save)
        ):
            raise _invalid(where, "modules_to_save", to_save, "must be a list of module names, e.g. ['lm_head']")
        base_model = d.get("base_model_name_or_path")
        if base_model is not None and not isinstance(base_model, str):
            raise _invalid(where, "base_model_name_or_path", base_model, "must be a string")
        return cls(
            r=r,
            lora_alpha=alpha,
            target_modules=targets,
            exclude_modules=excluded or None,
            use_rslora=_flag(d, "use_rslora", where),
            rank_pattern=_patterns(d, "rank_pattern", where, _positive_int, "ranks (integers > 0)"),
            alpha_pattern=_patterns(d, "alpha_pattern", where, _positive_finite, "alphas (finite numbers > 0)"),
            layers_to_transform=layers,
            layers_pattern=pattern or None,
            modules_to_save=to_save or None,
            base_model_name_or_path=base_model,
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
        else:
            hit = self._selects(t, name)
        excluded = self.exclude_modules is not None and self._selects(self.exclude_modules, name)
        return hit and not excluded and self._layer_allowed(name)

    def _selects(self, selection: list[str] | str, name: str) -> bool:
        """PEFT's module selection: a string is a regex over the whole name, a list's entries name or suffix it."""
        if isinstance(selection, str):
            return re.fullmatch(selection, name) is not None
        return any(self.target_matches(entry, name) for entry in selection)

    def _pattern_key(self, patterns: dict[str, Any], name: str) -> str | None:
        """The first key of `patterns` that selects `name`, as PEFT's ``get_pattern_key`` picks it."""
        for key in patterns:
            if re.fullmatch(_pattern_regex(key), name):
                return key
        return None

    def rank(self, name: str) -> int:
        key = self._pattern_key(self.rank_pattern, name)
        return int(self.rank_pattern[key]) if key is not None else self.r

    def scaling(self, name: str) -> float:
        rank = self.rank(name)
        key = self._pattern_key(self.alpha_pattern, name)
        alpha = float(self.alpha_pattern[key]) if key is not None else self.lora_alpha
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def describe_scaling(self, name: str) -> str:
        """``lora_alpha / r = 16 / 8 = 2``, naming where each term comes from (a pattern's key where one applies)."""
        alpha_key, rank_key = self._pattern_key(self.alpha_pattern, name), self._pattern_key(self.rank_pattern, name)
        alpha_name = "lora_alpha" if alpha_key is None else f"alpha_pattern[{shown_value(alpha_key)}]"
        rank_name = "r" if rank_key is None else f"rank_pattern[{shown_value(rank_key)}]"
        rank = self.rank(name)
        alpha = self.lora_alpha if alpha_key is None else float(self.alpha_pattern[alpha_key])
        if self.use_rslora:
            return f"{alpha_name} / sqrt({rank_name}) = {alpha:g} / sqrt({rank}) = {self.scaling(name):.4g}"
        return f"{alpha_name} / {rank_name} = {alpha:g} / {rank} = {self.scaling(name):.4g}"


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
    raw = _read_json(config_path)
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
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{weights_path} cannot be read as safetensors: {e}") from None
    _check_adapter_names(tensors, weights_path)
    _check_values(tensors, weights_path)
    return config, tensors


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; anything else (unreadable, not UTF-8, not JSON, nested past the parser's
    recursion limit, not an object) is a ``ValueError`` naming the file."""
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{path} could not be read: it is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})"
        ) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{path} could not be read: its lists or objects are nested too deeply") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return data


def _listed(items: list[str]) -> str:
    more = f"; and {len(items) - _LISTED} more" if len(items) > _LISTED else ""
    return "; ".join(items[:_LISTED]) + more


def _check_adapter_names(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """One adapter per file: PEFT saves an adapter's keys without its name (``lora_A.weight``); a model's raw
    ``state_dict`` names it (``lora_A.default.weight``). Keys of two names (or named and unnamed) are two adapters
    meant for the same layers, and taking either one silently would serve a model nobody asked for."""
    names = {m.group("adapter") for m in map(_LORA_KEY.match, tensors) if m is not None}
    if len(names) > 1:
        shown = ", ".join(repr(n) if n is not None else "unnamed (lora_A.weight)" for n in
                          sorted(names, key=lambda n: (n is not None, n or "")))  # fmt: skip
        raise ValueError(
            f"{path} holds the tensors of {len(names)} adapters ({shown}); one adapter is applied at a time: save "
            "each to its own folder (PEFT: save_pretrained(..., selected_adapters=[name]))"
        )


def _check_values(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Every tensor must hold finite floating-point values: NaN or Inf in ``A`` or ``B`` makes every logit NaN
    (the engine would decode nothing), and integer or complex values are no trained adapter."""
    not_float = [f"{key} ({t.dtype})" for key, t in tensors.items() if not t.is_floating_point()]
    if not_float:
        raise ValueError(f"{path} has tensors that are not floating point: {_listed(not_float)}")
    non_finite = []
    for key, tensor in tensors.items():
        if tensor.numel() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            non_finite.append(f"{key} ({bad} of {tensor.numel()} values)")
    if non_finite:
        raise ValueError(
            f"{path} has non-finite values (NaN or Inf), which make the adapted model's output meaningless: "
            f"{_listed(non_finite)}"
        )


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
        layers = "" if config.layers_to_transform is None else f" / layers_to_transform={config.layers_to_transform}"
        if config.exclude_modules is not None:
            layers += f" / exclude_modules={config.exclude_modules!r}"
        problems.append(f"adapter tensors for layers outside target_modules={config.target_modules!r}{layers}: "
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
        scale_problem = _scale_problem(name, config, a, b, module.weight.dtype)
        if scale_problem:
            problems.append(scale_problem)
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


def _scale_problem(name: str, config: LoRAConfig, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> str:
    """Why the layer's delta ``s · B @ A`` cannot be applied, or "".

    The scale must lie in float32's normal range, where it is applied (beyond it, it is Inf: every logit NaN; below
    it, a (near) zero: the adapter silently vanishes). The delta's entries must fit the layer's dtype: merged,
    a larger one is an Inf weight; per forward, an Inf activation. Cauchy-Schwarz bounds each entry by
    ``s · max row norm of B · max column norm of A``, which costs a pass over A and B; only where that bound exceeds
    the dtype's range is the delta computed, to decide exactly."""
    scale = config.scaling(name)
    if not _FLOAT32.tiny <= scale <= _FLOAT32.max:
        return (f"{name}: the scale {config.describe_scaling(name)} is outside float32's range "
                f"[{_FLOAT32.tiny:.3g}, {_FLOAT32.max:.3g}], in which it is applied")  # fmt: skip
    limit = torch.finfo(dtype).max if dtype.is_floating_point else _FLOAT32.max
    a64, b64 = a.double(), b.double()
    bound = scale * b64.norm(dim=1).max().item() * a64.norm(dim=0).max().item()
    if bound <= limit:
        return ""
    peak = scale * max((rows @ a64).abs().max().item() for rows in b64.split(4096))  # a bounded temporary
    if peak <= limit:
        return ""
    dtype_name = str(dtype).removeprefix("torch.")
    return (f"{name}: s·B@A reaches {peak:.3g}, beyond the largest {dtype_name} value {limit:.3g} "
            f"(s = {config.describe_scaling(name)})")  # fmt: skip


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

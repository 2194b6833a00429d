"""Whether a model splits over the engine's ranks (tensor- and expert-parallel), checked before any worker starts.

Why beforehand: the shapes are known from config.json, and a count that does not divide them would otherwise
surface as a failed build inside a worker. The named fields get an error naming them; then the family's model is
built on the meta device over the rank counts (no memory), so that every layer's own split is tried as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from diffulex.layers.parallel_state import (
    ExpertParallelGroup,
    TensorParallelGroup,
    using_expert_parallel_group,
    using_tensor_parallel_group,
)
from diffulex.models.family import FAMILIES

if TYPE_CHECKING:
    from diffulex.config import Config

# config fields (any family's spelling) each tensor-parallel rank holds an equal slice of
SPLIT_FIELDS = ("num_attention_heads", "n_heads", "intermediate_size", "mlp_hidden_size", "moe_intermediate_size")
# routed experts' width: split by tensor parallelism only where expert parallelism does not place experts whole
EXPERT_WIDTH_FIELD = "moe_intermediate_size"
# K/V head counts: an equal slice, or each head replicated on whole ranks
KV_HEAD_FIELDS = ("num_key_value_heads", "n_kv_heads")
# the routed expert count (every MoE family's spelling)
EXPERT_COUNT_FIELD = "num_experts"


def parallel_fields(config: Config) -> str:
    """The settings that ask for more than one rank, as the errors name them."""
    named = [f"{name}={getattr(config, name)}" for name in ("tensor_parallel_size", "expert_parallel_size")]
    return " and ".join(n for n in named if not n.endswith("=1")) or named[0]


def check_parallel_layout(config: Config) -> None:
    """Raise ``ValueError`` naming the field when ``config.model`` cannot run over the engine's ranks: its family
    or decoding strategy does not follow rank 0's steps, its shapes do not split over ``tensor_parallel_size``, or
    (``expert_parallel_size > 1``) it has no experts or their count does not split over the expert ranks."""
    asked = parallel_fields(config)
    family = FAMILIES.get(config.model_name)
    if not family.tensor_parallel:
        raise ValueError(
            f"{asked} is invalid for model_name={config.model_name!r}: this family runs on one device (its layers "
            "are not split across ranks yet); use tensor_parallel_size=1 and expert_parallel_size=1"
        )
    from diffulex.strategy.strategy import Strategy

    strategy = config.strategy
    if type(strategy).make_runner is not Strategy.make_runner and not strategy.runner_follows_ranks:
        raise ValueError(
            f"{asked} is invalid with decoding_strategy={config.decoding_strategy!r}: it runs its own step runner, "
            "which does not follow rank 0's steps; use one rank"
        )
    hf_config = family.read_config(config.model)
    if config.tensor_parallel_size > 1:
        _check_tensor_split(config, hf_config)
    if config.expert_parallel_size > 1:
        _check_expert_split(config, hf_config)
    tensor = TensorParallelGroup(0, config.tensor_parallel_size)
    expert = ExpertParallelGroup(0, config.expert_parallel_size)
    with using_tensor_parallel_group(tensor), using_expert_parallel_group(expert), torch.device("meta"):
        model = family.model(hf_config)
    if config.expert_parallel_size > 1:
        from diffulex.layers.moe import ExpertLayer

        if not any(isinstance(m, ExpertLayer) for m in model.modules()):
            raise ValueError(
                f"expert_parallel_size={config.expert_parallel_size} is invalid for model_name="
                f"{config.model_name!r}: {config.model} has no mixture-of-experts layers to split; use "
                "expert_parallel_size=1"
            )


def _check_tensor_split(config: Config, hf_config: object) -> None:
    size = config.tensor_parallel_size
    for name in SPLIT_FIELDS:
        if name == EXPERT_WIDTH_FIELD and config.expert_parallel_size > 1:
            continue
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value % size:
            raise ValueError(
                f"{name}={value} (config.json of {config.model}) is invalid for tensor_parallel_size={size}: must "
                "be divisible by it, since every rank holds an equal slice"
            )
    for name in KV_HEAD_FIELDS:
        value = getattr(hf_config, name, None)
        if isinstance(value, int) and value % size and size % value:
            raise ValueError(
                f"{name}={value} (config.json of {config.model}) is invalid for tensor_parallel_size={size}: must "
                "be divisible by it, or divide it (each K/V head then replicated on whole ranks)"
            )


def _check_expert_split(config: Config, hf_config: object) -> None:
    size = config.expert_parallel_size
    value = getattr(hf_config, EXPERT_COUNT_FIELD, None)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(
            f"expert_parallel_size={size} is invalid for model_name={config.model_name!r}: {config.model} has no "
            f"routed experts ({EXPERT_COUNT_FIELD} is {value!r} in its config.json); use expert_parallel_size=1"
        )
    if value % size:
        raise ValueError(
            f"{EXPERT_COUNT_FIELD}={value} (config.json of {config.model}) is invalid for expert_parallel_size="
            f"{size}: must be divisible by it, since every rank holds an equal contiguous range of the experts"
        )

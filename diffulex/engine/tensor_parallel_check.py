"""Whether a model splits over a tensor-parallel rank count, checked before any worker process starts.

Why beforehand: the shapes are known from config.json, and a count that does not divide them would otherwise
surface as a failed build inside a worker. The named fields get an error naming them; then the family's model is
built on the meta device over the rank count (no memory), so that every layer's own split is tried as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from diffulex.layers.parallel_state import TensorParallelGroup, using_tensor_parallel_group
from diffulex.models.family import FAMILIES

if TYPE_CHECKING:
    from diffulex.config import Config

# config fields (any family's spelling) each rank holds an equal slice of
SPLIT_FIELDS = ("num_attention_heads", "n_heads", "intermediate_size", "mlp_hidden_size", "moe_intermediate_size")
# K/V head counts: an equal slice, or each head replicated on whole ranks
KV_HEAD_FIELDS = ("num_key_value_heads", "n_kv_heads")


def check_tensor_parallel(config: Config) -> None:
    """Raise ``ValueError`` naming the field when ``config.model`` cannot be split over
    ``config.tensor_parallel_size`` ranks, or its family or decoding strategy does not run tensor-parallel."""
    size = config.tensor_parallel_size
    family = FAMILIES.get(config.model_name)
    if not family.tensor_parallel:
        raise ValueError(
            f"tensor_parallel_size={size} is invalid for model_name={config.model_name!r}: this family runs on one "
            "device (its layers are not split across ranks yet); use tensor_parallel_size=1"
        )
    from diffulex.strategy.strategy import Strategy

    strategy = config.strategy
    if type(strategy).make_runner is not Strategy.make_runner:
        raise ValueError(
            f"tensor_parallel_size={size} is invalid with decoding_strategy={config.decoding_strategy!r}: it runs "
            "its own step runner, which does not follow rank 0's steps; use tensor_parallel_size=1"
        )
    # whether the strategy mixes embeddings matters here, not the mask token its settings will carry
    if strategy.soft_inputs(config.strategy_options, config.mask_token_id or 0) is not None:
        raise ValueError(
            f"tensor_parallel_size={size} is invalid with decoding_strategy={config.decoding_strategy!r} and its "
            "soft inputs (token merge mixes rows of the whole embedding); use tensor_parallel_size=1 or "
            "token_merge_weight=0"
        )
    if config.use_lora:
        raise ValueError(
            f"tensor_parallel_size={size} is invalid with use_lora=True: adapters are not split across ranks yet"
        )
    hf_config = family.read_config(config.model)
    for name in SPLIT_FIELDS:
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
    with using_tensor_parallel_group(TensorParallelGroup(0, size)), torch.device("meta"):
        family.model(hf_config)

"""What computing a run of prompt rows costs, in row equivalents, so that a chunked prompt is cut by cost, not rows.

A prompt row pays for the linear layers once, whatever its position, and for attention once per key it reads. Late
in a long prompt the second term dominates: a chunk of ``R`` rows after 30k cached tokens reads 30k keys per row
and layer, so the same ``R`` rows take several times longer than after 1k. A fixed row budget is then either too
small early (the prompt takes needlessly many steps) or too large late (the decoders beside it wait).

The unit is one row with no context: ``R`` rows after ``C`` cached tokens cost ``R * (1 + C_mean / C_parity)``,
where ``C_mean = C + R / 2`` is the mean number of keys a row of the run reads (the context, and under block-causal
attention about half the run itself), and ``C_parity`` is the context at which a row's attention flops equal its
linear-layer flops. Per layer and row, counted in multiply-adds (flops are twice that on both sides):

* linear layers: the q, k, v projections ``hidden * (heads + 2 * kv_heads) * head_dim``, the output projection
  ``heads * head_dim * hidden``, and the MLP: dense ``3 * hidden * intermediate`` (gate, up, down), or in a
  mixture-of-experts layer the router ``hidden * num_experts`` plus ``3 * hidden * moe_intermediate`` for each of
  the ``experts_per_token`` routed experts and each shared expert;
* attention, per key: ``2 * heads * head_dim`` (the score ``q . k`` and the weighted sum of ``v``).

``C_parity`` is the sum over the layers of the first divided by the sum of the second (the layer count cancels when
every layer is alike). The LM head is not counted: a prompt chunk samples nothing. For the SDAR-1.7B geometry
(hidden 2048, 16 heads, 8 K/V heads of 128, intermediate 6144) it is 12,288 tokens: a row after 32k cached tokens
costs about 3.6 rows after none. The model counts flops, not time; `diffulex.bench.sweep_prefill` fits the
measured chunk steps to it and reports the parity the hardware shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PrefillCostModel:
    """Row equivalents of prompt rows at a context; one model per engine, from its checkpoint's sizes."""

    parity_context: float  # C_parity: the context at which a row's attention flops equal its linear flops

    def __post_init__(self) -> None:
        if not self.parity_context > 0 or not math.isfinite(self.parity_context):
            raise ValueError(f"parity_context={self.parity_context!r} is invalid: must be a positive finite number")

    def rows_cost(self, rows: int, context: int) -> float:
        """Row equivalents of computing ``rows`` prompt rows whose first one sits after ``context`` cached tokens."""
        if rows <= 0:
            return 0.0
        mean_keys = context + rows / 2
        return rows * (1.0 + mean_keys / self.parity_context)

    def rows_within(self, cost: float, context: int) -> int:
        """The most rows after ``context`` cached tokens whose cost is at most ``cost`` (0 when not even one row's).

        The cost is ``R**2 / (2 P) + R * (1 + C / P)`` for parity ``P``: the positive root of that quadratic, rounded
        down (and checked against `rows_cost`, so that rounding never lets a row too many through).
        """
        if cost <= 0:
            return 0
        p = self.parity_context
        linear = 1.0 + context / p
        rows = math.floor(p * (math.sqrt(linear * linear + 2.0 * cost / p) - linear))
        while rows > 0 and self.rows_cost(rows, context) > cost:
            rows -= 1
        while self.rows_cost(rows + 1, context) <= cost:
            rows += 1
        return rows

    @classmethod
    def from_model_config(cls, config: Any) -> PrefillCostModel:
        """From a family's typed config (`diffulex.models.family.Family.read_config`): the HF-style size names
        (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
        ``intermediate_size``, or LLaDA's ``mlp_hidden_size``) and, for mixture-of-experts layers
        (``is_sparse_layer``), ``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size`` and
        ``num_shared_experts``. A missing size is a ValueError naming it."""
        hidden = _size(config, "hidden_size")
        layers = _size(config, "num_hidden_layers")
        heads = _size(config, "num_attention_heads")
        kv_heads = _size(config, "num_key_value_heads")
        head_dim = _size(config, "head_dim")
        projections = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
        sparse = getattr(config, "is_sparse_layer", None)
        linear = 0
        for index in range(layers):
            if sparse is not None and sparse(index):
                experts = _size(config, "num_experts_per_tok") + (getattr(config, "num_shared_experts", 0) or 0)
                router = hidden * _size(config, "num_experts")
                mlp = router + 3 * hidden * _size(config, "moe_intermediate_size") * experts
            else:
                mlp = 3 * hidden * _dense_intermediate(config)
            linear += projections + mlp
        attention_per_key = layers * 2 * heads * head_dim
        return cls(linear / attention_per_key)


def _size(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"the model's config ({type(config).__name__}) has {name}={value!r}: the prefill cost model needs a "
            "positive integer there"
        )
    return value


def _dense_intermediate(config: Any) -> int:
    """The dense MLP's width: ``intermediate_size``, or ``mlp_hidden_size`` in LLaDA's (OLMo) config."""
    name = "intermediate_size" if getattr(config, "intermediate_size", None) is not None else "mlp_hidden_size"
    return _size(config, name)

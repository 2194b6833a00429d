"""The hardware floor of one engine step: bytes that must move and flops that must be done, over measured peaks.

A decode step of a block-diffusion model reads every weight once (the forward is one pass over the layers, no
matter how many query tokens it carries), reads the cached K/V of every request, writes the K/V of the blocks it
commits, and does ``2 x parameters`` flops per query token in the linear layers plus the attention scores. Its
time can be no lower than ``bytes / copy bandwidth`` (the memory floor) nor ``flops / matmul throughput`` (the
compute floor); the ratio of the measured time to the larger floor says how far the engine is from the hardware.

A mixture-of-experts layer reads only the experts its step's rows choose: with ``T`` rows each picking ``k`` of
``E`` experts, about ``E * (1 - (1 - k / E) ** T)`` distinct experts under uniform routing. Real routing is
skewed (random weights send most rows to a few experts, a trained router has its own preferences), so fewer are
read and that estimate overstates the floor; where the experts each step selected were counted
(`diffulex.bench.expert_use`), `step_bytes` takes the count instead. Each row multiplies through its ``k`` experts
only. Under expert parallelism a rank holds ``H`` of the ``E`` experts and its floor is
its own share: ``H * (1 - (1 - k / E) ** T)`` distinct experts read, ``k * H / E`` expert products per row (every
rank computes the rest of the step whole, or its tensor-parallel slice of it). The floors are per rank: the model
a rank holds is what its step must read.

Everything here is plain arithmetic on a `CostModel` (the model's sizes, counted once) and a `StepWork` (what one
step computed, read from the engine's step records), so it is unit-tested by hand on a tiny configuration.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class CostModel:
    """The sizes of a model that set the cost of one step, in elements (multiply by ``itemsize`` for bytes)."""

    trunk_linear_params: int  # every linear weight of the decoder layers (q, k, v, o, gate, up, down, ...)
    lm_head_params: int  # vocab x hidden: read in full every step, multiplied only for the sampled rows
    other_params: int  # norm weights and biases: read every step, negligible flops
    embedding_row: int  # hidden size: the embedding table is only gathered, one row per query token
    kv_per_token: int  # K + V elements of one token over all layers: 2 x layers x kv_heads x head_dim
    attn_flops_per_pair: int  # flops of one (query, key) pair over all layers: 4 x layers x heads x head_dim
    itemsize: int  # bytes per element of weights and KV cache
    # routed experts (MoE layers), not in trunk_linear_params: per layer `num_experts` of `expert_params` each,
    # `experts_per_token` chosen per row
    moe_layers: int = 0
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    held_experts: int | None = None  # experts of each MoE layer this rank holds (expert parallelism); None: all

    @property
    def held_share(self) -> float:
        """The share of each MoE layer's experts this rank holds (1 without expert parallelism)."""
        if not self.num_experts or self.held_experts is None:
            return 1.0
        return self.held_experts / self.num_experts

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights every step reads whatever its rows (routed experts and the embedding excluded)."""
        return (self.trunk_linear_params + self.lm_head_params + self.other_params) * self.itemsize

    def expected_experts(self, rows: int) -> float:
        """Distinct experts of this rank one MoE layer reads for `rows` rows under uniform routing."""
        if not self.moe_layers or rows <= 0:
            return 0.0
        chosen = 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** rows
        return self.num_experts * self.held_share * chosen


@dataclass(frozen=True)
class ModelGeometry:
    """The shapes of a Qwen3-style decoder (SDAR), read from ``config.json``."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied: bool
    qk_norm: bool = True  # Qwen3 / SDAR normalize q and k per head
    attention_bias: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelGeometry:
        """From a Qwen2/Qwen3/SDAR-style ``config.json`` dict (``text_config`` of wrappers is looked into)."""
        if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        try:
            hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
            return cls(
                hidden_size=hidden,
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                intermediate_size=int(config["intermediate_size"]),
                vocab_size=int(config["vocab_size"]),
                tied=bool(config.get("tie_word_embeddings", False)),
                qk_norm=config.get("model_type") in ("sdar", "qwen3"),
                attention_bias=bool(config.get("attention_bias", False)),
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"config.json is not a Qwen-style decoder config (missing or bad {err})") from None

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """``name -> (out_features, in_features)`` of one layer's linears and the LM head, separate and fused."""
        h, q, kv, inter = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {
            "q": (q, h),
            "k/v": (kv, h),
            "qkv (fused)": (q + 2 * kv, h),
            "o": (h, q),
            "gate/up": (inter, h),
            "gate_up (fused)": (2 * inter, h),
            "down": (h, inter),
            "lm_head": (self.vocab_size, h),
        }

    def cost_model(self, itemsize: int) -> CostModel:
        h, q, kv, inter = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        biases = (q + 2 * kv + h) if self.attention_bias else 0
        return CostModel(
            trunk_linear_params=self.num_layers * per_layer,
            lm_head_params=self.vocab_size * h,
            other_params=self.num_layers * (norms + biases) + h,
            embedding_row=h,
            kv_per_token=2 * self.num_layers * kv,
            attn_flops_per_pair=4 * self.num_layers * self.num_heads * self.head_dim,
            itemsize=itemsize,
        )


def cost_model_from_module(model: nn.Module, itemsize: int) -> CostModel:
    """The same counts read off a built model of any family: the ``LMHead`` is the LM head, the ``nn.Embedding``
    the embedding, the routed experts of each `SparseMoE` its experts, the weight of every other ``nn.Linear`` a
    trunk linear (routers and shared experts included), anything else (norms, biases) "other". Attention shapes
    come from the layers that own a KV cache. Tied tensors are counted once, as the LM head."""
    from diffulex.attention import Attention
    from diffulex.layers import LMHead
    from diffulex.layers.moe import SparseMoE

    moes = [m for m in model.modules() if isinstance(m, SparseMoE)]
    expert_ids = {id(p) for moe in moes for p in moe.experts.parameters()}
    shapes = {(m.num_experts, len(m.experts), m.top_k, _expert_params(m)) for m in moes}
    if len(shapes) > 1:
        raise ValueError("the MoE layers of this model differ in shape; the cost model assumes one shape")
    head_ids = {id(p) for m in model.modules() if isinstance(m, LMHead) for p in m.parameters()}
    embeddings = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    emb_ids = {id(p) for m in embeddings for p in m.parameters()}
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    trunk = other = head = 0
    for param in model.parameters():  # a tied parameter is yielded once
        if id(param) in head_ids:
            head += param.numel()
        elif id(param) in emb_ids or id(param) in expert_ids:
            continue
        elif id(param) in linear_weights:
            trunk += param.numel()
        else:
            other += param.numel()
    attention = [m for m in model.modules() if isinstance(m, Attention)]
    return CostModel(
        trunk_linear_params=trunk,
        lm_head_params=head,
        other_params=other,
        embedding_row=int(embeddings[0].embedding_dim) if embeddings else 0,
        kv_per_token=sum(2 * a.num_kv_heads * a.head_dim for a in attention),
        attn_flops_per_pair=sum(4 * a.num_heads * a.head_dim for a in attention),
        itemsize=itemsize,
        moe_layers=len(moes),
        num_experts=moes[0].num_experts if moes else 0,
        experts_per_token=moes[0].top_k if moes else 0,
        expert_params=_expert_params(moes[0]) if moes else 0,
        held_experts=len(moes[0].experts) if moes else None,
    )


def _expert_params(moe: nn.Module) -> int:
    """Parameters of one routed expert of ``moe`` as this rank holds it: the first it holds (under expert
    parallelism expert 0 lives on rank 0 only)."""
    return sum(p.numel() for p in next(iter(moe.experts)).parameters())


def block_causal_pairs(start: int, end: int, block_size: int) -> int:
    """(query, key) pairs of query positions ``[start, end)`` under block-causal attention: position ``p`` sees
    every key before the end of its own block (cached keys included), capped at ``end``."""
    pairs = 0
    p = start
    while p < end:
        block_end = min((p // block_size + 1) * block_size, end)
        pairs += (block_end - p) * block_end
        p = block_end
    return pairs


@dataclass(frozen=True)
class StepWork:
    """What one step computed, summed over its requests."""

    query_tokens: int  # rows through the decoder layers
    logit_rows: int  # rows through the LM head (the masked positions the sampler fills)
    context_tokens: int  # cached tokens whose K/V attention reads
    written_tokens: int  # tokens whose K/V the step stores in the cache
    attn_pairs: int  # (query, key) pairs attention scores

    def __add__(self, other: StepWork) -> StepWork:
        return StepWork(
            self.query_tokens + other.query_tokens,
            self.logit_rows + other.logit_rows,
            self.context_tokens + other.context_tokens,
            self.written_tokens + other.written_tokens,
            self.attn_pairs + other.attn_pairs,
        )


def step_experts(cost: CostModel, work: StepWork) -> float:
    """Distinct experts the step's MoE layers read, summed over the layers, under uniform routing."""
    return cost.moe_layers * cost.expected_experts(work.query_tokens)


def step_bytes(cost: CostModel, work: StepWork, experts_read: float | None = None) -> int:
    """Bytes that must cross the memory bus: weights once, the experts the rows choose, the gathered embedding
    rows, K/V read and written. ``experts_read``: the distinct experts the step's MoE layers selected, summed
    over the layers, where they were counted (`diffulex.bench.expert_use`); None: the uniform estimate."""
    kv = cost.kv_per_token * (work.context_tokens + work.written_tokens)
    experts = (step_experts(cost, work) if experts_read is None else experts_read) * cost.expert_params
    return cost.weight_bytes + round(experts * cost.itemsize) + (cost.embedding_row * work.query_tokens + kv) * (
        cost.itemsize
    )


def step_flops(cost: CostModel, work: StepWork) -> int:
    """Multiply-add flops (2 per MAC): linear layers per query token, LM head per logit row, attention pairs."""
    return (
        2 * cost.trunk_linear_params * work.query_tokens
        + round(2 * cost.moe_layers * cost.experts_per_token * cost.held_share * cost.expert_params * work.query_tokens)
        + 2 * cost.lm_head_params * work.logit_rows
        + cost.attn_flops_per_pair * work.attn_pairs
    )


@dataclass(frozen=True)
class Floors:
    """The two lower bounds of one step, in seconds."""

    memory_s: float
    compute_s: float

    @property
    def bound_s(self) -> float:
        return max(self.memory_s, self.compute_s)


def step_floors(
    cost: CostModel, work: StepWork, bandwidth_bps: float, flops_per_s: float, experts_read: float | None = None
) -> Floors:
    """Memory floor = bytes / copy bandwidth (bytes/s, read+write counted); compute floor = flops / matmul peak.
    ``experts_read`` as in `step_bytes`."""
    return Floors(step_bytes(cost, work, experts_read) / bandwidth_bps, step_flops(cost, work) / flops_per_s)


def summarize_floors(measured_step_s: float, floors: Sequence[Floors]) -> dict[str, float | str]:
    """Mean floors of a run's steps and how many times them the measured mean step time is (1.0 = at the
    hardware limit). ``floor_ms`` is the mean of each step's larger floor, so a run that alternates between
    memory- and compute-bound steps is not credited with the smaller one."""
    n = len(floors)
    if n == 0 or measured_step_s <= 0:
        raise ValueError("summarize_floors needs at least one step and a positive step time")
    memory = sum(f.memory_s for f in floors) / n
    compute = sum(f.compute_s for f in floors) / n
    bound = sum(f.bound_s for f in floors) / n
    return {
        "memory_floor_ms": 1e3 * memory,
        "compute_floor_ms": 1e3 * compute,
        "floor_ms": 1e3 * bound,
        "bound": "memory" if memory >= compute else "compute",
        "floor_ratio": measured_step_s / bound,
        "memory_floor_ratio": measured_step_s / memory,
        "compute_floor_ratio": measured_step_s / compute,
    }


def linear_roofline(
    m: int, n: int, k: int, itemsize: int, seconds: float, bandwidth_bps: float, flops_per_s: float
) -> dict[str, float]:
    """One ``[m, k] x [k, n]`` linear against the roofline: achieved TFLOP/s, % of the measured matmul peak, and %
    of the roofline time ``max(bytes / bandwidth, flops / peak)`` (input, weight and output bytes moved once)."""
    flops = 2 * m * n * k
    moved = (m * k + n * k + m * n) * itemsize
    roofline_s = max(moved / bandwidth_bps, flops / flops_per_s)
    return {
        "ms": 1e3 * seconds,
        "tflops": flops / seconds / 1e12,
        "pct_of_matmul_peak": 100.0 * flops / seconds / flops_per_s,
        "roofline_ms": 1e3 * roofline_s,
        "pct_of_roofline": 100.0 * roofline_s / seconds,
        "bound": "memory" if moved / bandwidth_bps >= flops / flops_per_s else "compute",
    }

"""The price of prompt rows: the attention/linear parity context from a model's sizes, and rows within a cost."""

from __future__ import annotations

import pytest

from diffulex.engine.prefill_cost import PrefillCostModel
from diffulex.models.hf_config import LLaDA2Config, LLaDAConfig, SDARConfig

SDAR_1_7B = {  # the SDAR-1.7B (Qwen3-1.7B) geometry
    "model_type": "sdar", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
}  # fmt: skip


def test_the_parity_context_is_where_a_rows_attention_flops_equal_its_linear_flops():
    model = PrefillCostModel.from_model_config(SDARConfig.from_dict(SDAR_1_7B))
    hidden, heads, kv_heads, head_dim, inter = 2048, 16, 8, 128, 6144
    linear = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
    attention_per_key = 2 * heads * head_dim
    assert model.parity_context == linear / attention_per_key == 12288
    # at that context a row costs two rows with none (its own half-row of keys aside)
    assert model.rows_cost(1, 12288) == pytest.approx(2.0, abs=1e-3)


def test_a_mixture_of_experts_layer_counts_only_the_experts_a_row_goes_through():
    sizes = {**SDAR_1_7B, "model_type": "llada2_moe", "num_hidden_layers": 4, "first_k_dense_replace": 1,
             "num_experts": 64, "num_experts_per_tok": 4, "num_shared_experts": 1, "moe_intermediate_size": 512}
    model = PrefillCostModel.from_model_config(LLaDA2Config.from_dict(sizes))
    hidden, heads, kv_heads, head_dim = 2048, 16, 8, 128
    projections = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    dense = projections + 3 * hidden * 6144
    sparse = projections + hidden * 64 + 3 * hidden * 512 * (4 + 1)  # router, four routed experts and the shared one
    assert model.parity_context == pytest.approx((dense + 3 * sparse) / (4 * 2 * heads * head_dim))


def test_llada_reads_its_mlp_width_under_its_own_name():
    llada = LLaDAConfig.from_dict({"d_model": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4,
                                   "mlp_hidden_size": 512, "vocab_size": 1000})
    head_dim = 64
    linear = 256 * (4 + 8) * head_dim + 4 * head_dim * 256 + 3 * 256 * 512
    assert PrefillCostModel.from_model_config(llada).parity_context == linear / (2 * 4 * head_dim)


def test_a_config_without_a_size_is_refused_naming_it():
    config = SDARConfig.from_dict(SDAR_1_7B)
    config.head_dim = None
    with pytest.raises(ValueError, match=r"head_dim=None.*positive integer"):
        PrefillCostModel.from_model_config(config)
    with pytest.raises(ValueError, match=r"parity_context=0"):
        PrefillCostModel(0)


def test_the_same_rows_cost_more_the_more_context_they_read():
    model = PrefillCostModel(parity_context=12288)
    costs = [model.rows_cost(128, context) for context in (0, 1000, 8000, 16000, 32000)]
    assert costs == sorted(costs) and len(set(costs)) == len(costs)
    assert costs[0] == pytest.approx(128 * (1 + 64 / 12288))
    assert costs[-1] / costs[0] > 3.5, "128 rows after 32k tokens cost several times 128 rows after none"
    assert model.rows_cost(0, 32000) == 0


@pytest.mark.parametrize("budget", [0.5, 1, 7.5, 64, 256, 1000])
@pytest.mark.parametrize("context", [0, 17, 1000, 30000])
def test_rows_within_a_cost_are_the_most_whose_cost_fits(budget: float, context: int):
    model = PrefillCostModel(parity_context=12288)
    rows = model.rows_within(budget, context)
    assert model.rows_cost(rows, context) <= budget < model.rows_cost(rows + 1, context)


def test_rows_within_shrink_as_the_context_grows():
    model = PrefillCostModel(parity_context=12288)
    rows = [model.rows_within(256, context) for context in range(0, 32001, 4000)]
    assert rows == sorted(rows, reverse=True) and rows[0] > 3 * rows[-1]
    assert model.rows_within(0, 0) == 0 and model.rows_within(-5, 100) == 0

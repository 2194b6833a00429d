"""Config validation and normalization: one test per rule of docs/configuration.md."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import warnings
from pathlib import Path

import pytest

from diffulex.config import Config, DecodingThresholds, ProfilerConfig, engine_fields, field_choices
from diffulex.models.family import FAMILIES
from diffulex.strategy.strategy import STRATEGIES

SDAR_CONFIG = {
    "model_type": "sdar",
    "architectures": ["SDARForCausalLM"],
    "max_position_embeddings": 4096,
    "block_size": 4,
    "mask_token_id": 300,
}


def write_model(path: Path, config: dict | None = None, **overrides) -> str:
    """A checkpoint folder holding only config.json: enough for Config, which never loads weights."""
    path.mkdir(parents=True, exist_ok=True)
    data = dict(SDAR_CONFIG if config is None else config)
    data.update(overrides)
    (path / "config.json").write_text(json.dumps(data))
    return str(path)


def make(tmp_path: Path, config_json: dict | None = None, **fields) -> Config:
    fields.setdefault("model_name", "sdar")
    return Config(write_model(tmp_path / "model", config_json), **fields)


def make_quiet(tmp_path: Path, config_json: dict | None = None, **fields) -> Config:
    """Build a config and fail if it emits any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return make(tmp_path, config_json, **fields)


# --- model directory ------------------------------------------------------------------------------


def test_missing_model_directory_is_rejected(tmp_path):
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match=f"^model='{missing}' is not an existing directory$"):
        Config(missing, model_name="sdar")


def test_model_directory_without_config_json_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        Config(str(tmp_path), model_name="sdar")


def test_unreadable_config_json_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable config.json"):
        Config(str(tmp_path), model_name="sdar")


def test_config_json_is_kept_as_a_raw_dict(tmp_path):
    cfg = make(tmp_path)
    assert cfg.model_config_dict == SDAR_CONFIG


def test_model_may_be_given_as_a_path_object(tmp_path):
    cfg = Config(Path(write_model(tmp_path / "m")), model_name="sdar")
    assert cfg.model == str(tmp_path / "m")


def test_tokenizer_path_defaults_to_the_model_directory(tmp_path):
    cfg = make(tmp_path)
    assert cfg.tokenizer_path == cfg.model


def test_missing_tokenizer_directory_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="^tokenizer_path='.*' is not an existing directory$"):
        make(tmp_path, tokenizer_path=str(tmp_path / "no_tokenizer"))


# --- model_name -----------------------------------------------------------------------------------


def test_model_name_is_inferred_from_config_json(tmp_path):
    cfg = Config(write_model(tmp_path / "m"))
    assert cfg.model_name == "sdar"
    assert cfg.decoding_strategy == "multi_bd"


def test_uninferable_model_name_is_rejected_listing_known_names(tmp_path):
    model = write_model(tmp_path / "m", {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="model_name could not be inferred from model_type='gpt2'.*'sdar'"):
        Config(model)
    # a checkpoint of a kind no family claims is what a family plugin is for: the message says so
    with pytest.raises(ValueError, match=r"or load a plugin that registers a family for this model_type"):
        Config(model)


def test_unknown_model_name_is_rejected_listing_known_names(tmp_path):
    with pytest.raises(
        ValueError, match="^model_name='gpt' is invalid: must be one of 'diffucoder', .*'sdar', .*'stable_diffcoder'"
    ):
        make(tmp_path, model_name="gpt")


# --- decoding_strategy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model_name", "strategy"),
    [
        ("sdar", "multi_bd"),
        ("sdar_moe", "multi_bd"),
        ("dream_reasoner", "multi_bd"),
        ("stable_diffcoder", "multi_bd"),
        ("llada2_mini", "multi_bd"),
        ("dream", "d2f"),
        ("diffucoder", "d2f"),
        ("llada", "d2f"),
        ("diffusion_gemma", "diffusion_gemma"),
    ],
)
def test_decoding_strategy_defaults_to_the_family_default(tmp_path, model_name, strategy):
    assert make(tmp_path, model_name=model_name).decoding_strategy == strategy


def test_fast_dllm_v2_model_defaults_to_its_own_strategy(tmp_path):
    cfg = make(tmp_path, model_name="fast_dllm_v2", block_size=8)
    assert cfg.decoding_strategy == "fast_dllm_v2"


def test_unknown_decoding_strategy_is_rejected_listing_allowed(tmp_path):
    with pytest.raises(
        ValueError, match="^decoding_strategy='beam' is invalid: must be one of 'd2f', .*'multi_bd'"
    ):
        make(tmp_path, decoding_strategy="beam")


@pytest.mark.parametrize("alias", ["multi_block_diffusion", "block_diffusion", "fast_dllm"])
def test_old_strategy_names_map_to_multi_bd_with_a_deprecation_warning(tmp_path, alias):
    with pytest.warns(DeprecationWarning, match=f"decoding_strategy='{alias}' is deprecated"):
        cfg = make(tmp_path, decoding_strategy=alias)
    assert cfg.decoding_strategy == "multi_bd"


def test_diffusion_gemma_model_forces_its_own_strategy_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="decoding_strategy='multi_bd' is replaced by 'diffusion_gemma'"):
        cfg = make(tmp_path, model_name="diffusion_gemma", decoding_strategy="multi_bd")
    assert cfg.decoding_strategy == "diffusion_gemma"


def test_fast_dllm_v2_model_replaces_other_strategies_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="decoding_strategy='d2f' is replaced by 'fast_dllm_v2'"):
        cfg = make(tmp_path, model_name="fast_dllm_v2", decoding_strategy="d2f", block_size=8)
    assert cfg.decoding_strategy == "fast_dllm_v2"


def test_a_fast_dllm_v2_checkpoint_defaults_to_sub_blocks_that_span_its_trained_block(tmp_path):
    """Its config.json names the trained block (bd_size) and no block_size: 8-token sub-blocks x the default buffer
    of 4 span the 32 it was trained with, and nothing is warned about."""
    config = {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"], "bd_size": 32,
              "max_position_embeddings": 4096}
    cfg = make_quiet(tmp_path, config, model_name=None)  # detected from config.json
    assert (cfg.model_name, cfg.decoding_strategy) == ("fast_dllm_v2", "fast_dllm_v2")
    assert (cfg.block_size, cfg.buffer_size) == (8, 4)


def test_fast_dllm_v2_model_may_run_multi_bd(tmp_path):
    cfg = make_quiet(tmp_path, model_name="fast_dllm_v2", decoding_strategy="multi_bd")
    assert cfg.decoding_strategy == "multi_bd"


def test_diffusion_gemma_strategy_requires_the_diffusion_gemma_model(tmp_path):
    with pytest.raises(
        ValueError, match="^decoding_strategy='diffusion_gemma' is invalid: requires model_name"
    ):
        make(tmp_path, decoding_strategy="diffusion_gemma")


def test_the_package_registers_its_strategies_and_families():
    assert {"multi_bd", "d2f", "dmax", "fast_dllm_v2", "diffusion_gemma"} <= set(STRATEGIES.names())
    assert {"sdar", "sdar_moe", "llada", "llada2", "llada2dot1_mini", "dream", "diffucoder", "dream_reasoner",
            "stable_diffcoder", "fast_dllm_v2", "diffusion_gemma"} <= set(FAMILIES.names())


# --- sampling_mode --------------------------------------------------------------------------------


def test_unknown_sampling_mode_is_rejected(tmp_path):
    with pytest.raises(
        ValueError, match="^sampling_mode='greedy' is invalid: must be one of 'naive', 'edit'$"
    ):
        make(tmp_path, sampling_mode="greedy")


def test_edit_sampling_requires_an_edit_capable_model(tmp_path):
    with pytest.raises(
        ValueError, match="sampling_mode='edit' is invalid: requires an edit-capable model_name"
    ):
        make(tmp_path, sampling_mode="edit")


@pytest.mark.parametrize(
    "model_name", ["llada2", "llada2_moe", "llada2_mini", "llada2dot1_mini", "llada2_mini_dmax"]
)
def test_edit_sampling_is_accepted_for_llada2_models(tmp_path, model_name):
    assert make(tmp_path, model_name=model_name, sampling_mode="edit").sampling_mode == "edit"


def test_llada2dot1_mini_requires_edit_sampling(tmp_path):
    with pytest.raises(ValueError, match="model_name='llada2dot1_mini' requires 'edit'"):
        make(tmp_path, model_name="llada2dot1_mini")


# --- mask_token_id --------------------------------------------------------------------------------


def test_mask_token_id_defaults_to_config_json(tmp_path):
    assert make(tmp_path).mask_token_id == 300


def test_mask_token_id_stays_unset_when_config_json_has_none(tmp_path):
    config_json = {k: v for k, v in SDAR_CONFIG.items() if k != "mask_token_id"}
    assert make(tmp_path, config_json).mask_token_id is None


def test_explicit_mask_token_id_wins_over_config_json(tmp_path):
    assert make(tmp_path, mask_token_id=7).mask_token_id == 7


def test_negative_mask_token_id_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="^mask_token_id=-1 is invalid: must be an integer >= 0$"):
        make(tmp_path, mask_token_id=-1)


# --- block, page and buffer sizes -----------------------------------------------------------------


def test_block_size_defaults_to_config_json_when_supported(tmp_path):
    assert make(tmp_path).block_size == 4


def test_block_size_defaults_to_32_when_config_json_has_none_or_an_unsupported_size(tmp_path):
    assert make(tmp_path / "a", dict(SDAR_CONFIG, block_size=12)).block_size == 32
    config_json = {k: v for k, v in SDAR_CONFIG.items() if k != "block_size"}
    assert make(tmp_path / "b", config_json).block_size == 32


def test_unsupported_block_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"^block_size=12 is invalid: must be one of 4, 8, 16, 32$"):
        make(tmp_path, block_size=12)


def test_block_size_256_is_only_allowed_for_diffusion_gemma(tmp_path):
    with pytest.raises(ValueError, match=r"^block_size=256 is invalid: must be one of 4, 8, 16, 32$"):
        make(tmp_path / "a", block_size=256, page_size=256)
    assert make(tmp_path / "b", model_name="diffusion_gemma", block_size=256).block_size == 256


def test_unsupported_page_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"^page_size=64 is invalid: must be one of 4, 8, 16, 32$"):
        make(tmp_path, page_size=64)


def test_block_size_larger_than_page_size_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"^block_size=32 is invalid: must be <= page_size=16$"):
        make(tmp_path, block_size=32, page_size=16)


def test_buffer_size_below_one_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"^buffer_size=0 is invalid: must be an integer > 0$"):
        make(tmp_path, buffer_size=0)


# --- strategy normalizers -------------------------------------------------------------------------


def test_multi_bd_uses_block_causal_attention_and_prefix_caching_by_default(tmp_path):
    cfg = make_quiet(tmp_path, decoding_strategy="multi_bd")
    assert cfg.multi_block_prefix_full is False
    assert cfg.enable_prefix_caching is True


def test_multi_bd_keeps_prefix_caching_off_when_asked(tmp_path):
    assert make_quiet(tmp_path, enable_prefix_caching=False).enable_prefix_caching is False


def test_multi_bd_overrides_prefix_full_attention_with_a_warning(tmp_path):
    with pytest.warns(UserWarning, match="multi_block_prefix_full=True is overridden to False"):
        cfg = make(tmp_path, multi_block_prefix_full=True)
    assert cfg.multi_block_prefix_full is False


def test_d2f_uses_prefix_full_attention(tmp_path):
    cfg = make_quiet(tmp_path, decoding_strategy="d2f")
    assert cfg.multi_block_prefix_full is True
    assert cfg.enable_prefix_caching is False


def test_d2f_turns_prefix_caching_off(tmp_path):
    with pytest.warns(UserWarning, match="enable_prefix_caching=True is overridden to False"):
        cfg = make(tmp_path, decoding_strategy="d2f", enable_prefix_caching=True)
    assert cfg.enable_prefix_caching is False


def test_dmax_requires_edit_sampling_and_an_edit_capable_model(tmp_path):
    with pytest.raises(
        ValueError, match="^sampling_mode='naive' is invalid: decoding_strategy='dmax' runs with 'edit'$"
    ):
        make(tmp_path / "a", model_name="llada2_mini", decoding_strategy="dmax")
    with pytest.raises(ValueError, match="decoding_strategy='dmax' is invalid: .*model_name='sdar'"):
        make(tmp_path / "b", decoding_strategy="dmax")


def test_dmax_runs_block_causal_with_edit_sampling(tmp_path):
    cfg = make_quiet(tmp_path, model_name="llada2_mini_dmax", decoding_strategy="dmax", sampling_mode="edit")
    assert cfg.multi_block_prefix_full is False
    assert cfg.enable_prefix_caching is True


def test_fast_dllm_v2_requires_buffer_size_above_one(tmp_path):
    with pytest.raises(ValueError, match=r"^buffer_size=1 is invalid: fast_dllm_v2 needs buffer_size > 1"):
        make(tmp_path, model_name="fast_dllm_v2", buffer_size=1)


def test_fast_dllm_v2_warns_when_the_block_span_is_not_32(tmp_path):
    with pytest.warns(UserWarning, match=r"block_size \* buffer_size = 16 \* 4 = 64"):
        make(tmp_path / "a", model_name="fast_dllm_v2", block_size=16)
    make_quiet(tmp_path / "b", model_name="fast_dllm_v2", block_size=8, buffer_size=4)


def test_fast_dllm_v2_forces_prefix_caching_on_and_block_causal_attention(tmp_path):
    with pytest.warns(UserWarning, match="enable_prefix_caching=False is overridden to True"):
        cfg = make(tmp_path, model_name="fast_dllm_v2", block_size=8, enable_prefix_caching=False)
    assert cfg.enable_prefix_caching is True
    assert cfg.multi_block_prefix_full is False


def test_diffusion_gemma_uses_256_token_canvases_and_a_single_block_buffer(tmp_path):
    cfg = make_quiet(tmp_path, model_name="diffusion_gemma")
    assert (cfg.block_size, cfg.page_size, cfg.buffer_size) == (256, 256, 1)
    assert cfg.multi_block_prefix_full is False
    assert cfg.enable_prefix_caching is True


def test_diffusion_gemma_warns_when_overriding_user_sizes(tmp_path):
    with pytest.warns(UserWarning) as record:
        cfg = make(tmp_path, model_name="diffusion_gemma", block_size=16, page_size=16, buffer_size=2)
    messages = " | ".join(str(w.message) for w in record)
    for expected in ("block_size=16 is overridden to 256", "page_size=16 is overridden", "buffer_size=2"):
        assert expected in messages
    assert (cfg.block_size, cfg.page_size, cfg.buffer_size) == (256, 256, 1)


def test_diffusion_gemma_reads_sampler_defaults_from_generation_config(tmp_path):
    model = write_model(tmp_path / "g")
    generation = {
        "max_denoising_steps": 24,
        "stability_threshold": 3,
        "t_min": 0.1,
        "t_max": 0.8,
        "confidence_threshold": 0.2,
        "sampler_config": {"entropy_bound": 0.5},
    }
    (Path(model) / "generation_config.json").write_text(json.dumps(generation))
    cfg = Config(model, model_name="diffusion_gemma")
    assert cfg.diffusion_gemma_max_denoising_steps == 24
    assert cfg.diffusion_gemma_stability_threshold == 3
    assert (cfg.diffusion_gemma_t_min, cfg.diffusion_gemma_t_max) == (0.1, 0.8)
    assert cfg.diffusion_gemma_confidence_threshold == 0.2
    assert cfg.diffusion_gemma_entropy_bound == 0.5


def test_diffusion_gemma_keeps_user_sampler_values_over_generation_config(tmp_path):
    model = write_model(tmp_path / "g")
    (Path(model) / "generation_config.json").write_text(json.dumps({"max_denoising_steps": 24, "t_max": 0.8}))
    cfg = Config(model, model_name="diffusion_gemma", diffusion_gemma_max_denoising_steps=10)
    assert cfg.diffusion_gemma_max_denoising_steps == 10
    assert cfg.diffusion_gemma_t_max == 0.8


def test_generation_config_is_ignored_for_other_models(tmp_path):
    model = write_model(tmp_path / "g")
    (Path(model) / "generation_config.json").write_text(json.dumps({"max_denoising_steps": 24}))
    assert Config(model, model_name="sdar").diffusion_gemma_max_denoising_steps == 48


def test_diffusion_gemma_t_min_above_t_max_is_rejected(tmp_path):
    with pytest.raises(
        ValueError, match=r"^diffusion_gemma_t_min=0.9 is invalid: must be <= diffusion_gemma_t_max=0.5"
    ):
        make(tmp_path, diffusion_gemma_t_min=0.9, diffusion_gemma_t_max=0.5)


# --- parallelism, memory and lengths --------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "value", "requirement"),
    [
        ("tensor_parallel_size", 0, "must be an integer in [1, 8]"),
        ("tensor_parallel_size", 9, "must be an integer in [1, 8]"),
        ("data_parallel_size", 0, "must be an integer in [1, 1024]"),
        ("data_parallel_size", 1025, "must be an integer in [1, 1024]"),
        ("expert_parallel_size", 0, "must be an integer in [1, 8]"),
        ("expert_parallel_size", 9, "must be an integer in [1, 8]"),
    ],
)
def test_parallel_sizes_out_of_range_are_rejected(tmp_path, name, value, requirement):
    with pytest.raises(ValueError) as e:
        make(tmp_path, **{name: value})
    assert str(e.value) == f"{name}={value} is invalid: {requirement}"


def test_larger_parallel_sizes_are_only_validated_here(tmp_path):
    cfg = make(tmp_path, tensor_parallel_size=8, data_parallel_size=2, expert_parallel_size=8)
    assert (cfg.tensor_parallel_size, cfg.data_parallel_size, cfg.expert_parallel_size) == (8, 2, 8)
    assert make(tmp_path, expert_parallel_size=4).expert_parallel_size == 4


@pytest.mark.parametrize(("tp", "ep"), [(2, 4), (4, 2), (8, 2)])
def test_expert_ranks_that_neither_equal_the_tensor_ranks_nor_stand_alone_are_refused(tmp_path, tp, ep):
    """The engine's ranks are one group: EP equal to TP, or TP=1 with EP ranks of replicated attention."""
    with pytest.raises(ValueError, match=rf"expert_parallel_size={ep} is invalid: with tensor_parallel_size={tp} "
                                         rf"must be 1 or {tp}"):  # fmt: skip
        make(tmp_path, tensor_parallel_size=tp, expert_parallel_size=ep)


@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.5, float("nan")])
def test_gpu_memory_utilization_outside_zero_one_is_rejected(tmp_path, value):
    with pytest.raises(
        ValueError, match=r"gpu_memory_utilization=.* is invalid: must be a number in \(0, 1\]"
    ):
        make(tmp_path, gpu_memory_utilization=value)


def test_gpu_memory_utilization_of_one_is_accepted(tmp_path):
    assert make(tmp_path, gpu_memory_utilization=1).gpu_memory_utilization == 1.0


def test_max_model_len_is_clamped_to_the_checkpoint_limit(tmp_path):
    with pytest.warns(
        UserWarning, match="max_model_len=8192 exceeds the checkpoint's max_position_embeddings=4096"
    ):
        cfg = make(tmp_path, max_model_len=8192, max_num_batched_tokens=8192)
    assert cfg.max_model_len == 4096


@pytest.mark.parametrize(
    "config_json",
    [
        {"model_type": "x", "max_sequence_length": 1024},
        {"model_type": "x", "text_config": {"max_position_embeddings": 1024}},
        {"model_type": "x", "text_config": {"max_sequence_length": 1024}},
    ],
)
def test_max_model_len_limit_falls_back_to_max_sequence_length_and_text_config(tmp_path, config_json):
    with pytest.warns(UserWarning, match="exceeds the checkpoint's"):
        assert make(tmp_path, config_json).max_model_len == 1024


def test_a_checkpoint_limit_that_is_not_whole_blocks_is_rounded_down_to_whole_blocks(tmp_path):
    # a request's last block is computed whole: positions 2044..2047 at a limit of 2046 would index past it
    with pytest.warns(UserWarning, match=r"max_position_embeddings=2046; using 2044 \(whole blocks of block_size=4\)"):
        cfg = make(tmp_path, {"model_type": "x", "max_position_embeddings": 2046}, block_size=4)
    assert cfg.max_model_len == 2044


def test_a_max_model_len_within_the_limit_whose_last_block_ends_past_it_is_rounded_down(tmp_path):
    with pytest.warns(UserWarning, match="max_model_len=2045 ends in a block of block_size=4 that reaches past"):
        cfg = make(tmp_path, {"model_type": "x", "max_position_embeddings": 2046}, block_size=4, max_model_len=2045)
    assert cfg.max_model_len == 2044


def test_a_max_model_len_off_the_block_grid_within_the_limit_is_kept(tmp_path):
    cfg = make_quiet(tmp_path, {"model_type": "x", "max_position_embeddings": 2048}, block_size=4, max_model_len=2045)
    assert cfg.max_model_len == 2045


def test_max_model_len_is_kept_when_the_checkpoint_gives_no_limit(tmp_path):
    cfg = make_quiet(tmp_path, {"model_type": "x"}, max_model_len=100_000, max_num_batched_tokens=100_000)
    assert cfg.max_model_len == 100_000


def test_max_num_batched_tokens_below_max_model_len_is_rejected(tmp_path):
    with pytest.raises(
        ValueError, match=r"^max_num_batched_tokens=1024 is invalid: must be >= max_model_len=2048$"
    ):
        make(tmp_path, max_num_batched_tokens=1024)


def test_max_num_batched_tokens_is_compared_with_the_clamped_max_model_len(tmp_path):
    with pytest.warns(UserWarning, match="exceeds the checkpoint's"):
        cfg = make(tmp_path, max_model_len=10_000, max_num_batched_tokens=4096)
    assert cfg.max_model_len == 4096


def test_chunked_prefill_lets_the_token_budget_be_shorter_than_a_prompt(tmp_path):
    cfg = make(tmp_path, enable_chunked_prefill=True, block_size=4, max_num_batched_tokens=64)
    assert (cfg.max_num_batched_tokens, cfg.max_model_len) == (64, 2048)


def test_chunked_prefill_needs_a_budget_of_one_block_and_a_row(tmp_path):
    with pytest.raises(ValueError, match=r"^max_num_batched_tokens=4 is invalid: must be >= block_size \+ 1 = 5"):
        make(tmp_path, enable_chunked_prefill=True, block_size=4, max_num_batched_tokens=4)


def test_chunked_prefill_is_refused_for_d2f_whose_prompt_kv_depends_on_the_whole_prompt(tmp_path):
    with pytest.raises(ValueError, match=r"^enable_chunked_prefill=True is invalid: strategy 'd2f' attends the whole"):
        make(tmp_path, decoding_strategy="d2f", enable_chunked_prefill=True)


def test_chunked_prefill_is_refused_for_a_strategy_whose_requests_do_not_chunk(tmp_path):
    with pytest.raises(ValueError, match=r"^enable_chunked_prefill=True is invalid: strategy 'dmax' does not compute"):
        make(tmp_path, model_name="llada2", sampling_mode="edit", decoding_strategy="dmax", enable_chunked_prefill=True)


def test_a_prefill_chunk_cost_budget_sizes_chunked_prompts_only(tmp_path):
    cfg = make(tmp_path, enable_chunked_prefill=True, block_size=4, max_prefill_chunk_cost=96)
    assert cfg.max_prefill_chunk_cost == 96 and make(tmp_path).max_prefill_chunk_cost == 0
    with pytest.raises(ValueError, match=r"^max_prefill_chunk_cost=96 is invalid: must be 0 without "
                                         r"enable_chunked_prefill=True"):
        make(tmp_path, max_prefill_chunk_cost=96)
    with pytest.raises(ValueError, match=r"^max_prefill_chunk_cost=-1 is invalid"):
        make(tmp_path, enable_chunked_prefill=True, max_prefill_chunk_cost=-1)
    with pytest.raises(ValueError, match=r"^max_prefill_chunk_cost=2.5 is invalid"):
        make(tmp_path, enable_chunked_prefill=True, max_prefill_chunk_cost=2.5)


def test_prefill_graphs_hold_one_prompt_block_and_a_row_or_are_off(tmp_path):
    assert make(tmp_path, block_size=4).max_prefill_graph_tokens == 2048
    assert make(tmp_path, block_size=4, max_prefill_graph_tokens=0).max_prefill_graph_tokens == 0
    assert make(tmp_path, block_size=4, max_prefill_graph_tokens=5).max_prefill_graph_tokens == 5
    with pytest.raises(ValueError, match=r"^max_prefill_graph_tokens=4 is invalid: must be 0 \(no prefill graphs\) or "
                       r">= block_size \+ 1 = 5"):
        make(tmp_path, block_size=4, max_prefill_graph_tokens=4)
    with pytest.raises(ValueError, match=r"^max_prefill_graph_tokens=-1 is invalid: must be an integer >= 0"):
        make(tmp_path, max_prefill_graph_tokens=-1)


def test_diffusion_gemma_skips_the_batched_tokens_check(tmp_path):
    cfg = make(tmp_path, model_name="diffusion_gemma", max_num_batched_tokens=512)
    assert cfg.max_num_batched_tokens == 512


@pytest.mark.parametrize("name", ["max_model_len", "max_num_batched_tokens", "max_num_reqs"])
def test_non_positive_limits_are_rejected(tmp_path, name):
    with pytest.raises(ValueError, match=f"^{name}=0 is invalid: must be an integer > 0$"):
        make(tmp_path, **{name: 0})


@pytest.mark.parametrize("value", [-1, 0, 500])
def test_num_pages_accepts_automatic_and_explicit_values(tmp_path, value):
    assert make(tmp_path, num_pages=value).num_pages == value


# --- closed choices, numeric ranges and types -----------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "dtype",
        "kv_cache_layout",
        "attn_impl",
        "torch_compile_mode",
        "token_merge_mode",
        "moe_gemm_impl",
        "moe_dispatcher_backend",
        "deepep_mode",
        "distributed_backend",
        "distributed_executor_backend",
    ],
)
def test_closed_choice_fields_reject_unknown_values(tmp_path, name):
    allowed = next(f for f in engine_fields() if f.name == name).metadata["choices"]
    with pytest.raises(ValueError, match=f"^{name}='bogus' is invalid: must be one of {allowed[0]!r}"):
        make(tmp_path / "bad", **{name: "bogus"})
    for value in allowed:  # every advertised choice validates
        assert getattr(make(tmp_path / str(value), **{name: value}), name) == value


@pytest.mark.parametrize("value", [0, 3, 6, -8])
def test_k_cache_hdim_split_factor_must_be_a_power_of_two(tmp_path, value):
    with pytest.raises(ValueError, match="must be a positive power of two"):
        make(tmp_path, k_cache_hdim_split_factor_x=value)


@pytest.mark.parametrize(
    ("name", "value", "requirement"),
    [
        ("seed", -1, "must be an integer >= 0"),
        ("prefill_cudagraph_max_len", -1, "must be an integer >= 0"),
        ("auto_max_nfe_warmup_steps", 0, "must be an integer > 0"),
        ("auto_max_nfe_tpf_floor", 0, "must be a number > 0"),
        ("token_merge_top_k", 0, "must be an integer in [1, 1024]"),
        ("token_merge_top_k", 10**9, "must be an integer in [1, 1024]"),
        ("token_merge_weight", -1, "must be a number >= 0"),
        ("max_post_edit_steps", -1, "must be an integer in [0, 1024]"),
        ("max_post_edit_steps", 1.5, "must be an integer in [0, 1024]"),
        ("max_post_edit_steps", 10**18, "must be an integer in [0, 1024]"),
        ("penalty_lambda", -0.5, "must be a number >= 0"),
        ("deepep_num_max_dispatch_tokens_per_rank", 0, "must be an integer > 0"),
        ("diffusion_gemma_max_denoising_steps", 0, "must be an integer in [1, 1024]"),
        ("diffusion_gemma_max_denoising_steps", 10**18, "must be an integer in [1, 1024]"),
        ("diffusion_gemma_t_max", float("inf"), "must be a number in [0, 100]"),
        ("diffusion_gemma_t_min", -0.5, "must be a number in [0, 100]"),
        ("diffusion_gemma_stability_threshold", 0, "must be an integer > 0"),
        ("diffusion_gemma_confidence_threshold", -0.1, "must be a number >= 0"),
        ("diffusion_gemma_entropy_bound", -1, "must be a number >= 0"),
        ("master_port", 0, "must be an integer in [1, 65535]"),
        ("master_port", 65536, "must be an integer in [1, 65535]"),
        ("distributed_timeout_seconds", 0, "must be an integer > 0"),
        ("device_start", -1, "must be an integer >= 0"),
        ("master_addr", "", "must be a non-empty string"),
        ("shm_name", "", "must be a non-empty string"),
    ],
)
def test_numeric_and_string_ranges_are_enforced(tmp_path, name, value, requirement):
    with pytest.raises(ValueError) as e:
        make(tmp_path, **{name: value})
    assert str(e.value) == f"{name}={value!r} is invalid: {requirement}"


@pytest.mark.parametrize(
    "name", ["enforce_eager", "enable_prefix_caching", "use_lora", "fdv2_use_block_cache"]
)
def test_bool_fields_reject_strings(tmp_path, name):
    with pytest.raises(ValueError, match=f"^{name}='false' is invalid: must be True or False$"):
        make(tmp_path, **{name: "false"})


@pytest.mark.parametrize("value", [True, 4.0, "4"])
def test_int_fields_reject_bools_floats_and_strings(tmp_path, value):
    with pytest.raises(ValueError, match="^max_num_reqs=.* is invalid: must be an integer > 0$"):
        make(tmp_path, max_num_reqs=value)


@pytest.mark.parametrize("value", [[0, -1], [0, 1.0], "0,1"])
def test_device_ids_must_be_non_negative_integers(tmp_path, value):
    with pytest.raises(ValueError, match="device_ids=.* is invalid: must be a list of non-negative integers"):
        make(tmp_path, device_ids=value)


def test_device_ids_tuple_becomes_a_list(tmp_path):
    assert make(tmp_path, device_ids=(1, 0)).device_ids == [1, 0]


def test_float_fields_are_stored_as_floats(tmp_path):
    cfg = make(
        tmp_path, model_name="llada2_mini", decoding_strategy="dmax", sampling_mode="edit", token_merge_weight=2,
        accept_threshold=1,
    )  # fmt: skip
    assert isinstance(cfg.strategy_options.token_merge_weight, float)
    assert isinstance(cfg.decoding_thresholds.accept_threshold, float)


# --- LoRA -----------------------------------------------------------------------------------------


def test_use_lora_requires_lora_path(tmp_path):
    with pytest.raises(ValueError, match="^use_lora=True requires lora_path$"):
        make(tmp_path, use_lora=True)


def test_missing_lora_directory_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="^lora_path='.*' is not an existing directory$"):
        make(tmp_path, use_lora=True, lora_path=str(tmp_path / "no_adapter"))


def test_lora_settings_with_an_existing_adapter_directory_validate(tmp_path):
    (tmp_path / "adapter").mkdir()
    cfg = make(tmp_path, use_lora=True, lora_path=str(tmp_path / "adapter"), pre_merge_lora=True)
    assert cfg.use_lora and cfg.pre_merge_lora


# --- profiler -------------------------------------------------------------------------------------


def test_profiler_is_off_by_default(tmp_path):
    cfg = make(tmp_path)
    assert cfg.profiler_config == ProfilerConfig()
    assert not cfg.profiler_config.enabled


def test_profiler_dict_becomes_a_profiler_config_with_an_absolute_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = make(
        tmp_path, profiler_config={"profiler": "torch", "torch_profiler_dir": "traces", "max_iterations": 5}
    )
    assert isinstance(cfg.profiler_config, ProfilerConfig)
    assert cfg.profiler_config.torch_profiler_dir == os.path.join(str(tmp_path), "traces")
    assert cfg.profiler_config.max_iterations == 5


def test_profiler_dict_with_unknown_keys_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="profiler_config has unknown keys 'colour', 'depth'"):
        make(tmp_path, profiler_config={"depth": 1, "colour": 2})


def test_torch_profiler_requires_a_directory(tmp_path):
    with pytest.raises(ValueError, match="profiler='torch' requires profiler_config.torch_profiler_dir"):
        make(tmp_path, profiler_config={"profiler": "torch"})


def test_unknown_profiler_and_negative_iterations_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="profiler_config.profiler='nsys' is invalid"):
        ProfilerConfig(profiler="nsys")
    with pytest.raises(ValueError, match="profiler_config.delay_iterations=-1 is invalid"):
        ProfilerConfig(delay_iterations=-1)


# --- decoding thresholds --------------------------------------------------------------------------


def test_thresholds_default_to_the_documented_values(tmp_path):
    assert make(tmp_path).decoding_thresholds == DecodingThresholds(
        add_block_threshold=0.1,
        semi_complete_threshold=0.9,
        accept_threshold=0.9,
        edit_threshold=0.0,
        remask_threshold=0.4,
        token_stability_threshold=0.0,
    )


def test_threshold_dict_overrides_defaults_and_flat_fields_override_the_dict(tmp_path):
    cfg = make(
        tmp_path, decoding_thresholds={"accept_threshold": 0.5, "remask_threshold": 0.2}, accept_threshold=0.7
    )
    assert cfg.decoding_thresholds.accept_threshold == 0.7
    assert cfg.decoding_thresholds.remask_threshold == 0.2
    assert cfg.decoding_thresholds.add_block_threshold == 0.1


def test_flat_threshold_fields_override_a_thresholds_object(tmp_path):
    given = DecodingThresholds(accept_threshold=0.5, edit_threshold=0.3)
    cfg = make(tmp_path, decoding_thresholds=given, edit_threshold=0.6)
    assert cfg.decoding_thresholds.accept_threshold == 0.5
    assert cfg.decoding_thresholds.edit_threshold == 0.6
    assert given.edit_threshold == 0.3  # the caller's object is not modified


def test_flat_threshold_fields_mirror_the_thresholds_object(tmp_path):
    cfg = make(tmp_path, decoding_thresholds={"semi_complete_threshold": 0.8})
    for name in DecodingThresholds.names():
        assert getattr(cfg, name) == getattr(cfg.decoding_thresholds, name)
    assert cfg.semi_complete_threshold == 0.8


def test_threshold_dict_with_unknown_keys_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="decoding_thresholds has unknown keys 'complete_threshold'"):
        make(tmp_path, decoding_thresholds={"complete_threshold": 0.9})


@pytest.mark.parametrize("name", DecodingThresholds.names())
@pytest.mark.parametrize("value", [-0.1, 1.1])
def test_every_threshold_outside_zero_one_is_rejected(tmp_path, name, value):
    with pytest.raises(ValueError, match=rf"^{name}={value} is invalid: must be a number in \[0, 1\]$"):
        make(tmp_path / "flat", **{name: value})
    with pytest.raises(ValueError, match=rf"^{name}={value} is invalid"):
        make(tmp_path / "dict", decoding_thresholds={name: value})


def test_thresholds_of_the_wrong_type_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="decoding_thresholds=0.9 is invalid"):
        make(tmp_path, decoding_thresholds=0.9)


# --- from_kwargs, to_dict, engine_fields ----------------------------------------------------------


def test_unknown_kwargs_are_dropped_with_one_warning_naming_them(tmp_path, caplog):
    model = write_model(tmp_path / "m")
    with caplog.at_level(logging.WARNING, logger="diffulex.config"):
        with pytest.warns(UserWarning) as record:
            cfg = Config.from_kwargs(model, model_name="sdar", zeta=1, complete_threshold=0.9, max_num_reqs=3)
    assert [str(w.message) for w in record] == ["ignoring unknown engine arguments: complete_threshold, zeta"]
    assert "complete_threshold, zeta" in caplog.text
    assert cfg.max_num_reqs == 3


def test_known_kwargs_produce_no_warning(tmp_path):
    model = write_model(tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Config.from_kwargs(model, model_name="sdar", max_num_reqs=3)


def test_the_original_field_names_are_read_as_their_fields(tmp_path):
    """The original's names, as its benchmark files and lm-eval model_args give them: the same in Python as in YAML."""
    model = write_model(tmp_path / "m")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = Config.from_kwargs(model, model_name="sdar", num_kvcache_blocks=64, diffusion_block_size=8,
                                 max_num_seqs=3)  # fmt: skip
    assert (cfg.num_pages, cfg.block_size, cfg.max_num_reqs) == (64, 8, 3)


def test_conflicting_num_kvcache_blocks_and_num_pages_are_rejected(tmp_path):
    model = write_model(tmp_path / "m")
    with pytest.raises(ValueError, match="num_kvcache_blocks=64 conflicts with num_pages=32"):
        Config.from_kwargs(model, model_name="sdar", num_kvcache_blocks=64, num_pages=32)


def test_to_dict_is_json_serializable_and_rebuilds_the_same_config(tmp_path):
    cfg = make(
        tmp_path,
        profiler_config={"profiler": "torch", "torch_profiler_dir": str(tmp_path / "t")},
        decoding_thresholds={"accept_threshold": 0.8},
        device_ids=[0],
    )
    data = json.loads(json.dumps(cfg.to_dict()))
    assert "model_config_dict" not in data
    assert data["decoding_thresholds"]["accept_threshold"] == 0.8
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert Config(**data) == cfg


def test_engine_fields_list_every_user_settable_field_with_help():
    names = [f.name for f in engine_fields()]
    assert names[0] == "model"
    assert "model_config_dict" not in names
    assert set(names) == {f.name for f in dataclasses.fields(Config)} - {"model_config_dict", "family", "strategy"}
    for f in engine_fields():
        assert f.metadata.get("help"), f.name


def test_model_name_and_strategy_choices_are_what_is_registered():
    fields = {f.name: f for f in engine_fields()}
    assert field_choices(fields["model_name"]) == FAMILIES.names()
    assert field_choices(fields["decoding_strategy"]) == STRATEGIES.names()


def test_defaults_are_single_gpu_friendly(tmp_path):
    cfg = make_quiet(tmp_path)
    assert cfg.tensor_parallel_size == 1
    assert cfg.dtype == "auto"
    assert cfg.seed == 0
    assert cfg.max_model_len == 2048
    assert cfg.page_size == 32
    assert cfg.buffer_size == 4


# --- load format ----------------------------------------------------------------------------------


def test_load_format_defaults_to_safetensors_and_accepts_dummy(tmp_path):
    assert make_quiet(tmp_path / "a").load_format == "safetensors"
    assert make_quiet(tmp_path / "b", load_format="dummy").load_format == "dummy"
    field = next(f for f in engine_fields() if f.name == "load_format")
    assert field.metadata["choices"] == ["safetensors", "dummy"]


def test_unknown_load_format_is_rejected_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"^load_format='pt' is invalid: must be one of 'safetensors', 'dummy'$"):
        make(tmp_path, load_format="pt")


def test_load_format_is_a_cli_flag_and_a_yaml_key(tmp_path):
    from diffulex.cli import build_parser, engine_overrides, load_yaml_engine_fields

    args = build_parser().parse_args(["generate", "--load-format", "dummy"])
    assert engine_overrides(args) == {"load_format": "dummy"}
    args = build_parser().parse_args(["generate", "--load-format", "pt"])  # Config, not argparse, checks choices
    with pytest.raises(ValueError, match="load_format='pt' is invalid"):
        make_quiet(tmp_path / "m", **engine_overrides(args))
    yaml_file = tmp_path / "engine.yml"
    yaml_file.write_text("engine:\n  load_format: dummy\n")
    assert load_yaml_engine_fields(str(yaml_file)) == {"load_format": "dummy"}
    assert make_quiet(tmp_path / "m", load_format="dummy").to_dict()["load_format"] == "dummy"


def test_every_inert_field_is_listed_in_the_configuration_docs():
    from pathlib import Path

    from diffulex.config import INERT_FIELDS

    docs = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    section = docs.split("## Fields this version accepts but does not act on")[1].split("\n## ")[0]
    assert all(f"| `{name}` |" in section for name in INERT_FIELDS)


def test_a_huge_rejected_value_is_shown_by_its_start_and_length(tmp_path):
    with pytest.raises(ValueError) as e:
        Config("x" * 100_000)
    message = str(e.value)
    assert len(message) < 400 and "(100002 characters)" in message and message.endswith("is not an existing directory")


def test_options_given_to_a_strategy_without_options_say_it_takes_none(tmp_path):
    with pytest.raises(ValueError, match=r"has unknown keys 'depth'; it takes no keys$"):
        make(tmp_path, decoding_strategy="multi_bd", strategy_options={"depth": 2})


def test_unknown_keys_of_mixed_types_are_named_not_a_type_error(tmp_path):
    with pytest.raises(ValueError, match=r"has unknown keys 'foo', 1"):
        make(tmp_path, decoding_thresholds={1: 0.5, "foo": 1})

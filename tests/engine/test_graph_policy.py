"""What the graph policy decides from the config for prompt rows: the prefill graphs' largest bucket, the prompt
rows a chunk beside decoders may take, and whether there are chunk graphs and how wide."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from diffulex.config import Config
from diffulex.engine.graph_policy import GraphPolicy
from diffulex.testing.checkpoints import write_tiny_checkpoint


def _config(model_dir: Path, **fields) -> Config:
    return Config(str(model_dir), **{"block_size": 4, "page_size": 8, "max_model_len": 160, **fields})


def policy_for(model_dir: Path, **fields) -> GraphPolicy:
    return GraphPolicy.decide(_config(model_dir, **fields), torch.device("cpu"), object(), logits_shift=False)


def prefill_graph_rows(model_dir: Path, **fields) -> int:
    return policy_for(model_dir, **fields).prefill_graph_rows


def test_block_causal_prompts_get_prefill_graphs_up_to_the_setting_and_the_model_length(peaky_sdar_dir: Path):
    assert prefill_graph_rows(peaky_sdar_dir, max_prefill_graph_tokens=64) == 64
    assert prefill_graph_rows(peaky_sdar_dir) == 160, "2,048 rows by default, but no prompt is longer"
    assert prefill_graph_rows(peaky_sdar_dir, max_prefill_graph_tokens=0) == 0


def test_prompts_that_attend_the_whole_prompt_get_no_prefill_graphs(tmp_path: Path):
    dream = write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=2)
    assert prefill_graph_rows(dream, decoding_strategy="d2f") == 0


def test_chunks_beside_decoders_are_bounded_only_where_steps_replay_graphs(peaky_sdar_dir: Path):
    policy = GraphPolicy(cuda_graphs=True, continues=False, staging_buffers=1, max_rows_per_request=5,
                         logits_shift=False, prefill_graph_rows=64)  # fmt: skip
    assert policy.prefill_chunk_rows == 64
    assert dataclasses.replace(policy, cuda_graphs=False).prefill_chunk_rows == 0


def test_chunks_beside_decoders_stay_short_whatever_the_largest_prefill_graph():
    """A lone prompt may replay a 2,048-row prefill graph; decoders wait for at most a 512-row chunk."""
    from diffulex.engine.prefill_graphs import CHUNK_BESIDE_DECODERS_ROWS

    policy = GraphPolicy(cuda_graphs=True, continues=False, staging_buffers=1, max_rows_per_request=5,
                         logits_shift=False, prefill_graph_rows=2048)  # fmt: skip
    assert policy.prefill_chunk_rows == CHUNK_BESIDE_DECODERS_ROWS == 512
    assert dataclasses.replace(policy, cuda_graphs=False).graph_path_chunk_rows == 512


def test_chunk_graphs_hold_a_prompt_chunk_beside_prefill_graphs_and_straggler_graphs_come_where_a_context_may_stand_out(
    peaky_sdar_dir: Path, tmp_path: Path
):
    from diffulex.engine.prefill_graphs import CHUNK_CONTEXT_MIN_KEYS, CHUNK_GRAPH_ROWS

    assert policy_for(peaky_sdar_dir).chunk_graph_rows == CHUNK_GRAPH_ROWS, "prompt chunks of up to 64 rows"
    assert policy_for(peaky_sdar_dir, max_prefill_graph_tokens=17).chunk_graph_rows == 17
    assert not policy_for(peaky_sdar_dir).straggler_graphs, "no context reaches the length that stands out"
    assert policy_for(peaky_sdar_dir, max_model_len=CHUNK_CONTEXT_MIN_KEYS).straggler_graphs
    dream = write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=2)
    short = policy_for(dream, decoding_strategy="d2f", buffer_size=2)
    assert short.chunk_graph_rows == 0 and not short.straggler_graphs
    long = policy_for(dream, decoding_strategy="d2f", buffer_size=2, max_model_len=CHUNK_CONTEXT_MIN_KEYS)
    assert long.chunk_graph_rows == 0, "no prefill graphs: no prompt chunk rides with the decoders"
    assert long.straggler_graphs


def test_short_step_graphs_exist_only_where_a_bucket_holds_them_and_only_those_are_counted(peaky_sdar_dir: Path):
    """At a buffer of four blocks the short steps' graphs hold two blocks a request, at the request buckets from 16;
    an engine of fewer requests builds none, and the memory plan then counts none of their rows."""
    from diffulex.engine.memory_plan import graph_pool_tokens

    fields = {"decoding_strategy": "multi_bd", "buffer_size": 4, "max_model_len": 256}
    wide = policy_for(peaky_sdar_dir, max_num_reqs=32, **fields)
    assert wide.short_rows_per_request == 8 and wide.short_buckets == (16, 32)
    narrow = policy_for(peaky_sdar_dir, max_num_reqs=8, **fields)
    assert narrow.short_rows_per_request is None and narrow.short_buckets == ()
    one_block = policy_for(peaky_sdar_dir, max_num_reqs=32, **{**fields, "buffer_size": 1})
    assert one_block.short_rows_per_request is None, "nothing narrower than a request's one block"
    full_only = dataclasses.replace(wide, short_rows_per_request=None, short_buckets=())
    config = _config(peaky_sdar_dir, max_num_reqs=32, **fields)
    assert graph_pool_tokens(config, wide)[0] == graph_pool_tokens(config, full_only)[0] + 32 * 8


"""What the graph policy decides from the config for prompt rows: the prefill graphs' largest bucket, and the prompt
rows a chunk beside decoders may take."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from diffulex.config import Config
from diffulex.engine.graph_policy import GraphPolicy
from diffulex.testing.checkpoints import write_tiny_checkpoint


def prefill_graph_rows(model_dir: Path, **fields) -> int:
    cfg = Config(str(model_dir), block_size=4, page_size=8, max_model_len=160, **fields)
    return GraphPolicy.decide(cfg, torch.device("cpu"), object(), logits_shift=False).prefill_graph_rows


def test_block_causal_prompts_get_prefill_graphs_up_to_the_setting_and_the_model_length(peaky_sdar_dir: Path):
    assert prefill_graph_rows(peaky_sdar_dir, max_prefill_graph_tokens=64) == 64
    assert prefill_graph_rows(peaky_sdar_dir) == 160, "512 rows by default, but no prompt is longer"
    assert prefill_graph_rows(peaky_sdar_dir, max_prefill_graph_tokens=0) == 0


def test_prompts_that_attend_the_whole_prompt_get_no_prefill_graphs(tmp_path: Path):
    dream = write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=2)
    assert prefill_graph_rows(dream, decoding_strategy="d2f") == 0


def test_chunks_beside_decoders_are_bounded_only_where_steps_replay_graphs(peaky_sdar_dir: Path):
    policy = GraphPolicy(cuda_graphs=True, continues=False, staging_buffers=1, max_rows_per_request=5,
                         logits_shift=False, prefill_graph_rows=64)  # fmt: skip
    assert policy.prefill_chunk_rows == 64
    assert dataclasses.replace(policy, cuda_graphs=False).prefill_chunk_rows == 0

"""``diffulex bench throughput --strategy fast_dllm_v2``: the Fast-dLLM-v2-7B folder, the step work read from each
request before its forward (checked against what the model runner builds), and an end-to-end CPU run on a tiny
checkpoint with the block cache on and off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffulex import Diffulex
from diffulex.bench import throughput
from diffulex.bench.roofline import ModelGeometry, block_causal_pairs
from diffulex.cli import main
from diffulex.config import Config
from diffulex.testing.checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def fdv2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "fdv2", family="fast_dllm_v2", seed=1, init_std=1.0)


def test_the_fdv2_7b_folder_has_the_qwen2_5_7b_geometry_and_the_real_tokenizer(tmp_path):
    path = throughput.write_fast_dllm_v2_checkpoint(tmp_path / "fdv2-7b", "fdv2-7b")
    assert not list(path.glob("*.safetensors"))
    config = Config(str(path), load_format="dummy", block_size=8, buffer_size=4)
    assert config.family.name == "fast_dllm_v2" and config.decoding_strategy == "fast_dllm_v2"
    geometry = ModelGeometry.from_config(config.model_config_dict)
    assert (geometry.hidden_size, geometry.num_layers, geometry.num_heads, geometry.num_kv_heads) == (3584, 28, 28, 4)
    assert (geometry.head_dim, geometry.intermediate_size, geometry.vocab_size) == (128, 18944, 152064)
    params = geometry.cost_model(itemsize=2).weight_bytes / 2
    assert 7.0e9 < params < 7.8e9  # Qwen2.5-7B: 7.6B parameters (its q/k/v biases are not counted by the model)
    vocab = json.loads((path / "added_tokens.json").read_text())
    assert vocab["|<MASK>|"] == 151665 and config.model_config_dict["eos_token_id"] == 151645


def test_a_folder_without_tokenizer_files_names_the_flag(tmp_path):
    with pytest.raises(ValueError, match="pass --data-dir DIR"):
        throughput.write_fast_dllm_v2_checkpoint(tmp_path / "x", "fdv2-7b", data_dir=tmp_path / "empty")
    with pytest.raises(ValueError, match="size='7b' is invalid"):
        throughput.write_fast_dllm_v2_checkpoint(tmp_path / "x", "7b")


def test_keys_of_a_refinement_run_to_the_end_of_its_block():
    assert throughput._keys_seen(16, 20, 24, 8) == 4 * 24  # a sub-block refined against the rest of its block
    assert throughput._keys_seen(20, 28, 28, 4) == block_causal_pairs(20, 28, 4)  # no tail: block-causal
    assert throughput._keys_seen(5, 5, 8, 8) == 0


@pytest.mark.parametrize("use_block_cache", [True, False])
def test_the_work_read_before_a_step_is_what_the_runner_builds(fdv2_dir, use_block_cache):
    """For every forward of a mixed batch: rows, sampled rows, stored K/V and keys read (prefix, own rows, the
    rest of a refined block) equal the step inputs the model runner collects for that request."""
    fields = dict(decoding_strategy="fast_dllm_v2", block_size=4, buffer_size=2, page_size=8, max_model_len=96,
                  max_num_reqs=4, accept_threshold=0.7, strategy_options={"fdv2_use_block_cache": use_block_cache})
    kinds = set()
    with pytest.warns(UserWarning, match="trained with 32-token blocks"), Diffulex(str(fdv2_dir), **fields) as llm:
        collect = llm.runner.collect

        def checked_collect(batch):
            for req in batch:
                work = throughput._fdv2_request_work(req)
                kinds.add(req.forward_kind())
                step = collect([req])
                assert work.query_tokens == step.num_tokens
                assert work.logit_rows == len(step.sample_rows)
                assert work.written_tokens == sum(slot >= 0 for slot in step.slot_mapping)
                # keys read: the cached prefix before the rows, the rows, and a refinement's cached rest of its block
                assert step.key_lens[0] - work.query_tokens - step.context_lens[0] >= 0
                assert work.context_tokens + work.query_tokens == step.key_lens[0]
            return collect(batch)

        llm.runner.collect = checked_collect
        prompts = [[5, 6, 7], list(range(10, 19)), list(range(20, 36))]
        llm.generate(prompts, throughput._greedy(20), use_tqdm=False)
    assert len(kinds) >= (3 if use_block_cache else 2)


def test_a_tiny_fast_dllm_v2_sweep_runs_end_to_end_with_the_block_cache_on_and_off(fdv2_dir, tmp_path, capsys):
    out = tmp_path / "fdv2.json"
    args = ["bench", "throughput", "--model", str(fdv2_dir), "--strategy", "fast_dllm_v2", "--block-size", "4",
            "--buffer-sizes", "2", "--batch-sizes", "1", "3", "--prompt-len", "6", "--max-tokens", "32", "--quick",
            "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["settings"]["strategy"] == "fast_dllm_v2" and report["settings"]["block_size"] == 4
    rows = report["results"]
    assert [(r["variant"], r["batch"]) for r in rows] == [("cache on", 1), ("cache on", 3), ("cache off", 1),
                                                          ("cache off", 3)]  # fmt: skip
    for row in rows:
        assert row["error"] is None and row["strategy"] == "fast_dllm_v2"
        assert row["partial_steps"] == 0 and row["steps"] >= 1
        for name in ("ms_per_step_mean", "tokens_per_s", "nfe_per_request", "memory_floor_ms", "floor_ratio"):
            assert row[name] > 0, name
    on, off = ({r["batch"]: r for r in rows if r["variant"] == v} for v in ("cache on", "cache off"))
    # with the block cache a refinement computes one sub-block of 4 rows: fewer rows per step, more cached keys
    assert on[3]["query_tokens_per_step"] < off[3]["query_tokens_per_step"]
    assert on[3]["context_tokens_per_step"] > off[3]["context_tokens_per_step"]
    printed = capsys.readouterr().out
    assert "cache off" in printed and "NFE" in printed


def test_strategy_settings_are_checked():
    with pytest.raises(ValueError, match="strategy='llada' is invalid: must be one of multi_bd, fast_dllm_v2"):
        throughput.ThroughputSettings(strategy="llada")
    with pytest.raises(ValueError, match="block_cache=.* only fast_dllm_v2 has a block cache"):
        throughput.ThroughputSettings(block_cache=[True])
    with pytest.raises(ValueError, match="use --strategy fast_dllm_v2"):
        throughput.ThroughputSettings(engine_overrides={"decoding_strategy": "fast_dllm_v2"})
    # a strategy whose steps the multi_bd accounting describes (d2f, dmax, edit) is an engine field like any other
    assert throughput.ThroughputSettings(engine_overrides={"decoding_strategy": "d2f"}).strategy == "multi_bd"
    fdv2 = throughput.ThroughputSettings(strategy="fast_dllm_v2")
    assert (fdv2.block_size, fdv2.buffer_sizes) == (8, [4])
    assert fdv2.strategy_variants == [{"fdv2_use_block_cache": True}, {"fdv2_use_block_cache": False}]
    assert throughput.ThroughputSettings().strategy_variants == [{}]


@pytest.mark.parametrize(("strategy", "geometries"), [
    ("multi_bd", ["1.7b", "4b", "8b"]), ("d2f", ["1.7b", "4b", "8b"]), ("fast_dllm_v2", ["fdv2-7b"]),
    ("dmax", ["llada2-mini"]),
])  # fmt: skip
def test_the_default_geometries_are_of_a_family_the_strategy_runs(strategy, geometries):
    assert throughput.default_geometries(strategy) == geometries


def test_a_strategy_that_runs_no_built_in_geometry_is_told_to_name_a_checkpoint():
    with pytest.raises(ValueError, match="--strategy diffusion_gemma runs none of the families.*--model DIR"):
        throughput.default_geometries("diffusion_gemma")

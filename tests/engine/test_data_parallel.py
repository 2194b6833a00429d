"""Data parallelism: replicas in their own processes behind one ``generate`` (on the CPU here)."""

from __future__ import annotations

import pytest
import torch

from diffulex import Diffulex, SamplingParams
from diffulex.engine.data_parallel import DataParallelEngine
from diffulex.testing import write_tiny_checkpoint

# On a machine with CUDA the replicas take one GPU each; a single-GPU machine cannot hold two.
pytestmark = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="two replicas need two GPUs here"
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
PROMPTS = ["one", "two three", "four five six", "seven", "eight nine"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("dp"), init_std=1.0, seed=3)


def test_two_replicas_give_each_prompt_the_single_engines_answer_in_order(ckpt):
    fields = {"block_size": 4, "max_model_len": 128}
    with Diffulex(str(ckpt), **fields) as single:
        expected = [t.token_ids for t in single.generate(PROMPTS, GREEDY, use_tqdm=False)]
    with Diffulex(str(ckpt), data_parallel_size=2, **fields) as llm:
        assert isinstance(llm, DataParallelEngine)
        out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        again = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)  # a second call, one prompt
    assert [t.index for t in out] == list(range(len(PROMPTS)))
    assert [t.token_ids for t in out] == expected
    assert again[0].token_ids == expected[0]
    assert out.num_engine_steps > 0


def test_a_replica_that_cannot_start_is_reported_with_its_error(ckpt):
    with pytest.raises(RuntimeError, match="data-parallel replica 0 failed"):
        Diffulex(str(ckpt), data_parallel_size=2, block_size=4, max_model_len=128, kv_cache_layout="distinct")


def test_a_bad_request_is_answered_without_harming_the_replicas(ckpt):
    with Diffulex(str(ckpt), data_parallel_size=2, block_size=4, max_model_len=128) as llm:
        out = llm.generate(["fine", [10**9], "also fine"], GREEDY, use_tqdm=False)
        assert out[1].completion_reason == "rejected" and "token id" in out[1].error
        assert out[0].token_ids and out[2].token_ids


def test_the_replicas_answer_for_what_reports_read(ckpt):
    with Diffulex(str(ckpt), data_parallel_size=2, block_size=4, max_model_len=128) as llm:
        expected = [torch.device("cuda", 0), torch.device("cuda", 1)] if torch.cuda.is_available() else [
            torch.device("cpu")] * 2
        assert llm.devices == expected and llm.device == expected[0]
        assert llm.dtype == torch.float32  # the tiny checkpoint's dtype, on either device
        assert llm.tokenizer.encode("one", add_special_tokens=False)
        assert llm.config.data_parallel_size == 2


def test_the_server_refuses_replicas_by_name(ckpt):
    from diffulex.server.cli import build_parser, serve

    args = build_parser().parse_args(["--model", str(ckpt), "--data-parallel-size", "2"])
    with pytest.raises(ValueError, match="data_parallel_size=2 is invalid for the server"):
        serve(args)


def test_the_benchmark_harness_runs_on_replicas(ckpt, tmp_path):
    """`diffulex bench` with ``data_parallel_size: 2``: the harness reads the replicas' device, dtype, tokenizer
    and config, and the run writes its metrics."""
    import json

    import yaml

    from diffulex.cli import main

    config = tmp_path / "dp.yml"
    config.write_text(yaml.safe_dump({
        "engine": {"model_path": str(ckpt), "data_parallel_size": 2, "block_size": 4, "max_model_len": 256},
        "eval": {"dataset_name": "gsm8k_diffulex", "dataset_limit": 3, "max_tokens": 8, "use_tqdm": False,
                 "output_dir": str(tmp_path / "out")},
    }))  # fmt: skip
    assert main(["bench", "--config", str(config)]) == 0
    (run_dir,) = (tmp_path / "out").iterdir()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["engine_resolved"]["data_parallel_size"] == 2
    assert metrics["metrics"]["num_requests"] + metrics["metrics"]["num_rejected"] == 3  # a long prompt may not fit
    assert len((run_dir / "trajectories.jsonl").read_text().splitlines()) == 3


def test_a_bad_sampling_params_entry_rejects_its_prompt_only(ckpt):
    with Diffulex(str(ckpt), data_parallel_size=2, block_size=4, max_model_len=128) as llm:
        out = llm.generate(["one", "two", "three"], [GREEDY, "not sampling params", GREEDY], use_tqdm=False)
    assert out[1].completion_reason == "rejected" and "sampling_params" in out[1].error
    assert out[0].token_ids and out[2].token_ids


class FakeReplica:
    """A pipe end that answers each ``generate`` with the next of its scripted answers."""

    def __init__(self, answers):
        self.answers, self.sent = list(answers), []

    def send(self, message):
        self.sent.append(message)

    def recv(self):
        return self.answers.pop(0)


def test_a_failed_call_leaves_no_answer_behind_for_the_next():
    from diffulex.outputs import GenerationOutputs, Trajectory

    def answer(*indices):
        return "ok", GenerationOutputs([Trajectory(i, i, [], [i], str(i), "max_new_tokens_reached", 1)
                                        for i in indices], 0.0, 1)  # fmt: skip

    llm = object.__new__(DataParallelEngine)
    llm._conns = [FakeReplica([("error", "boom"), answer(0)]), FakeReplica([answer(0), answer(0)])]
    with pytest.raises(RuntimeError, match="replica 0 failed:\nboom"):
        llm.generate(["a", "b"], GREEDY, use_tqdm=False)
    assert len(llm._conns[1].answers) == 1  # replica 1's answer to the failed call was read and dropped
    out = llm.generate(["c", "d"], GREEDY, use_tqdm=False)
    assert [t.index for t in out] == [0, 1]

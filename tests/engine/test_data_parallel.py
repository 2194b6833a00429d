"""Data parallelism: replicas in their own processes behind one ``generate`` (on the CPU here)."""

from __future__ import annotations

import multiprocessing
import os
import signal

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


@pytest.mark.parametrize("ranks", [{"tensor_parallel_size": 2}, {"expert_parallel_size": 2}], ids=["tp", "ep"])
def test_local_replicas_split_over_ranks_are_refused_before_any_starts_pointing_at_the_ray_backend(tmp_path, ranks):
    """A local replica is a daemonic process, which may not start the workers of its ranks: refused at once, by
    the fields' names, before a replica process is spawned."""
    model = write_tiny_checkpoint(tmp_path / "tp", seed=1, num_key_value_heads=2)
    (field, size), = ranks.items()
    with pytest.raises(ValueError, match=f"{field}={size} is invalid with data_parallel_size=2 and "
                                         "distributed_executor_backend='mp'.*use distributed_executor_backend='ray'"):
        Diffulex(str(model), data_parallel_size=2, block_size=4, max_model_len=128, **ranks)
    assert not multiprocessing.active_children()


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


def test_a_replica_that_dies_fails_only_its_requests_and_the_others_keep_serving(ckpt):
    long = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    fields = {"block_size": 4, "max_model_len": 128}
    with Diffulex(str(ckpt), **fields) as single:
        raw = single.generate(PROMPTS[:4], long, use_tqdm=False, apply_chat_template=False)  # as add_request sends
        expected = [t.token_ids for t in raw]
        templated = [t.token_ids for t in single.generate(PROMPTS[:2], long, use_tqdm=False)]
    with Diffulex(str(ckpt), data_parallel_size=2, **fields) as llm:
        ids = [llm.add_request(prompt, long) for prompt in PROMPTS[:4]]  # replicas 0, 1, 0, 1: the least loaded
        llm.step()
        os.kill(llm.replica_pids[0], signal.SIGKILL)
        finished = {}
        while not llm.is_finished():
            finished.update((u.req_id, u.trajectory) for u in llm.step() if u.finished)
        for i, req_id in enumerate(ids):
            traj = finished[req_id]
            if i % 2 == 0:
                assert traj.completion_reason == "error" and "data-parallel replica 0 died" in traj.error
            else:
                assert traj.error is None and traj.token_ids == expected[i]
        load = llm.load()
        assert [r.alive for r in load.replicas] == [False, True] and load.alive
        dead = load.replicas[0]  # holds nothing: not the figures of its last report, when it ran two requests
        assert (dead.running, dead.waiting, dead.kv_pages_used) == (0, 0, 0)
        # new requests go to the replica left, with the answers of a single engine
        assert [t.token_ids for t in llm.generate(PROMPTS[:2], long, use_tqdm=False)] == templated


def test_a_request_added_after_a_replica_died_unnoticed_goes_to_a_living_one(ckpt):
    """The death is not yet read from its pipe (no step since): the add finds its end of the pipe closed and goes
    to the replica left."""
    fields = {"block_size": 4, "max_model_len": 128}
    params = SamplingParams(temperature=0.0, max_tokens=8)
    with Diffulex(str(ckpt), **fields) as single:
        expected = single.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    with Diffulex(str(ckpt), data_parallel_size=2, **fields) as llm:
        os.kill(llm.replica_pids[0], signal.SIGKILL)
        llm._replicas[0].process.join(30)  # dead, and nothing read from its pipe
        req_id = llm.add_request([5, 6, 7], params)  # replica 0 would be the least loaded
        finished = {}
        while not llm.is_finished():
            finished.update((u.req_id, u.trajectory) for u in llm.step() if u.finished)
        assert finished[req_id].error is None and finished[req_id].token_ids == expected


def test_two_replicas_serve_diffusion_gemma_canvases_as_one_engine(tmp_path):
    """A strategy with its own runner (DiffusionGemma's canvases, sampled and greedy, each request's draws from its
    own seed) behind two replicas: each prompt gets the answer one engine gives it."""
    from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint

    model = write_tiny_diffusion_gemma_checkpoint(tmp_path / "dgemma", seed=0, layer_output_scale=0.5)
    prompts = [list(range(7, 7 + n)) for n in (3, 9, 14, 5)]
    params = [SamplingParams(temperature=t, max_tokens=24, seed=10 + i, ignore_eos=True)
              for i, t in enumerate((1.0, 0.0, 0.7, 1.0))]  # fmt: skip
    fields = {"max_model_len": 96, "dtype": "float32", "strategy_options": {"diffusion_gemma_max_denoising_steps": 6}}
    with Diffulex(str(model), **fields) as single:
        expected = [t.token_ids for t in single.generate(prompts, params, use_tqdm=False)]
    with Diffulex(str(model), data_parallel_size=2, **fields) as llm:
        out = llm.generate(prompts, params, use_tqdm=False)
    assert [t.token_ids for t in out] == expected


def test_each_replica_writes_its_profiler_trace_under_a_run_id_of_its_own(ckpt, tmp_path):
    profiler = {"profiler": "torch", "torch_profiler_dir": str(tmp_path), "run_id": "serve", "use_cuda": False}
    with Diffulex(str(ckpt), data_parallel_size=2, block_size=4, max_model_len=128, profiler_config=profiler) as llm:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["serve-replica0.json", "serve-replica1.json"]


# A script that uses replicas and ends without `exit()`: its replicas ignore SIGTERM (`diffulex.engine.stop_signals`),
# which the interpreter's own exit sends daemonic children before waiting for them.
SCRIPT_WITHOUT_EXIT = """
import sys
from diffulex import Diffulex, SamplingParams
llm = Diffulex(sys.argv[1], data_parallel_size=2, block_size=4, max_model_len=128)
print(llm.generate("one", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].token_ids)
"""


def test_a_script_that_never_calls_exit_still_ends_with_its_replicas(ckpt):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", SCRIPT_WITHOUT_EXIT, str(ckpt)], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("[")

"""End to end: ``diffulex bench --config FILE.yml`` on a tiny checkpoint writes every report file and metric;
the lm-eval model class on a stand-in engine; ``diffulex bench compare``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from diffulex.bench.metrics import METRIC_LABELS, Batch, compute_metrics
from diffulex.cli import main
from diffulex.outputs import GenerationOutputs, Trajectory
from diffulex.strategy.request import StepRecord

HEADLINE = ("aggregate_tps", "mean_request_tps", "decode_tps", "tpf", "mean_nfe", "ttft_mean_s", "ttft_p50_s",
            "ttft_p99_s", "latency_mean_s", "latency_p50_s", "latency_p99_s")
TASKS = ["gsm8k_diffulex", "arithmetic_diffulex"]


@pytest.fixture(scope="module")
def bench_run(sdar_dir, tmp_path_factory):
    """One real run: two tasks, two examples each, 8 tokens per answer."""
    tmp = tmp_path_factory.mktemp("bench")
    config = tmp / "tiny.yml"
    config.write_text(yaml.safe_dump({
        "engine": {"model_path": str(sdar_dir), "decoding_strategy": "block_diffusion", "max_num_reqs": 4,
                   "max_model_len": 1024, "max_num_batched_tokens": 1024},
        "eval": {"dataset_name": TASKS, "dataset_limit": 5, "max_tokens": 16, "use_tqdm": False,
                 "output_dir": str(tmp / "out")},
    }))
    # Command-line overrides win over the file: 2 examples, 8 tokens.
    code = main(["bench", "--config", str(config), "--dataset-limit", "2", "--set", "eval.max_tokens=8"])
    assert code == 0
    (run_dir,) = (tmp / "out").iterdir()
    return run_dir


def test_run_writes_every_file_and_metric(bench_run: Path):
    run_dir = bench_run
    assert run_dir.name.startswith("run_") and run_dir.name.endswith("gsm8k_diffulex_arithmetic_diffulex")
    names = {p.name for p in run_dir.iterdir()}
    expected = {"config.yml", "metrics.json", "report.md", "report.png", "results.json", "trajectories.jsonl",
                "samples_gsm8k_diffulex.jsonl", "samples_arithmetic_diffulex.jsonl"}
    assert expected <= names
    report = json.loads((run_dir / "metrics.json").read_text())
    assert set(report["files"]) == expected
    assert report["config"]["eval"]["dataset_limit"] == 2 and report["config"]["eval"]["max_tokens"] == 8
    assert report["config"]["engine"]["decoding_strategy"] == "multi_bd"
    assert report["engine_resolved"]["decoding_strategy"] == "multi_bd"
    for task in TASKS:
        acc = report["accuracy"][task]
        assert acc["metric"] == "exact_match" and 0.0 <= acc["value"] <= 1.0 and acc["num_samples"] == 2
    m = report["metrics"]
    for key in HEADLINE:
        assert isinstance(m[key], float) and m[key] > 0, key
    assert m["num_requests"] == 4 and m["num_rejected"] == 0
    assert m["latency_p50_s"] <= m["latency_p99_s"] and m["ttft_mean_s"] <= m["latency_mean_s"]
    assert m["decode_tokens"] <= m["generated_tokens"]
    assert (run_dir / "report.png").stat().st_size > 1000
    md = (run_dir / "report.md").read_text()
    for key in METRIC_LABELS:
        assert f"`{key}`" in md
    assert "![" in md and "report.png" in md
    assert yaml.safe_load((run_dir / "config.yml").read_text())["engine"]["model_path"] == report["config"][
        "engine"]["model_path"]


def test_metrics_are_consistent_with_the_recorded_trajectories(bench_run: Path):
    report = json.loads((bench_run / "metrics.json").read_text())
    m = report["metrics"]
    rows = [json.loads(line) for line in (bench_run / "trajectories.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    assert m["generated_tokens"] == sum(r["generated_tokens"] for r in rows)
    assert m["prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert m["total_nfe"] == sum(r["nfe"] for r in rows) == sum(len(r["steps"]) for r in rows)
    assert m["tpf"] == pytest.approx(m["generated_tokens"] / m["total_nfe"])
    assert m["aggregate_tps"] == pytest.approx(m["generated_tokens"] / m["wall_time_s"])
    assert all(r["generated_tokens"] <= 8 for r in rows)  # max_tokens; prompt tokens not counted
    # The metrics can be recomputed from the saved step records alone.
    trajs = [
        Trajectory(i, i, [0] * r["prompt_tokens"], [0] * r["generated_tokens"], "", r["completion_reason"],
                   r["nfe"], [StepRecord(s, q, n, (), (), t) for s, q, n, t in r["steps"]])
        for i, r in enumerate(rows)
    ]
    (batch,) = report["batches"]
    again = compute_metrics([Batch(trajs, batch["wall_time_s"])]).to_dict()
    for key, value in again.items():
        assert m[key] == pytest.approx(value), key
    samples = [json.loads(line) for line in (bench_run / "samples_arithmetic_diffulex.jsonl").read_text().splitlines()]
    assert [s["doc_id"] for s in samples] == [0, 1]
    assert samples[0]["prompt"].startswith("Question: ") and samples[0]["prompt"].endswith("\nAnswer:")
    assert set(samples[0]["scores"]) == {"exact_match"} and samples[0]["nfe"] >= 1


def test_compare_prints_the_differences(bench_run: Path, tmp_path, capsys):
    report = json.loads((bench_run / "metrics.json").read_text())
    report["metrics"]["aggregate_tps"] *= 2
    report["metrics"]["latency_p50_s"] *= 2
    report["config"]["engine"]["max_num_reqs"] = 8
    other = tmp_path / "metrics.json"
    other.write_text(json.dumps(report))
    assert main(["bench", "compare", str(bench_run), str(other)]) == 0
    out = capsys.readouterr().out
    assert "Aggregate TPS (tok/s)" in out and "+100.0% (better)" in out and "+100.0% (worse)" in out
    assert "config.engine.max_num_reqs: 4 -> 8" in out
    assert main(["bench", "compare", str(bench_run), str(other), "--json"]) == 0
    cmp = json.loads(capsys.readouterr().out)
    row = next(r for r in cmp["rows"] if r["key"] == "aggregate_tps")
    assert row["rel_pct"] == pytest.approx(100.0)
    assert main(["bench", "compare", "--json", str(bench_run), str(other)]) == 0  # the flag before the runs
    assert json.loads(capsys.readouterr().out) == cmp
    assert main(["bench", "compare", str(bench_run)]) == 2
    assert "two runs" in capsys.readouterr().err
    assert main(["bench", "compare", str(bench_run), str(tmp_path / "nothing")]) == 2


def test_code_tasks_need_allow_code_execution_and_unknown_tasks_are_named(sdar_dir, capsys):
    base = ["bench", "--model-path", str(sdar_dir), "--check"]
    assert main([*base, "--dataset-name", "humaneval_diffulex"]) == 2
    assert "allow_code_execution" in capsys.readouterr().err
    assert main([*base, "--dataset-name", "mbpp_diffulex", "--allow-code-execution"]) == 0
    assert main([*base, "--dataset-name", "gsm8k_diffulex,nope_task"]) == 2
    err = capsys.readouterr().err
    assert "'nope_task'" in err and "math500_diffulex" in err
    assert main(["bench", "--dataset-limit", "2"]) == 2
    assert "--config" in capsys.readouterr().err


# ----- the lm-eval model class on a stand-in engine ---------------------------------------------------------


class FakeEngine:
    """Records what it was asked; answers "<answer>\\nQuestion: more" with one step per request."""

    def __init__(self, tokenizer=None):
        self.tokenizer = tokenizer
        self.config = SimpleNamespace(model="/fake", tokenizer_path=None)
        self.calls = []

    def generate(self, prompts, params, use_tqdm=True, **prompt_options):
        self.calls.append((prompts, params))
        self.prompt_options = prompt_options
        trajs = [
            Trajectory(i, i, [1, 2], [5, 6], " 42\nQuestion: more", "max_new_tokens_reached", 1,
                       [StepRecord(0, 3, 2, (0,), (), 0.1)])
            for i in range(len(prompts))
        ]
        return GenerationOutputs(trajs, 0.2, 1)


def _request(context, gen_kwargs, doc_id=0):
    return SimpleNamespace(args=(context, gen_kwargs), task_name="t", doc_id=doc_id)


def test_lm_eval_model_batches_requests_and_applies_settings(sdar_dir):
    from diffulex.bench.lm_eval_model import DiffulexLM
    from diffulex.tokenizer import load_tokenizer

    engine = FakeEngine(load_tokenizer(sdar_dir))
    lm = DiffulexLM(engine=engine, temperature=0.0, max_nfe=5)
    reqs = [_request("Q1", {"until": ["\nQuestion:"], "max_gen_toks": 64}), _request("Q2", {"until": "\n\n"}, 1)]
    assert lm.generate_until(reqs) == [" 42", " 42\nQuestion: more"]
    (prompts, params), = engine.calls  # one engine call for the whole batch
    assert prompts == ["Q1", "Q2"]
    # lm-eval's contexts are finished prompts: sent as they are, their chat markup read as special tokens.
    assert engine.prompt_options == {"apply_chat_template": False, "parse_special_tokens": True}
    assert [p.max_tokens for p in params] == [64, 256]  # the task's length, else the default
    assert params[0].stop == ["\nQuestion:"] and params[1].stop == ["\n\n"]
    assert all(p.temperature == 0.0 and p.max_nfe == 5 for p in params)
    assert len(lm.batches) == 1 and [r.doc_id for r in lm.records] == [0, 1]
    # The run's max_tokens wins over the task's.
    lm2 = DiffulexLM(engine=engine, max_tokens=8)
    assert lm2.sampling_params({"max_gen_toks": 64})[0].max_tokens == 8
    # Chat template: a trailing assistant message (answer prefix) is continued, not closed.
    chat = lm.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cont = lm.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}],
                                  add_generation_prompt=False)
    assert cont.endswith("<|im_start|>assistant\nSure:")


def test_lm_eval_model_rejects_loglikelihood():
    from diffulex.bench.lm_eval_model import DiffulexLM

    lm = DiffulexLM(engine=FakeEngine())
    for method in (lm.loglikelihood, lm.loglikelihood_rolling):
        with pytest.raises(NotImplementedError, match="does not support loglikelihood"):
            method([_request("a", {})])
    with pytest.raises(ValueError, match="no chat template"):
        lm.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="pretrained"):
        DiffulexLM()


def test_lm_eval_registry_knows_the_model():
    from lm_eval.api.registry import get_model

    from diffulex.bench.lm_eval_model import DiffulexLM

    assert get_model("diffulex") is DiffulexLM


def test_data_file_and_split_override_the_task_data(sdar_dir, tmp_path):
    from diffulex.bench.config import load_bench_config
    from diffulex.bench.runner import load_tasks, task_manager

    rows = [{"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"} for i in range(3)]
    data = tmp_path / "mine.json"
    data.write_text(json.dumps({"dev": rows, "test": rows[:1]}))
    cfg = load_bench_config(None, {"model_path": str(sdar_dir)},
                            {"dataset_name": "arithmetic_diffulex", "data_file": str(data), "dataset_split": "dev"})
    task = load_tasks(cfg, task_manager(cfg))["arithmetic_diffulex"]
    docs = list(task.test_docs())
    assert [d["question"] for d in docs] == [r["question"] for r in rows]
    assert task.doc_to_text(docs[0]) == "Question: What is 0 + 1?\nAnswer:"


def test_data_rows_without_the_tasks_keys_are_named_before_the_model_loads(sdar_dir, tmp_path, capsys):
    """The first row (lm-eval's own check would end in a jinja2 traceback) and a later one (it would render None)."""
    base = ["bench", "--model-path", str(sdar_dir), "--dataset-name", "arithmetic_diffulex", "--check"]
    first = tmp_path / "first.json"
    first.write_text(json.dumps([{"q": "What is 1 + 1?", "answer": "#### 2"}]))
    assert main([*base, "--data-file", str(first)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: eval.data_file='{first}': row 0 (counting from 0) has no key 'question'")
    assert "reads 'question', 'answer'" in err and "this row has 'q', 'answer'" in err
    later = tmp_path / "later.json"
    later.write_text(json.dumps({"test": [{"question": "What is 1 + 1?", "answer": "#### 2"},
                                          {"question": "What is 2 + 2?"}]}))  # fmt: skip
    assert main([*base, "--data-file", str(later)]) == 2
    assert f"eval.data_file='{later}': row 1 (counting from 0) has no key 'answer'" in capsys.readouterr().err
    # only the rows the run evaluates are read
    assert main([*base, "--data-file", str(later), "--dataset-limit", "1"]) == 0

"""The benchmark YAML schema: defaults, aliases, overrides, and errors that name the key."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import yaml

from diffulex.bench.cli import parse_set
from diffulex.bench.config import EvalConfig, engine_field_names, load_bench_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yml"))


def write(tmp_path: Path, data, name: str = "bench.yml") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def test_sections_defaults_and_strategy_aliases(tmp_path, sdar_dir):
    for old in ("multi_block_diffusion", "block_diffusion", "fast_dllm"):
        path = write(tmp_path, {"engine": {"model_path": str(sdar_dir), "decoding_strategy": old,
                                           "max_num_reqs": 4}})
        cfg = load_bench_config(path)
        assert cfg.engine == {"decoding_strategy": "multi_bd", "max_num_reqs": 4}
    assert cfg.model == str(sdar_dir)
    assert cfg.eval == EvalConfig()
    assert cfg.eval.dataset_name == "gsm8k_diffulex"
    assert cfg.to_dict()["engine"]["model_path"] == str(sdar_dir)


def test_old_engine_key_names_and_flat_layout(tmp_path, sdar_dir):
    flat = {"model_path": str(sdar_dir), "diffusion_block_size": 4, "max_num_seqs": 3, "dataset_limit": 5,
            "dataset_name": ["gsm8k_diffulex", "math500_diffulex"]}
    cfg = load_bench_config(write(tmp_path, flat))
    assert cfg.engine == {"block_size": 4, "max_num_reqs": 3}
    assert cfg.eval.dataset_limit == 5
    assert cfg.eval.task_names == ["gsm8k_diffulex", "math500_diffulex"]


@pytest.mark.parametrize(
    ("engine", "message"),
    [
        ({"model_path": "A", "model": "B"}, "engine.model='B' conflicts with model_path='A'"),
        ({"max_num_seqs": 3, "max_num_reqs": 4},
         "engine.max_num_seqs=3 conflicts with max_num_reqs=4: max_num_seqs is another name of max_num_reqs"),
    ],
    ids=["model-path-twice", "old-and-new-name"],
)
def test_a_field_given_under_two_names_with_two_values_is_refused_as_the_engine_refuses_it(tmp_path, engine,
                                                                                            message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_bench_config(write(tmp_path, {"engine": {"model_path": "M", **engine}}), check_model=False)
    same = dict.fromkeys(engine, next(iter(engine.values())))  # one value under both names is fine
    load_bench_config(write(tmp_path, {"engine": {"model_path": "M", **same}}), check_model=False)


def test_overrides_win_over_the_file(tmp_path, sdar_dir):
    path = write(tmp_path, {"engine": {"model_path": "/nowhere", "diffusion_block_size": 8},
                            "eval": {"dataset_limit": 10, "max_tokens": 64}})
    cfg = load_bench_config(path, {"model": str(sdar_dir), "block_size": 4}, {"dataset_limit": 2})
    assert cfg.model == str(sdar_dir)
    assert cfg.engine == {"block_size": 4}
    assert (cfg.eval.dataset_limit, cfg.eval.max_tokens) == (2, 64)


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"engine": {"model_path": "M", "max_num_reqz": 4}}, "'max_num_reqz'"),
        ({"engine": {"model_path": "M"}, "eval": {"dataset_limt": 4}}, "'dataset_limt'"),
        ({"engine": {"model_path": "M"}, "evaluation": {}}, "'evaluation'"),
        ({"model_path": "M", "not_a_key": 1}, "'not_a_key'"),
        ({"engine": {"model_path": "M"}, "eval": {"dataset_limit": "ten"}}, "eval.dataset_limit='ten'"),
        ({"engine": {"model_path": "M"}, "eval": {"dataset_limit": 0}}, "eval.dataset_limit=0"),
        ({"engine": {"model_path": "M"}, "eval": {"ignore_eos": "false"}}, "eval.ignore_eos='false'"),
        ({"engine": {"model_path": "M"}, "eval": {"temperature": "hot"}}, "eval.temperature='hot'"),
        ({"engine": {"model_path": "M"}, "eval": {"dataset_name": 3}}, "eval.dataset_name=3"),
        ({"engine": {"model_path": "M", "max_num_reqs": "many"}}, "engine.max_num_reqs='many'"),
        ({"engine": {"model_path": "M", "enforce_eager": "yes"}}, "engine.enforce_eager='yes'"),
        ({"engine": {"model_path": "M", "decoding_thresholds": 0.9}}, "engine.decoding_thresholds=0.9"),
        ({"engine": {"max_num_reqs": 4}}, "engine.model_path is required"),
        ({"eval": {"dataset_limit": 2}}, "engine.model_path is required"),
        ({"engine": {"model_path": 7}}, "engine.model_path=7"),
        ({"engine": ["model_path"]}, "'engine' must be a mapping"),
        (["engine"], "must be a mapping"),
        ({"engine": {"model_path": "M"}, "eval": {"data_file": "x.json",
                                                  "dataset_name": "gsm8k_diffulex,math500_diffulex"}},
         "eval.data_file"),
    ],
)
def test_bad_yaml_names_the_key(tmp_path, doc, needle):
    path = write(tmp_path, doc)
    with pytest.raises(ValueError) as err:
        load_bench_config(path, check_model=False)
    assert needle in str(err.value)
    assert str(path) in str(err.value)


def test_missing_model_directory_and_engine_validation(tmp_path, sdar_dir):
    with pytest.raises(ValueError, match=r"engine.model_path='/does/not/exist' is not an existing directory"):
        load_bench_config(write(tmp_path, {"engine": {"model_path": "/does/not/exist"}}))
    # Range errors come from the engine's own validation, still naming the field.
    with pytest.raises(ValueError, match=r"engine: block_size=12 is invalid"):
        load_bench_config(write(tmp_path, {"engine": {"model_path": str(sdar_dir), "block_size": 12}}))


def test_an_output_dir_that_cannot_be_a_directory_is_refused_with_the_config(tmp_path, sdar_dir):
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for output_dir, needle in [
        (a_file, f"eval.output_dir='{a_file}' is invalid: is an existing file: must be a directory"),
        (a_file / "runs", f"eval.output_dir='{a_file / 'runs'}' is invalid: cannot be created: '{a_file}' is a file"),
    ]:
        path = write(tmp_path, {"engine": {"model_path": str(sdar_dir)}, "eval": {"output_dir": str(output_dir)}})
        with pytest.raises(ValueError, match=re.escape(f"{path}: {needle}")):
            load_bench_config(path)
        load_bench_config(path, check_model=False)  # names and types only: nothing on disk is looked at
    fine = write(tmp_path, {"engine": {"model_path": str(sdar_dir)}, "eval": {"output_dir": str(tmp_path / "a/b")}})
    assert load_bench_config(fine).eval.output_dir == str(tmp_path / "a/b")


def test_a_bad_value_from_the_command_line_is_blamed_on_the_command_line(tmp_path, sdar_dir, capsys):
    from diffulex.cli import main

    path = write(tmp_path, {"engine": {"model_path": str(sdar_dir)}, "eval": {"dataset_limit": 2}})
    assert main(["bench", "--config", str(path), "--set", "eval.dataset_limit=abc", "--check"]) == 2
    err = capsys.readouterr().err
    assert err == "error: --set eval.dataset_limit=abc: eval.dataset_limit='abc' is invalid: must be an integer > 0\n"
    assert main(["bench", "--config", str(path), "--block-size", "12", "--check"]) == 2
    assert capsys.readouterr().err.startswith("error: --block-size: engine: block_size=12 is invalid")
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    assert main(["bench", "--config", str(path), "--output-dir", str(a_file), "--check"]) == 2
    assert capsys.readouterr().err.startswith(f"error: --output-dir: eval.output_dir='{a_file}' is invalid")
    # a value of the file is still the file's
    bad = write(tmp_path, {"engine": {"model_path": str(sdar_dir)}, "eval": {"dataset_limit": "abc"}}, "bad.yml")
    with pytest.raises(ValueError, match=f"^{re.escape(str(bad))}: eval.dataset_limit='abc'"):
        load_bench_config(bad, None, {"max_tokens": 8}, origins={"eval.max_tokens": "--max-tokens"})


def test_unreadable_yaml(tmp_path):
    path = write(tmp_path, "engine: [unclosed\n")
    with pytest.raises(ValueError, match="could not be read"):
        load_bench_config(path)


def test_set_flag_parsing():
    engine, eval_ = parse_set(["engine.decoding_thresholds={accept_threshold: 0.95}", "eval.dataset_limit=3",
                               "eval.include_path="])
    assert engine == {"decoding_thresholds": {"accept_threshold": 0.95}}
    assert eval_ == {"dataset_limit": 3, "include_path": None}
    with pytest.raises(ValueError, match="SECTION|engine.KEY=VALUE"):
        parse_set(["dataset_limit=3"])


def test_eval_keys_do_not_collide_with_engine_fields():
    assert not set(EvalConfig.names()) & set(engine_field_names())


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_example_configs_are_valid(path, sdar_dir):
    cfg = load_bench_config(path, check_model=False)
    assert cfg.model.startswith("/path/to/")  # the model path is the user's
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_bench_config(path, {"model_path": str(sdar_dir)})  # the engine accepts every field


def test_example_configs_cover_the_families():
    families = {yaml.safe_load(p.read_text())["engine"].get("model_name") for p in CONFIGS}
    assert {"sdar", "sdar_moe", "dream", "llada", "llada2_mini", "fast_dllm_v2", "diffusion_gemma"} <= families

"""`diffulex generate`: JSON output, exit code 2 with a message naming the field, YAML engine sections."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from diffulex.cli import main
from diffulex.engine import engine as engine_module

REPO = Path(__file__).resolve().parents[1]
BASE = ["--max-tokens", "8", "--block-size", "4", "--buffer-size", "2", "--json", "--quiet"]


def run_cli(argv: list[str]) -> int:
    """The exit status the console script would have: argparse errors raise SystemExit instead of returning."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture
def seen_configs(monkeypatch):
    """Record the Config every engine built in the test was given."""
    configs = []
    original = engine_module.DiffulexEngine.__init__

    def spy(self, config, *rest):
        configs.append(config)
        original(self, config, *rest)

    monkeypatch.setattr(engine_module.DiffulexEngine, "__init__", spy)
    return configs


def write_yaml(tmp_path, text: str):
    path = tmp_path / "engine.yml"
    path.write_text(text)
    return str(path)


def test_generate_prints_json_and_returns_zero(sdar_dir, capsys):
    rc = main(["generate", "--model", str(sdar_dir), *BASE, "hello"])
    assert rc == 0
    data = json.loads(capsys.readouterr().out)
    (row,) = data["outputs"]
    assert row["prompt"] == "hello"
    assert isinstance(row["text"], str)
    assert 1 <= len(row["token_ids"]) <= 8
    assert row["error"] is None and row["nfe"] >= 1
    assert {"tps", "tpf", "nfe"} <= set(data)


def test_one_output_per_prompt_in_order(sdar_dir, capsys):
    assert main(["generate", "--model", str(sdar_dir), *BASE, "hello", "The old lighthouse"]) == 0
    rows = json.loads(capsys.readouterr().out)["outputs"]
    assert [r["prompt"] for r in rows] == ["hello", "The old lighthouse"]


def test_block_size_outside_the_choices_exits_with_code_2_naming_it(sdar_dir, capsys):
    rc = run_cli(["generate", "--model", str(sdar_dir), "--block-size", "12", "--json", "--quiet", "hello"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "error: block_size=12 is invalid: must be one of 4, 8, 16, 32"


def test_block_size_rejected_by_the_config_returns_2_naming_the_field(sdar_dir, capsys):
    rc = run_cli(["generate", "--model", str(sdar_dir), "--block-size", "256", "--json", "--quiet", "hello"])
    assert rc == 2
    captured = capsys.readouterr()
    assert "block_size=256 is invalid" in captured.err
    assert captured.out == ""


def test_bad_buffer_size_returns_2_naming_the_field(sdar_dir, capsys):
    assert run_cli(["generate", "--model", str(sdar_dir), "--buffer-size", "0", "--quiet", "hello"]) == 2
    assert "buffer_size=0 is invalid" in capsys.readouterr().err


def test_yaml_engine_section_is_applied(sdar_dir, tmp_path, capsys, seen_configs):
    config = write_yaml(tmp_path, "engine:\n  buffer_size: 3\n  block_size: 4\n  max_model_len: 6\n")
    rc = main(["generate", "--model", str(sdar_dir), "--config", config, "--max-tokens", "8", "--json", "--quiet",
               "--raw", "hello"])
    assert rc == 0
    assert (seen_configs[0].buffer_size, seen_configs[0].max_model_len) == (3, 6)
    (row,) = json.loads(capsys.readouterr().out)["outputs"]
    assert row["completion_reason"] == "max_model_len_reached"  # "hello" is 3 tokens: 3 generated, not 8
    assert len(row["token_ids"]) == 3


def test_flat_yaml_with_model_path(sdar_dir, tmp_path, capsys, seen_configs):
    config = write_yaml(tmp_path, f"model_path: {sdar_dir}\nbuffer_size: 3\nblock_size: 4\n")
    assert main(["generate", "--config", config, "--max-tokens", "4", "--json", "--quiet", "hello"]) == 0
    assert seen_configs[0].model == str(sdar_dir) and seen_configs[0].buffer_size == 3
    assert json.loads(capsys.readouterr().out)["outputs"][0]["error"] is None


def test_command_line_flags_override_the_yaml(sdar_dir, tmp_path, capsys, seen_configs):
    config = write_yaml(tmp_path, "engine:\n  buffer_size: 3\n  block_size: 8\n")
    assert main(["generate", "--model", str(sdar_dir), "--config", config, *BASE, "hello"]) == 0
    assert (seen_configs[0].buffer_size, seen_configs[0].block_size) == (2, 4)


def test_bad_value_in_yaml_returns_2_naming_the_field(sdar_dir, tmp_path, capsys):
    config = write_yaml(tmp_path, "engine:\n  block_size: 12\n")
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", config, "--quiet", "hello"]) == 2
    assert "block_size=12 is invalid" in capsys.readouterr().err


def test_yaml_that_is_not_a_mapping_returns_2(sdar_dir, tmp_path, capsys):
    config = write_yaml(tmp_path, "- block_size\n- 4\n")
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", config, "--quiet", "hello"]) == 2
    assert "must be a mapping" in capsys.readouterr().err


def test_missing_yaml_file_returns_2(sdar_dir, tmp_path, capsys):
    missing = str(tmp_path / "nope.yml")
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", missing, "--quiet", "hello"]) == 2
    assert "could not be read" in capsys.readouterr().err


def test_unknown_yaml_field_is_at_least_named(sdar_dir, tmp_path, capsys):
    config = write_yaml(tmp_path, "engine:\n  buffer_size: 2\n  acept_threshold: 0.5\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_cli(["generate", "--model", str(sdar_dir), "--config", config, *BASE, "hello"])
    reported = capsys.readouterr().err + " ".join(str(w.message) for w in caught)
    assert "acept_threshold" in reported


def test_unknown_yaml_field_is_an_error_naming_it(sdar_dir, tmp_path, capsys):
    config = write_yaml(tmp_path, "engine:\n  buffer_size: 2\n  acept_threshold: 0.5\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = run_cli(["generate", "--model", str(sdar_dir), "--config", config, *BASE, "hello"])
    assert rc == 2
    assert "acept_threshold" in capsys.readouterr().err


# --- presentation: short errors, defaults in --help, one line per warning -------------------------------------


def test_an_argument_error_is_a_short_usage_line_the_error_and_where_to_look(capsys):
    assert run_cli(["generate", "--max-tokens", "many", "hello"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "usage: diffulex generate [options] [prompts ...]",
        "diffulex generate: error: argument --max-tokens: expected an integer, got 'many'",
        "see 'diffulex generate --help'",
    ]


def test_an_unknown_flag_names_the_subcommand_it_was_given_to(capsys):
    assert run_cli(["generate", "--no-such-flag", "hello"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and err[1] == "diffulex generate: error: unrecognized arguments: --no-such-flag"


def test_help_shows_the_defaults_of_sampling_flags_and_engine_fields(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-tokens MAX_TOKENS answer length limit (default: 64)" in text
    assert "(default: 0.0 here; the Python API and the server default to 1.0)" in text
    assert "(default: 0.9)" in text  # accept_threshold, an engine field


def test_a_deprecated_strategy_name_and_an_override_each_print_one_line(sdar_dir):
    """Run as a user runs it (a fresh process, logging as the console script sets it up): the deprecated name is
    accepted, and each warning appears once on stderr, not once as a log line and again as a Python warning."""
    argv = ["generate", "--model", str(sdar_dir), *BASE, "--decoding-strategy", "block_diffusion",
            "--multi-block-prefix-full", "hello"]
    done = subprocess.run([sys.executable, "-m", "diffulex.cli", *argv], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["outputs"][0]["error"] is None
    warnings_seen = [line for line in done.stderr.splitlines() if "WARNING" in line or "Warning" in line]
    assert len(warnings_seen) == 2, done.stderr
    assert "decoding_strategy='block_diffusion' is deprecated; use 'multi_bd'" in warnings_seen[0]
    assert "multi_block_prefix_full=True is overridden to False" in warnings_seen[1]


def test_the_progress_bar_shows_a_rate_only_once_there_is_one(sdar_dir, capsys):
    argv = ["generate", "--model", str(sdar_dir), "--max-tokens", "8", "--block-size", "4", "--json", "hi", "there"]
    assert main(argv) == 0
    bar = capsys.readouterr().err
    assert "tok/s" in bar
    assert " 0 tok/s" not in bar


def test_generate_help_shows_the_sampling_defaults_and_the_raw_switch(capsys):
    assert run_cli(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: 0.0 here; the Python API and the server default to 1.0)" in out
    assert "(default: 64)" in out and "(default: 1.0)" in out
    assert "--raw, --no-chat-template" in out and "--parse-special-tokens" in out


@pytest.mark.parametrize(("flags", "templated"), [([], True), (["--raw"], False), (["--no-chat-template"], False)])
def test_generate_asks_a_chat_model_through_its_template_unless_raw(sdar_dir, capsys, monkeypatch, flags, templated):
    seen = []
    original = engine_module.DiffulexEngine.generate

    def spy(self, prompts, *args, **kwargs):
        out = original(self, prompts, *args, **kwargs)
        seen.extend(t.prompt_token_ids for t in out.trajectories)
        return out

    monkeypatch.setattr(engine_module.DiffulexEngine, "generate", spy)
    assert main(["generate", "--model", str(sdar_dir), *BASE, *flags, "hello"]) == 0
    im_start = 377  # the tiny SDAR tokenizer's <|im_start|>
    assert (seen[0][0] == im_start) is templated


# --- dict and list engine fields take JSON on the command line, as in Python, YAML and HTTP ----------------------


def _json_fields() -> list[tuple[str, str, object]]:
    """(flag, JSON text, value) for every engine field whose type is a dict or a list (plugins has --plugin)."""
    import typing

    from diffulex.cli import _base_type
    from diffulex.config import Config, engine_fields

    hints = typing.get_type_hints(Config)
    samples = {dict: ('{"a": 1}', {"a": 1}), list: ("[0, 1]", [0, 1])}
    return [
        ("--" + f.name.replace("_", "-"), *samples[_base_type(hints[f.name])])
        for f in engine_fields()
        if _base_type(hints[f.name]) in samples and f.name != "plugins"
    ]


def test_every_dict_and_list_engine_field_is_read_from_json_on_the_command_line():
    from diffulex.cli import build_parser, engine_overrides

    cases = _json_fields()
    flags = [flag for flag, _, _ in cases]
    assert {"--decoding-thresholds", "--profiler-config", "--strategy-options", "--device-ids"} <= set(flags)
    args = build_parser().parse_args(["generate", *[x for flag, text, _ in cases for x in (flag, text)]])
    overrides = engine_overrides(args)
    assert {flag: overrides[flag[2:].replace("-", "_")] for flag in flags} == {f: v for f, _, v in cases}


def test_decoding_thresholds_and_profiler_config_flags_configure_the_engine(sdar_dir, capsys, seen_configs):
    argv = ["generate", "--model", str(sdar_dir), *BASE, "--decoding-thresholds", '{"accept_threshold": 0.5}',
            "--profiler-config", '{"record_shapes": true}', "hello"]
    assert main(argv) == 0
    assert seen_configs[0].decoding_thresholds.accept_threshold == 0.5
    assert seen_configs[0].profiler_config.record_shapes is True


@pytest.mark.parametrize("text", ["{accept_threshold: 0.5}", "[0.5]", "0.5"])
def test_a_dict_flag_given_anything_but_a_json_object_is_refused_naming_the_flag(text, capsys):
    assert run_cli(["generate", "--decoding-thresholds", text, "hello"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[1].startswith(
        "diffulex generate: error: argument --decoding-thresholds: expected a JSON object, e.g. '{\"key\": 1}', "
        f"got {text!r}"
    )


def test_a_list_flag_given_a_json_object_is_refused_saying_a_list_is_expected(capsys):
    assert run_cli(["generate", "--device-ids", '{"a": 1}', "hello"]) == 2
    assert "argument --device-ids: expected a JSON list, e.g. '[0, 1]', got '{\"a\": 1}'" in capsys.readouterr().err


@pytest.mark.parametrize(("flag", "expected"), [("--max-model-len", "an integer"), ("--gpu-memory-utilization",
                                                                                     "a number")])
def test_a_number_flag_given_text_says_what_it_expects(flag, expected, capsys):
    assert run_cli(["generate", flag, "abc", "hello"]) == 2
    assert capsys.readouterr().err.splitlines()[1] == (
        f"diffulex generate: error: argument {flag}: expected {expected}, got 'abc'"
    )


@pytest.mark.parametrize(("flag", "expected"), [("--max-tokens", "an integer"), ("--top-k", "an integer"),
                                                ("--max-nfe", "an integer"), ("--temperature", "a number"),
                                                ("--top-p", "a number")])
def test_a_sampling_flag_given_text_says_what_it_expects_like_an_engine_flag(flag, expected, capsys):
    assert run_cli(["generate", flag, "abc", "hello"]) == 2
    assert capsys.readouterr().err.splitlines()[1] == (
        f"diffulex generate: error: argument {flag}: expected {expected}, got 'abc'"
    )


def test_the_sampling_limits_whose_default_is_none_take_none_the_others_refuse_it(capsys):
    """`--max-nfe` and `--max-repetition-run` say "(default: none)" in --help; `none` gives them that default, as
    it unsets an engine flag. `--max-tokens none` has no meaning and is refused at parse time."""
    from diffulex.cli import build_parser

    args = build_parser().parse_args(["generate", "--max-nfe", "none", "--max-repetition-run", "null", "hi"])
    assert args.max_nfe is None and args.max_repetition_run is None
    assert run_cli(["generate", "--max-tokens", "none", "hello"]) == 2
    assert "argument --max-tokens: expected an integer, got 'none'" in capsys.readouterr().err


# --- a bad file or checkpoint is one line naming it, never a traceback ---------------------------------------


def last_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def test_a_yaml_nested_too_deeply_is_an_error_naming_the_file(sdar_dir, tmp_path, capsys):
    config = write_yaml(tmp_path, "[" * 100_000)
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", config, "hello"]) == 2
    assert last_error_line(capsys) == (
        f"error: config={config!r} could not be read: its lists or mappings are nested too deeply for the YAML parser"
    )


def test_a_yaml_that_is_not_utf8_is_an_error_naming_the_file(sdar_dir, tmp_path, capsys):
    config = tmp_path / "latin1.yml"
    config.write_bytes(b"block_size: 4\n# caf\xe9\n")
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", str(config), "hello"]) == 2
    assert last_error_line(capsys) == (
        f"error: config={str(config)!r} could not be read: it is not UTF-8 text (byte 0xe9 at offset 19)"
    )


def copy_checkpoint(sdar_dir, tmp_path) -> Path:
    import shutil

    return Path(shutil.copytree(sdar_dir, tmp_path / "ckpt"))


def test_a_checkpoint_with_scaled_rope_is_a_one_line_unsupported_error_naming_the_field(sdar_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(sdar_dir, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config["rope_scaling"] = {"type": "yarn", "factor": 4.0}
    (ckpt / "config.json").write_text(json.dumps(config))
    assert run_cli(["generate", "--model", str(ckpt), *BASE, "hello"]) == 2
    line = last_error_line(capsys)
    assert line.startswith("error: config field rope_scaling={'type': 'yarn', 'factor': 4.0} is unsupported: ")
    assert "rope type 'yarn' is not implemented" in line and "'default'" in line


def test_a_config_json_that_links_to_itself_is_a_one_line_error_naming_it(sdar_dir, tmp_path, capsys):
    ckpt = copy_checkpoint(sdar_dir, tmp_path)
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").symlink_to("config.json")
    assert run_cli(["generate", "--model", str(ckpt), *BASE, "hello"]) == 2
    line = last_error_line(capsys)
    assert line.startswith(f"error: {ckpt / 'config.json'}: its symbolic links cannot be followed")


# --- YAML: two names of one field, or one key twice, are refused --------------------------------------------


def test_yaml_with_num_kvcache_blocks_and_a_different_num_pages_is_refused(sdar_dir, tmp_path, capsys, seen_configs):
    config = write_yaml(tmp_path, "num_pages: 64\nnum_kvcache_blocks: 32\n")
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", config, *BASE, "hello"]) == 2
    assert last_error_line(capsys) == (
        f"error: config={config!r}: num_kvcache_blocks=32 conflicts with num_pages=64: num_kvcache_blocks is "
        "another name of num_pages, give only one"
    )
    assert seen_configs == []


def test_yaml_with_model_and_a_different_model_path_is_refused(sdar_dir, tmp_path, capsys, seen_configs):
    config = write_yaml(tmp_path, f"model: {sdar_dir}\nmodel_path: {tmp_path}\n")
    assert run_cli(["generate", "--config", config, *BASE, "hello"]) == 2
    assert last_error_line(capsys) == (
        f"error: config={config!r}: model_path={str(tmp_path)!r} conflicts with model={str(sdar_dir)!r}: "
        "model_path is another name of model, give only one"
    )
    assert seen_configs == []


def test_yaml_reads_the_old_field_names_the_benchmark_files_and_python_read(sdar_dir, tmp_path, capsys, seen_configs):
    config = write_yaml(tmp_path, "engine:\n  diffusion_block_size: 4\n  max_num_seqs: 3\n  buffer_size: 1\n")
    assert main(["generate", "--model", str(sdar_dir), "--config", config, "--max-tokens", "4", "--quiet", "hi"]) == 0
    assert (seen_configs[0].block_size, seen_configs[0].max_num_reqs) == (4, 3)


def test_a_benchmark_files_eval_section_is_named_as_having_no_effect_on_generate(sdar_dir, tmp_path, caplog,
                                                                                   seen_configs):
    config = write_yaml(tmp_path, "engine:\n  block_size: 4\neval:\n  max_tokens: 1024\n  temperature: 0.0\n")
    assert main(["generate", "--model", str(sdar_dir), "--config", config, *BASE, "hello"]) == 0
    assert "the eval section (max_tokens, temperature) is read by `diffulex bench`" in caplog.text


def test_an_engine_field_beside_the_engine_section_is_refused(sdar_dir, tmp_path, capsys, seen_configs):
    config = write_yaml(tmp_path, "engine:\n  block_size: 4\nbuffer_size: 2\n")
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", config, *BASE, "hello"]) == 2
    assert last_error_line(capsys) == (
        f"error: config={config!r}: buffer_size beside the engine section would have no effect; give engine fields "
        "inside it"
    )
    assert seen_configs == []
    assert seen_configs == []


def test_yaml_giving_both_names_of_a_field_one_value_is_accepted_as_in_python(tmp_path):
    from diffulex.cli import load_yaml_engine_fields

    config = write_yaml(tmp_path, "model: /ckpt\nmodel_path: /ckpt\nnum_pages: 64\nnum_kvcache_blocks: 64\n")
    assert load_yaml_engine_fields(config) == {"model": "/ckpt", "num_pages": 64}


@pytest.mark.parametrize(
    ("text", "key", "lines"),
    [("block_size: 4\nbuffer_size: 2\nblock_size: 8\n", "'block_size'", "1 and 3"),
     ("engine:\n  buffer_size: 2\n  buffer_size: 2\n", "'buffer_size'", "2 and 3"),
     ("decoding_thresholds: {accept_threshold: 0.5, accept_threshold: 0.7}\n", "'accept_threshold'", "1 and 1")],
)
def test_yaml_giving_a_key_twice_is_refused_naming_the_key_and_the_file(sdar_dir, tmp_path, capsys, text, key, lines):
    config = write_yaml(tmp_path, text)
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", config, "hello"]) == 2
    assert last_error_line(capsys) == (
        f"error: config={config!r} is invalid: the key {key} is given twice (lines {lines}); give each key once"
    )


def test_yaml_merge_keys_may_be_overridden_by_the_mapping_that_merges_them(tmp_path):
    from diffulex.cli import load_yaml_engine_fields

    text = "base: &base {block_size: 4, buffer_size: 3}\nengine:\n  <<: *base\n  block_size: 8\n"
    config = write_yaml(tmp_path, text)
    assert load_yaml_engine_fields(config) == {"block_size": 8, "buffer_size": 3}


def test_a_yaml_key_that_is_not_a_field_name_string_is_refused_naming_it(sdar_dir, tmp_path, capsys):
    config = write_yaml(tmp_path, "engine:\n  1: 2\n  buffer_size: 2\n")
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", config, "hello"]) == 2
    assert last_error_line(capsys) == (
        f"error: config={config!r}: the key 1 is invalid: engine keys are field names (strings)"
    )


# --- an empty --model is refused; prompts after -- may start with a dash ---------------------------------------


def test_an_empty_model_flag_is_refused_instead_of_running_the_built_in_model(capsys, seen_configs):
    assert run_cli(["generate", "--model", "", *BASE, "hello"]) == 2
    assert last_error_line(capsys) == (
        "error: --model='' is invalid: must be the path of a checkpoint folder (leave the flag out for the built-in "
        "model)"
    )
    assert seen_configs == []


def test_an_empty_model_in_the_yaml_is_refused(tmp_path, capsys, seen_configs):
    config = write_yaml(tmp_path, "model: ''\n")
    assert run_cli(["generate", "--config", config, *BASE, "hello"]) == 2
    assert last_error_line(capsys) == (
        f"error: config={config!r}: model='' is invalid: must be the path of a checkpoint folder"
    )
    assert seen_configs == []


def test_an_empty_config_flag_is_refused_instead_of_ignored(sdar_dir, capsys, seen_configs):
    assert run_cli(["generate", "--model", str(sdar_dir), "--config", "", *BASE, "hello"]) == 2
    assert last_error_line(capsys) == "error: config='' is invalid: must be the path of a YAML file"
    assert seen_configs == []


def test_serve_refuses_an_empty_model_flag_before_loading_anything(capsys, seen_configs):
    pytest.importorskip("uvicorn")
    assert run_cli(["serve", "--model", ""]) == 2
    assert last_error_line(capsys).startswith("error: --model='' is invalid: must be the path of a checkpoint folder")
    assert seen_configs == []


@pytest.mark.parametrize(
    ("argv", "prompts"),
    [(["--", "--hi"], ["--hi"]),
     (["a", "--json", "--", "-b", "--quiet"], ["a", "-b", "--quiet"]),
     (["--", "a", "--", "--b"], ["a", "--", "--b"])],  # only the first -- separates
)
def test_everything_after_double_dash_is_a_prompt(argv, prompts):
    from diffulex.cli import build_parser

    args = build_parser().parse_args(["generate", "--model", "m", *argv])
    assert args.prompts == prompts and args.model == "m"


def test_generate_takes_a_prompt_that_starts_with_dashes_after_double_dash(sdar_dir, capsys):
    assert main(["generate", "--model", str(sdar_dir), *BASE, "--", "--hi"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["outputs"]
    assert row["prompt"] == "--hi" and row["error"] is None

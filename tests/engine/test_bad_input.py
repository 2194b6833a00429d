"""Bad input gets a clear error naming the field, the value and what is allowed; it never harms other requests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.testing.checkpoints import write_tiny_checkpoint


def engine(model_dir: Path, **fields):
    base = dict(block_size=4, page_size=8, buffer_size=2, max_model_len=64, max_num_batched_tokens=256)
    base.update(fields)
    return Diffulex(str(model_dir), **base)


def test_missing_model_folder_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="model=.*not an existing directory"):
        Diffulex(str(tmp_path / "nope"))


def test_folder_without_config_json_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="config.json"):
        Diffulex(str(tmp_path))


def test_unknown_model_name_is_rejected_listing_the_known_ones(sdar_dir: Path) -> None:
    with pytest.raises(ValueError, match="model_name='gpt9'.*sdar"):
        Diffulex(str(sdar_dir), model_name="gpt9")


def test_unknown_strategy_is_rejected_listing_the_known_ones(sdar_dir: Path) -> None:
    with pytest.raises(ValueError, match="decoding_strategy='greedy_ar'.*multi_bd"):
        Diffulex(str(sdar_dir), decoding_strategy="greedy_ar")


@pytest.mark.parametrize(
    ("field", "value"),
    [("kv_cache_layout", "distinct")],
)
def test_features_that_arrive_later_fail_clearly_where_used(sdar_dir: Path, tmp_path: Path, field, value) -> None:
    with pytest.raises(ValueError, match=f"not supported yet.*{field}"):
        engine(sdar_dir, **{field: value})


def test_a_checkpoint_folder_without_weights_fails_clearly(tmp_path: Path) -> None:
    config = {"model_type": "diffusion_gemma", "architectures": ["DiffusionGemmaForBlockDiffusion"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{tmp_path} has no safetensors weights"):
        Diffulex(str(tmp_path))


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [({"max_tokens": 0}, "max_tokens=0"), ({"temperature": -0.5}, "temperature=-0.5"), ({"top_p": 0}, "top_p=0")],
)
def test_invalid_sampling_params_name_the_field(kwargs, pattern) -> None:
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_bad_prompts_are_reported_and_the_rest_of_the_batch_finishes(sdar_dir: Path) -> None:
    with engine(sdar_dir) as llm:
        good = [11, 12, 13, 14, 15]
        prompts = [good, "", list(range(70)), [llm.vocab_limit + 1], good]
        out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
        assert [t.error is None for t in out] == [True, False, False, False, True]
        assert "prompt=''" in out[1].error
        assert "max_model_len=64" in out[2].error
        assert "prompt token id" in out[3].error
        assert out[0].token_ids == out[4].token_ids and len(out[0].token_ids) == 8
        assert llm.is_finished()


def test_add_request_raises_without_touching_engine_state(sdar_dir: Path) -> None:
    with engine(sdar_dir) as llm:
        with pytest.raises(ValueError, match="max_model_len"):
            llm.add_request(list(range(1, 80)), SamplingParams(max_tokens=4))
        assert llm.is_finished()
        assert llm.scheduler.kv_cache.num_used_pages == 0


def test_a_request_that_can_never_fit_the_page_pool_is_rejected(sdar_dir: Path) -> None:
    with engine(sdar_dir, num_pages=2) as llm:
        with pytest.raises(ValueError, match="KV pages"):
            llm.add_request([5, 6, 7], SamplingParams(max_tokens=40))


def test_aborting_a_running_request_frees_its_pages_and_others_continue(sdar_dir: Path) -> None:
    with engine(sdar_dir) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        victim = llm.add_request([3] * 20, params)
        other = llm.add_request([4] * 9, params)
        for _ in range(3):
            llm.step()
        assert llm.abort_request(victim) is True
        assert llm.abort_request(victim) is False
        finished = {}
        while not llm.is_finished():
            for update in llm.step():
                if update.finished:
                    finished[update.req_id] = update.trajectory
        assert set(finished) == {other}
        assert finished[other].completion_reason == "max_new_tokens_reached"
        assert llm.scheduler.kv_cache.num_used_pages == 0


@pytest.mark.parametrize("req_id", ["0", 1.0, True, None])
def test_aborting_by_something_other_than_a_request_id_names_the_argument(sdar_dir: Path, req_id) -> None:
    with engine(sdar_dir) as llm:
        llm.add_request([3] * 5, SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="req_id=.*must be an integer"):
            llm.abort_request(req_id)
        assert llm.abort_request(10**6) is False  # a well-formed id nobody holds: nothing to stop
        assert not llm.is_finished()


def test_an_engine_after_exit_reports_that_it_no_longer_serves(sdar_dir: Path) -> None:
    llm = engine(sdar_dir)
    assert llm.load().alive
    llm.exit()
    assert not llm.load().alive


def test_unknown_constructor_keywords_are_ignored_with_one_warning(sdar_dir: Path) -> None:
    with pytest.warns(UserWarning, match="not_a_field"):
        llm = engine(sdar_dir, not_a_field=3)
    llm.exit()


def test_stop_strings_end_the_answer_before_them(sdar_dir: Path) -> None:
    with engine(sdar_dir) as llm:
        free = llm.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)[0]
        stop = free.text[3:6]
        assert stop, "the free-running answer is long enough to pick a stop string from"
        cut = llm.generate([[11, 12, 13]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop=stop),
                           use_tqdm=False)[0]
    assert cut.completion_reason == "stop_string_matched"
    assert cut.text == free.text[: free.text.find(stop)]
    assert free.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_settings_this_version_does_not_act_on_are_named_when_set(sdar_dir: Path) -> None:
    with pytest.warns(UserWarning, match="enable_vllm_layers=False has no effect in this version of Diffulex"):
        engine(sdar_dir, enable_vllm_layers=False).exit()


def test_settings_left_at_their_defaults_raise_no_such_warning(sdar_dir: Path) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine(sdar_dir).exit()


@pytest.mark.parametrize(
    ("prompts", "pattern"),
    [
        (None, r"prompts=None is invalid: must be a string, a list of token ids, or a list of those"),
        (123, r"prompts=123 is invalid"),
        (b"To be", r"prompts=b'To be' is invalid.*decode bytes to str first"),
        ([b"To be"], r"prompts\[0\]=b'To be' is invalid.*not bytes \(decode bytes to str first\)"),
        ([1.5], r"prompts\[0\]=1.5 is invalid: must be a string or a list of token ids, not float"),
        (["ok", None], r"prompts\[1\]=None is invalid"),
        ([[1, 2, "3"]], r"prompts\[0\] is invalid: token ids must all be integers, got '3' \(str\)"),
        ([[1, True]], r"prompts\[0\] is invalid: token ids must all be integers, got True \(bool\)"),
        ([{"role": "user", "content": "hi"}, "and"], r"prompts\[0\]=.* not dict \(a conversation is one prompt hold"),
    ],
)
def test_malformed_generate_calls_name_the_prompt_before_anything_runs(sdar_dir: Path, prompts, pattern) -> None:
    with engine(sdar_dir) as llm:
        with pytest.raises(ValueError, match=pattern):
            llm.generate(prompts, SamplingParams(max_tokens=4), use_tqdm=False)
        assert llm.is_finished() and llm.scheduler.kv_cache.num_used_pages == 0


@pytest.mark.parametrize(
    ("prompt", "pattern"),
    [
        (None, r"prompt=None is invalid: must be a string or a list of token ids, not NoneType"),
        (b"To be", r"decode bytes to str first"),
        ("To \ud800be", r"prompt is invalid: it is not valid Unicode text \(surrogates not allowed at character 3\)"),
        ([], r"prompt=\[\] is invalid: must be a non-empty"),
    ],
)
def test_add_request_names_a_malformed_prompt(sdar_dir: Path, prompt, pattern) -> None:
    with engine(sdar_dir) as llm:
        with pytest.raises(ValueError, match=pattern):
            llm.add_request(prompt, SamplingParams(max_tokens=4))
        assert llm.is_finished()


@pytest.mark.parametrize("params", ["notparams", {"temperature": 0}, SamplingParams])
def test_sampling_params_of_the_wrong_type_are_named(sdar_dir: Path, params) -> None:
    with engine(sdar_dir) as llm:
        with pytest.raises(ValueError, match="sampling_params=.* is invalid: must be a SamplingParams, or a list"):
            llm.generate(["a", "b"], params, use_tqdm=False)


def test_a_checkpoint_limit_off_the_block_grid_lets_requests_run_to_the_end(tmp_path: Path) -> None:
    model = write_tiny_checkpoint(tmp_path / "m", "sdar", max_position_embeddings=46)
    with pytest.warns(UserWarning, match="using 44"):
        llm = engine(model, max_model_len=2048)
    out = llm.generate(["hello there"], SamplingParams(max_tokens=100, temperature=0.0))
    trajectory = out.trajectories[0]
    assert (trajectory.completion_reason, trajectory.error) == ("max_model_len_reached", None)
    assert len(trajectory.prompt_token_ids) + len(trajectory.token_ids) == 44

"""A stop string ends the answer before it, wherever in a request's steps its tokens were written, and only tokens
that no later step can change are matched."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.testing import write_tiny_checkpoint
from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint


def greedy(max_tokens: int, stop: str | None = None) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=stop)


def answers(llm, prompt, max_tokens: int, stop: str) -> tuple:
    """The free-running answer, and the answer with ``stop``."""
    free = llm.generate([prompt], greedy(max_tokens), use_tqdm=False)[0]
    cut = llm.generate([prompt], greedy(max_tokens, stop), use_tqdm=False)[0]
    return free, cut


def test_a_stop_string_in_the_step_that_ends_the_request_still_cuts_the_answer(sdar_dir: Path) -> None:
    """One token: the step that decodes it also ends the request at max_tokens."""
    with Diffulex(str(sdar_dir), block_size=4, max_model_len=64) as llm:
        only = llm.generate([[11, 12, 13]], greedy(1), use_tqdm=False)[0]
        assert only.text.strip(), "the one-token answer has text to stop at"
        stop = only.text.strip()[0]
        cut = llm.generate([[11, 12, 13]], greedy(1, stop), use_tqdm=False)[0]
    assert (cut.completion_reason, cut.text) == ("stop_string_matched", only.text[: only.text.find(stop)])


@pytest.fixture(scope="module")
def canvas_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_diffusion_gemma_checkpoint(tmp_path_factory.mktemp("dgemma") / "m", seed=0)


def test_a_stop_string_inside_a_canvas_cuts_the_answer(canvas_model: Path) -> None:
    """A canvas's tokens become the answer all at once, in the step that also ends a request of one canvas."""
    with Diffulex(str(canvas_model), max_model_len=128, num_pages=16, dtype="float32",
                  strategy_options={"diffusion_gemma_max_denoising_steps": 4}) as llm:  # fmt: skip
        prompt = [7, 8, 9, 10]
        free = llm.generate([prompt], greedy(12), use_tqdm=False)[0]
        stop = next((c for c in free.text[2:] if c.strip()), None)
        assert stop, "the free-running canvas has text to stop at"
        cut = llm.generate([prompt], greedy(12, stop), use_tqdm=False)[0]
    assert (cut.completion_reason, cut.text) == ("stop_string_matched", free.text[: free.text.find(stop)])


@pytest.fixture(scope="module")
def llada2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("llada2"), family="llada2", init_std=1.0, seed=9)


@pytest.mark.parametrize("strategy", ["multi_bd", "dmax"])
def test_in_edit_mode_only_final_tokens_meet_a_stop_string(llada2: Path, strategy: str) -> None:
    """An active block's decoded tokens may still be edited: a stop string matched in them could stop the answer
    at text it never holds. With a stop string the answer is the free-running one cut before it."""
    with Diffulex(str(llada2), decoding_strategy=strategy, sampling_mode="edit", block_size=4, buffer_size=1,
                  max_model_len=128) as llm:  # fmt: skip
        free = llm.generate(["hello world"], greedy(16), use_tqdm=False)[0]
        stops = sorted({c for c in free.text[1:] if c.isalpha()})
        assert stops, "the free-running answer has letters to stop at"
        for stop in stops:
            cut = llm.generate(["hello world"], greedy(16, stop), use_tqdm=False)[0]
            assert (cut.completion_reason, cut.text) == ("stop_string_matched", free.text[: free.text.find(stop)])

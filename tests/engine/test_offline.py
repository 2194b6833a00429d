"""``generate`` needs the engine to itself: it never consumes the results of requests queued by other means, and
calls from several threads run one after another, each getting its own answers."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from diffulex import Diffulex, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def engine(model: Path):
    return Diffulex(str(model), block_size=4, max_model_len=64)


def test_generate_refuses_while_requests_queued_with_add_request_run_and_their_results_stay(sdar_dir: Path) -> None:
    with engine(sdar_dir) as llm:
        req_id = llm.add_request([11, 12, 13], GREEDY)
        with pytest.raises(RuntimeError, match=r"would consume the results of the requests already queued"):
            llm.generate(["hello"], GREEDY, use_tqdm=False)
        finished = []
        while not llm.is_finished():
            finished += [u for u in llm.step() if u.finished]
    assert [u.req_id for u in finished] == [req_id]
    assert finished[0].trajectory.completion_reason == "max_new_tokens_reached"


def test_calls_from_two_threads_each_get_the_answers_of_their_own_prompts(sdar_dir: Path) -> None:
    batches = [["one two", "three"], ["four five six", "seven", "eight"]]
    with engine(sdar_dir) as llm:
        expected = [[t.token_ids for t in llm.generate(b, GREEDY, use_tqdm=False)] for b in batches]
        got: list[list | BaseException | None] = [None, None]

        def call(i: int) -> None:
            try:
                got[i] = [t.token_ids for t in llm.generate(batches[i], GREEDY, use_tqdm=False)]
            except BaseException as err:  # noqa: BLE001  (reported by the assertion below)
                got[i] = err

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert got == expected

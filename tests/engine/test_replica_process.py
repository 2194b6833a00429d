"""A replica's per-step messages: the parent rebuilds from them the updates the engine gave, sending only growth."""

from __future__ import annotations

import pickle

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.engine.replica_process import UpdateDecoder, UpdateEncoder
from diffulex.engine.request_update import RequestUpdate
from diffulex.strategy.request import StepRecord
from diffulex.testing import write_tiny_checkpoint


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("replica"), init_std=1.0, seed=3)


def view(update: RequestUpdate) -> tuple:
    traj = update.trajectory
    return (update.req_id, update.finished, update.record, update.committed_token_ids, update.answer_token_ids,
            None if traj is None else (traj.token_ids, traj.text, traj.completion_reason, traj.nfe))


def test_the_parent_rebuilds_every_update_of_a_real_engine_from_the_messages(ckpt):
    encoder, decoder = UpdateEncoder(), UpdateDecoder()
    seen, rebuilt, sent_tokens = [], [], 0
    with Diffulex(str(ckpt), block_size=4, max_model_len=128) as llm:
        for prompt, n in [("one two", 20), ("three", 9), ("four five six", 14)]:
            llm.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        while not llm.is_finished():
            for update in llm.step():
                rid = 100 + update.req_id  # the parent's own id
                message = pickle.loads(pickle.dumps(encoder.encode(update, rid)))
                if isinstance(message[2], tuple):
                    sent_tokens += len(message[2][1])
                seen.append((rid, view(update)[1:]))
                rebuilt.append(decoder.decode(message))
    assert [(u.req_id, view(u)[1:]) for u in rebuilt] == seen
    # each running answer's tokens cross the pipe once: no more than the answers' total length
    assert sent_tokens <= sum(len(u.answer_token_ids) for u in rebuilt if u.finished)


def test_an_answer_that_got_shorter_is_sent_whole_and_earlier_updates_keep_theirs():
    encoder, decoder = UpdateEncoder(), UpdateDecoder()
    record = StepRecord(1, 4, 1, (0,), (5, 6, 7, 0))
    first = decoder.decode(encoder.encode(RequestUpdate(3, record, False, [5], [5, 6, 7]), 9))
    second = decoder.decode(encoder.encode(RequestUpdate(3, record, False, [5], [5, 8]), 9))
    assert (first.committed_token_ids, first.answer_token_ids) == ([5], [5, 6, 7])
    assert (second.committed_token_ids, second.answer_token_ids) == ([5], [5, 8])
    assert second.record == record and second.req_id == 9

"""A replica's per-step messages: the parent rebuilds from them the updates the engine gave, sending only growth."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.engine.replica_process import MessageSender, UpdateDecoder, UpdateEncoder
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


def test_a_request_added_without_trajectory_steps_finishes_without_them_and_the_others_keep_theirs(ckpt):
    encoder, decoder = UpdateEncoder(), UpdateDecoder()
    finished = {}
    with Diffulex(str(ckpt), block_size=4, max_model_len=128) as llm:
        for rid, trajectory_steps in [(7, False), (8, True)]:
            local = llm.add_request("one two", SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
            assert local == rid - 7
            encoder.add(rid, trajectory_steps)
        while not llm.is_finished():
            for update in llm.step():
                rid = 7 + update.req_id
                message = pickle.loads(pickle.dumps(encoder.encode(update, rid)))
                rebuilt = decoder.decode(message)
                if rebuilt.finished:
                    finished[rid] = (rebuilt.trajectory, update.trajectory)
    (light, full_of_7), (kept, full_of_8) = finished[7], finished[8]
    assert light.steps == [] and len(full_of_7.steps) == full_of_7.nfe > 0
    assert (light.token_ids, light.text, light.nfe) == (full_of_7.token_ids, full_of_7.text, full_of_7.nfe)
    assert kept.steps == full_of_8.steps and len(kept.steps) == kept.nfe


def test_the_sender_queues_what_a_parent_reads_late_and_delivers_it_in_order():
    """The engine's sends return while the parent reads nothing (more than a pipe holds); it gets all, in order."""
    parent, child = multiprocessing.Pipe()
    sender = MessageSender(child)
    payload = "x" * 4096
    sends = threading.Thread(target=lambda: [sender.send((i, payload)) for i in range(200)])
    sends.start()
    sends.join(timeout=30)
    assert not sends.is_alive()  # ~800 KB queued while nobody read: the pipe alone holds about 64 KB
    assert [parent.recv()[0] for _ in range(200)] == list(range(200))
    sender.close()


def test_the_sender_reports_a_parent_that_is_gone():
    parent, child = multiprocessing.Pipe()
    sender = MessageSender(child)
    parent.close()
    with pytest.raises(BrokenPipeError):
        for _ in range(1000):  # the first failed write marks the sender broken; later sends raise
            sender.send(("updates", [], None, False))
            time.sleep(0.001)
    sender.close()

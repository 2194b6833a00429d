"""A replica's per-step messages: the parent rebuilds from them the updates the engine gave, sending only growth."""

from __future__ import annotations

import multiprocessing
import pickle
import threading
import time

import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.engine.replica_process import MessageSender, StepTotals, UpdateDecoder, UpdateEncoder
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


def test_a_replica_sends_a_commits_reader_only_its_commits_and_an_end_reader_only_its_end_each_with_its_nfe(ckpt):
    encoder, decoder = UpdateEncoder(), UpdateDecoder()
    sent: dict[int, list[RequestUpdate]] = {10: [], 11: [], 12: []}
    engine_committed: dict[int, list[int]] = {10: [], 11: [], 12: []}
    totals = []
    with Diffulex(str(ckpt), block_size=4, max_model_len=128) as llm:
        for rid, interest in [(10, "steps"), (11, "commits"), (12, "end")]:
            llm.add_request("one two", SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True))
            encoder.add(rid, interest=interest)
        while not llm.is_finished():
            updates = llm.step()
            totals.append((StepTotals.of(updates), updates))
            for update in updates:
                rid = 10 + update.req_id
                engine_committed[rid].append(update.num_committed)
                if (message := encoder.encode(update, rid)) is not None:
                    sent[rid].append(decoder.decode(pickle.loads(pickle.dumps(message))))
    steps = len(engine_committed[10])
    assert len(sent[10]) == steps and all(u.record is not None for u in sent[10])
    # commits: one update per growth of the committed tokens (and the end), no step records before the end
    growths = sum(1 for a, b in zip([0, *engine_committed[11]], engine_committed[11], strict=False) if b > a)
    assert len(sent[11]) <= growths + 1 and all(u.record is None for u in sent[11][:-1])
    assert [u.num_committed for u in sent[11][:-1]] == sorted(set(engine_committed[11][:-1]) - {0})
    assert len(sent[12]) == 1 and sent[12][0].finished
    for rid in sent:  # every update knows the forwards so far, and the last one says as many as the trajectory
        assert [u.nfe for u in sent[rid]] == sorted(u.nfe for u in sent[rid])
        assert sent[rid][-1].nfe == sent[rid][-1].trajectory.nfe == steps
    for step_totals, updates in totals:
        assert step_totals.batch_size == len(updates)
        assert step_totals.num_tokens == sum(u.record.num_new_tokens for u in updates)

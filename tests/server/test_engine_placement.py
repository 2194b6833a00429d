"""The engine in a process of its own behind the server (``--engine-placement``): same answers, same streaming,
aborts and health as on a thread of the server process."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from diffulex import SamplingParams
from diffulex.engine.data_parallel import DataParallelEngine
from diffulex.server.engine_placement import build_served_engine, engine_process_allowed

from .conftest import ENGINE_FIELDS, start_server


def stream_completion(base_url: str, prompt: str, max_tokens: int) -> tuple[list[str], dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, usage = [], {}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            texts += [c["text"] for c in chunk["choices"] if c["text"]]
    return texts, usage


def test_a_server_on_an_engine_process_streams_each_answer_a_lone_engine_gives(sdar_dir: Path, reference_engine):
    server = start_server(sdar_dir, engine_placement="auto")
    try:
        engine = server.loop.engine
        assert isinstance(engine, DataParallelEngine) and engine.replica_pids[0] != os.getpid()
        for prompt, n in [("one two", 24), ("three four five", 13)]:
            texts, usage = stream_completion(server.base_url, prompt, n)
            alone = reference_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n),
                                              use_tqdm=False, apply_chat_template=False).trajectories[0]
            assert "".join(texts) == alone.text
            assert usage["completion_tokens"] == alone.num_generated_tokens and usage["nfe"] == alone.nfe

        # a client that leaves mid-stream: its request is aborted in the engine process, nothing stays behind
        body = {"prompt": "six", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as response:
            next(line for line in response.iter_lines() if line.startswith("data: ") and '"text":""' not in line)
        state = server.wait_idle(timeout=20)
        assert (state["in_flight"], state["running"], state["kv_pages_used"]) == (0, 0, 0)
        assert state["status"] == "ok" and [r["alive"] for r in state["replicas"]] == [True]
    finally:
        server.stop()
    assert not server.loop.running


def test_engines_of_several_ranks_or_replicas_are_not_put_in_one_process():
    one = SimpleNamespace(data_parallel_size=1, tensor_parallel_size=1, expert_parallel_size=1,
                          distributed_executor_backend="mp")
    assert engine_process_allowed(one) is None
    assert "rank workers" in engine_process_allowed(SimpleNamespace(**{**vars(one), "tensor_parallel_size": 2}))
    assert "rank workers" in engine_process_allowed(SimpleNamespace(**{**vars(one), "expert_parallel_size": 2}))
    assert "replicas as processes" in engine_process_allowed(SimpleNamespace(**{**vars(one), "data_parallel_size": 2}))


def test_an_unknown_placement_is_refused_naming_the_choices(sdar_dir: Path):
    with pytest.raises(ValueError, match="engine_placement='gpu' is invalid: must be one of auto, process, thread"):
        build_served_engine(str(sdar_dir), {}, "gpu")  # type: ignore[arg-type]


def test_a_server_whose_engine_process_dies_fails_at_once_so_that_it_can_be_restarted(sdar_dir: Path):
    server = start_server(sdar_dir, engine_placement="auto")
    try:
        os.kill(server.loop.engine.replica_pids[0], signal.SIGKILL)
        deadline = time.monotonic() + 20
        while server.loop.failure is None:
            assert time.monotonic() < deadline, "the server should notice its engine process died while idle"
            time.sleep(0.05)
        assert "every engine replica process has died" in server.loop.failure
    finally:
        server.stop()


def test_the_served_engine_process_returns_answers_without_the_step_records_the_server_never_reads(
    sdar_dir: Path, reference_engine
):
    """One record per forward would cross the pipe with each finished request (megabytes when a batch of 128
    finishes together); the server reads the answer, its reason and its NFE only."""
    engine = build_served_engine(str(sdar_dir), dict(ENGINE_FIELDS), "process")
    try:
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        served = engine.generate(["one two", "three"], params, use_tqdm=False, apply_chat_template=False)
    finally:
        engine.exit()
    alone = reference_engine.generate(["one two", "three"], params, use_tqdm=False, apply_chat_template=False)
    assert [t.steps for t in served] == [[], []] and all(len(t.steps) == t.nfe > 0 for t in alone)
    assert [(t.token_ids, t.text, t.nfe, t.completion_reason) for t in served] == [
        (t.token_ids, t.text, t.nfe, t.completion_reason) for t in alone
    ]


def test_128_concurrent_streams_from_an_engine_process_each_get_every_token_once_in_order(
    sdar_dir: Path, reference_engine
):
    """The replica sends a stream's update only when its committed text grew, the step records of none of them:
    every stream still gets its whole answer, each piece once and in order, with its NFE; the streams closed
    mid-answer are aborted and leave nothing behind; the metrics still count every step's tokens."""
    streams, dropped = 128, 8
    prompts = [f"word {i} " * (1 + i % 5) for i in range(streams)]
    lengths = [12 + (7 * i) % 29 for i in range(streams)]
    server = start_server(sdar_dir, engine_placement="process", max_num_reqs=streams, max_waiting=streams,
                          max_num_batched_tokens=4096)

    async def one(http: httpx.AsyncClient, i: int) -> tuple[list[str], dict]:
        body = {"prompt": prompts[i], "max_tokens": lengths[i], "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        texts, usage = [], {}
        async with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                texts += [c["text"] for c in chunk["choices"] if c["text"]]
                if i < dropped and texts:
                    break  # this client leaves after its first piece: the server aborts its request
        return texts, usage

    async def run_all() -> list[tuple[list[str], dict]]:
        limits = httpx.Limits(max_connections=streams)
        async with httpx.AsyncClient(base_url=server.base_url, limits=limits, timeout=120) as http:
            return await asyncio.gather(*(one(http, i) for i in range(streams)))

    try:
        results = asyncio.run(run_all())
        state = server.wait_idle(timeout=30)
        metrics = httpx.get(server.base_url + "/metrics").text
    finally:
        server.stop()
    alone = reference_engine.generate(
        prompts, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths], use_tqdm=False,
        apply_chat_template=False,
    )  # fmt: skip
    for i, ((texts, usage), expected) in enumerate(zip(results, alone, strict=True)):
        if i < dropped:
            assert texts and expected.text.startswith(texts[0])
            continue
        assert "".join(texts) == expected.text, i
        assert (usage["completion_tokens"], usage["nfe"]) == (expected.num_generated_tokens, expected.nfe), i
    assert (state["in_flight"], state["running"], state["waiting"], state["kv_pages_used"]) == (0, 0, 0, 0)
    counters = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                if line.startswith(("diffulex_engine_steps_total", "diffulex_decoded_tokens_total"))}
    finished_tokens = sum(t.num_generated_tokens for t in alone[dropped:])
    assert counters["diffulex_decoded_tokens_total"] >= finished_tokens
    assert counters["diffulex_engine_steps_total"] >= max(t.nfe for t in alone)


def test_an_engine_process_serves_the_denoising_view_appends_and_whole_answers_as_a_lone_engine_gives_them(
    sdar_dir: Path, reference_engine
):
    """Each reader gets what it reads from a replica that sends only that: the denoising view every step, the
    appended text at commits, a whole answer at its end; each with the NFE the answer took."""
    prompt, n = "one two three", 21
    alone = reference_engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
                                      use_tqdm=False, apply_chat_template=False).trajectories[0]
    server = start_server(sdar_dir, engine_placement="process")
    try:
        def events(mode: str) -> list[dict]:
            body = {"prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_mode": mode}
            with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as response:
                assert response.status_code == 200
                return [json.loads(line[6:]) for line in response.iter_lines()
                        if line.startswith("data: ") and line != "data: [DONE]"]

        denoise = events("denoise")
        snapshots, final = denoise[:-1], denoise[-1]
        assert [e["event"] for e in snapshots] == ["denoise"] * len(snapshots) and final["event"] == "final"
        assert [e["nfe"] for e in snapshots] == list(range(1, len(snapshots) + 1))  # one per step
        assert all(e["blocks"] and e["blocks"][0]["cells"] for e in snapshots)
        assert (final["text"], final["nfe"]) == (alone.text, alone.nfe)

        appended = events("block_append")
        assert appended[-1]["event"] == "final" and appended[-1]["nfe"] == alone.nfe
        assert "".join(e["text"] for e in appended[:-1]) == alone.text
        assert all(0 < a["nfe"] < b["nfe"] for a, b in zip(appended[:-2], appended[1:-1], strict=True))

        whole = httpx.post(server.base_url + "/v1/completions", json={
            "prompt": prompt, "max_tokens": n, "temperature": 0.0, "ignore_eos": True}, timeout=60).json()
        assert whole["choices"][0]["text"] == alone.text and whole["usage"]["nfe"] == alone.nfe
    finally:
        server.stop()


def test_a_started_server_leaves_what_it_built_out_of_the_collectors_reach(sdar_dir: Path):
    """A full collection stops every stream and the engine loop; once serving, it scans only what requests made."""
    server = start_server(sdar_dir, engine_placement="process")
    try:
        stream_completion(server.base_url, "one two", 8)
        gc.collect()
        assert gc.get_freeze_count() > 10 * len(gc.get_objects())
    finally:
        server.stop()

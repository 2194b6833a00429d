"""Continuous batching under concurrent streams, the native /generate stream modes, and /metrics."""

from __future__ import annotations

import asyncio
import json
import random

import httpx

from diffulex import SamplingParams

from .conftest import MODEL_NAME, RunningServer

NUM_CLIENTS = 16


def sse_payloads(lines) -> list:
    """The JSON payloads of an SSE stream, checking that it ends with ``data: [DONE]``."""
    data = [line[6:] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


async def _stream_one(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, list[dict]]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        payloads = sse_payloads([line async for line in response.aiter_lines()])
    text = "".join(p["choices"][0]["text"] for p in payloads)
    return text, payloads


def test_concurrent_streams_each_equal_generate_alone(server: RunningServer, reference_engine) -> None:
    rng = random.Random(0)
    words = "the old lighthouse keeper wrote ships names in a thick book every evening".split()
    prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) for _ in range(NUM_CLIENTS)]
    lengths = [rng.randint(8, 40) for _ in range(NUM_CLIENTS)]

    async def run_all():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as http:
            return await asyncio.gather(*(_stream_one(http, p, n) for p, n in zip(prompts, lengths, strict=True)))

    before = _metric(server, "diffulex_step_batch_size_sum"), _metric(server, "diffulex_engine_steps_total")
    results = asyncio.run(run_all())
    after = _metric(server, "diffulex_step_batch_size_sum"), _metric(server, "diffulex_engine_steps_total")
    for prompt, n, (text, _) in zip(prompts, lengths, results, strict=True):
        expected = reference_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False,
                                             apply_chat_template=False)
        assert text == expected.trajectories[0].text, prompt
    mean_batch = (after[0] - before[0]) / (after[1] - before[1])
    assert mean_batch > 2, f"requests should share steps (mean batch {mean_batch:.2f})"
    assert server.wait_idle()["kv_pages_used"] == 0


def _metric(server: RunningServer, name: str) -> float:
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} missing from /metrics")


def test_generate_denoise_stream_shows_the_block_buffer(server: RunningServer, reference_engine) -> None:
    body = {"prompt": "A good question", "max_tokens": 20, "temperature": 0, "stream": True, "stream_mode": "denoise"}
    with server.client() as http, http.stream("POST", "/generate", json=body) as response:
        events = sse_payloads(response.iter_lines())
    snapshots, final = events[:-1], events[-1]
    expected = reference_engine.generate(["A good question"], SamplingParams(temperature=0, max_tokens=20),
                                         use_tqdm=False, apply_chat_template=False).trajectories[0]
    assert final["event"] == "final" and final["text"] == expected.text and final["token_ids"] == expected.token_ids
    assert final["nfe"] == expected.nfe == len(snapshots) + 1
    assert all(s["event"] == "denoise" for s in snapshots)
    block_size = server.loop.block_size
    states = set()
    for snap in snapshots:
        for block in snap["blocks"]:
            assert 1 <= len(block["cells"]) <= block_size
            for cell in block["cells"]:
                states.add(cell["state"])
                assert (cell["state"] == "mask") == (cell["id"] is None)
        assert sum(c["state"] == "new" for b in snap["blocks"] for c in b["cells"]) == snap["num_new_tokens"]
    assert {"mask", "new", "committed"} <= states
    # The stable text before the buffer is final: it is a prefix of the answer.
    assert expected.text.startswith("".join(s["stable_delta"] for s in snapshots))


def test_generate_block_append_stream_and_non_stream(server: RunningServer) -> None:
    body = {"prompt": "In spring the village", "max_tokens": 24, "temperature": 0}
    with server.client() as http:
        plain = http.post("/generate", json=body).json()
        with http.stream("POST", "/generate", json={**body, "stream": True, "stream_mode": "block_append"}) as r:
            events = sse_payloads(r.iter_lines())
        chat = http.post("/generate", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                                            "temperature": 0}).json()
    assert plain["finish_reason"] in ("stop", "length") and plain["usage"]["completion_tokens"] >= len(
        plain["token_ids"])
    appends = [e for e in events if e["event"] == "append"]
    assert events[-1]["event"] == "final" and events[-1]["text"] == plain["text"]
    assert "".join(e["text"] for e in appends) == plain["text"]
    assert len(appends) >= 2
    assert chat["usage"]["prompt_tokens"] > 3  # the chat template wrapped the message


def test_metrics_exposition(server: RunningServer) -> None:
    with server.client() as http:
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}).status_code == 200
        text = http.get("/metrics").text
    for name in ("diffulex_num_requests_running", "diffulex_num_requests_waiting", "diffulex_tokens_per_second",
                 "diffulex_tpf", "diffulex_kv_pages_used", "diffulex_kv_pages_total",
                 "diffulex_step_duration_seconds_bucket", "diffulex_step_duration_seconds_count",
                 "diffulex_time_to_first_token_seconds_count", "diffulex_generation_tokens_total"):
        assert f"\n{name}" in "\n" + text, name
    assert _metric(server, "diffulex_tpf") > 0
    assert _metric(server, "diffulex_engine_steps_total") > 0
    for line in text.splitlines():  # every sample line is "name{labels} value"
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])


def test_health_and_models(server: RunningServer) -> None:
    with server.client() as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL_NAME and models["data"][0]["max_model_len"] == 512

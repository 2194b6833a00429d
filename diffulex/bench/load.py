"""Load on the HTTP server: streaming requests on loopback, closed-loop (N clients back to back) or open-loop
(Poisson arrivals), each request's time to first token, the gaps between its streamed chunks, its latency and
completion tokens.

One implementation serves ``bench/load_test.py`` (closed loop against any loopback server) and the ``serving``
target of ``diffulex bench sweep`` (open loop against a server on an engine it has also measured offline).
"""

from __future__ import annotations

import asyncio
import json
import math
import platform
import random
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
WORDS = ("the old lighthouse keeper climbed the narrow stairs and watched ships pass far out at sea while "
         "children counted boats and bridges on their way to school").split()
SERVER_START_TIMEOUT_S = 60.0


@dataclass
class Sample:
    """One streamed request as its client saw it."""

    ok: bool
    ttft_s: float | None = None  # first non-empty text
    latency_s: float = 0.0
    completion_tokens: int = 0
    nfe: int = 0
    error: str | None = None
    chunk_gaps_s: list[float] = field(default_factory=list)  # between consecutive non-empty text chunks
    sent_at: float = 0.0  # perf_counter when the request was sent
    done_at: float = 0.0


@dataclass(frozen=True)
class RequestSpec:
    """What one request asks for."""

    prompt: str
    max_tokens: int
    temperature: float = 0.0
    ignore_eos: bool = False

    def sampling_params(self) -> Any:
        """The same request for an engine in this process (`diffulex.SamplingParams`)."""
        from diffulex.sampling_params import SamplingParams

        return SamplingParams(temperature=self.temperature, max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None without data."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))  # the smallest value with q% at or below
    return ordered[rank - 1]


def make_prompt(i: int, length: int) -> str:
    """A prompt of `length` words, different for each `i`."""
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(length))


async def one_request(http: httpx.AsyncClient, route: str, model: str | None, spec: RequestSpec) -> Sample:
    """Send one streaming request and read it to ``[DONE]``; a failure is a sample with ``error`` set."""
    body: dict[str, Any] = {"max_tokens": spec.max_tokens, "temperature": spec.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if model:
        body["model"] = model
    if route == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = spec.prompt
        path = "/v1/completions"
    t0 = time.perf_counter()
    sample = Sample(False, sent_at=t0)
    last_chunk: float | None = None
    usage: dict[str, Any] = {}
    done = False

    def failed(error: str) -> Sample:
        sample.error, sample.done_at = error[:200], time.perf_counter()
        sample.latency_s = sample.done_at - t0
        return sample

    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return failed(f"HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return failed(str(chunk["error"]))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(choice.get("text") or (choice.get("delta") or {}).get("content")
                       for choice in chunk.get("choices", [])):
                    now = time.perf_counter()
                    if last_chunk is None:
                        sample.ttft_s = now - t0
                    else:
                        sample.chunk_gaps_s.append(now - last_chunk)
                    last_chunk = now
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return failed(f"{type(err).__name__}: {err}")
    if not done:
        return failed("stream ended without [DONE]")
    sample.done_at = time.perf_counter()
    sample.latency_s = sample.done_at - t0
    sample.ok = True
    sample.completion_tokens = int(usage.get("completion_tokens", 0))
    sample.nfe = int(usage.get("nfe", 0))
    return sample


async def served_model(http: httpx.AsyncClient) -> str:
    """The name the server serves under (its first listed model)."""
    return (await http.get("/v1/models")).json()["data"][0]["id"]


def _client(url: str, connections: int, request_timeout: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    return httpx.AsyncClient(base_url=url, limits=limits, timeout=httpx.Timeout(request_timeout))


async def closed_loop(
    url: str, route: str, model: str | None, clients: int, duration_s: float, max_requests: int,
    spec_for: Any, request_timeout: float,
) -> tuple[list[Sample], float]:
    """`clients` clients each sending requests back to back (``spec_for(i)`` is the i-th request) until
    `duration_s` has passed or `max_requests` have started; returns the samples and the elapsed seconds."""
    samples: list[Sample] = []
    started = 0
    async with _client(url, clients, request_timeout) as http:
        model = model or await served_model(http)

        async def client(cid: int) -> None:
            nonlocal started
            while time.perf_counter() < deadline and started < max_requests:
                started += 1
                samples.append(await one_request(http, route, model, spec_for(started + cid)))

        t0 = time.perf_counter()
        deadline = t0 + duration_s
        await asyncio.gather(*(client(i) for i in range(clients)))
        return samples, time.perf_counter() - t0


async def open_loop(
    url: str, route: str, specs: Sequence[RequestSpec], rate_per_s: float, seed: int, request_timeout: float,
) -> tuple[list[Sample], float]:
    """Send `specs` at Poisson arrival times of `rate_per_s` (exponential gaps, seeded), whatever the server's
    progress (open loop: a slow server meets a growing queue, not fewer requests); returns the samples in request
    order and the seconds from the first send to the last completion."""
    gaps = random.Random(seed)
    async with _client(url, len(specs), request_timeout) as http:
        model = await served_model(http)
        tasks = []
        t0 = time.perf_counter()
        at = 0.0
        for spec in specs:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one_request(http, route, model, spec)))
            at += gaps.expovariate(rate_per_s)
        samples = list(await asyncio.gather(*tasks))
    end = max((s.done_at for s in samples), default=t0)
    return samples, end - t0


def _open_loop_here(url: str, route: str, specs: list[RequestSpec], rate_per_s: float, seed: int,
                    request_timeout: float) -> tuple[list[Sample], float]:
    return asyncio.run(open_loop(url, route, specs, rate_per_s, seed, request_timeout))


def open_loop_in_process(
    url: str, route: str, specs: Sequence[RequestSpec], rate_per_s: float, seed: int, request_timeout: float,
) -> tuple[list[Sample], float]:
    """`open_loop` from a spawned process of its own: a server measured in this process then shares its GIL with
    nothing a real client would run (reading 64-128 streams costs about as much Python as serving them)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    with ProcessPoolExecutor(max_workers=1, mp_context=get_context("spawn")) as pool:
        return pool.submit(_open_loop_here, url, route, list(specs), rate_per_s, seed, request_timeout).result()


def summarize(samples: Sequence[Sample], elapsed_s: float) -> dict[str, Any]:
    """Requests, tokens/s, TPF, TTFT, latency and chunk-gap percentiles (ms) of a load run."""
    ok = [s for s in samples if s.ok]
    tokens = sum(s.completion_tokens for s in ok)
    nfe = sum(s.nfe for s in ok)
    ttfts = [s.ttft_s * 1e3 for s in ok if s.ttft_s is not None]
    latencies = [s.latency_s * 1e3 for s in ok]
    gaps = [g * 1e3 for s in ok for g in s.chunk_gaps_s]
    errors = [s.error or "error" for s in samples if not s.ok]
    return {
        "requests": len(samples), "errors": len(errors), "elapsed_s": elapsed_s,
        "requests_per_s": len(ok) / elapsed_s if elapsed_s > 0 else 0.0,
        "completion_tokens": tokens, "tokens_per_s": tokens / elapsed_s if elapsed_s > 0 else 0.0,
        "tpf": tokens / nfe if nfe else 0.0,
        "ttft_p50_ms": percentile(ttfts, 50), "ttft_p99_ms": percentile(ttfts, 99),
        "chunk_gap_p50_ms": percentile(gaps, 50), "chunk_gap_p99_ms": percentile(gaps, 99),
        "latency_p50_ms": percentile(latencies, 50), "latency_p99_ms": percentile(latencies, 99),
        "error_examples": sorted(set(errors))[:5],
    }


def machine() -> dict[str, Any]:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "processor": platform.processor() or platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}


class InProcessServer:
    """The HTTP server on 127.0.0.1 (a free port) in a background thread, over an engine built here from `model`
    and `fields`, or over `engine` (already built, e.g. measured offline first; it is not closed on exit)."""

    def __init__(self, model: str | None = None, fields: dict[str, Any] | None = None, max_waiting: int = 256,
                 engine: Any = None) -> None:
        import uvicorn

        from diffulex.server.app import create_app
        from diffulex.server.engine_loop import EngineLoop

        if engine is None:
            if model is None:
                raise ValueError("InProcessServer needs a model folder or an engine")
            from diffulex import Diffulex

            engine = Diffulex(model, **(fields or {}))
        self.loop = EngineLoop(engine, max_waiting=max_waiting)
        app = create_app(self.loop, "load-test", shutdown_grace_s=5.0)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

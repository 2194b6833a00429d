"""Load test of the HTTP server: N concurrent streaming clients for T seconds on loopback.

Each client sends streaming requests back to back until the time is up or the request budget is spent, and
records time to first token (first non-empty text), end-to-end latency, completion tokens (from the final usage
chunk) and errors. Reports requests/s, tokens/s, TTFT and latency p50/p99, TPF and the error count (the exit
code is 1 if any request failed).

    # start a server in this process on a tiny random checkpoint and load it:
    python bench/load_test.py --clients 16 --duration 20
    # or load a running server (loopback only):
    python bench/load_test.py --url http://127.0.0.1:8000 --clients 16 --duration 20 --json runs/load.json

Everything is bounded: at most MAX_CLIENTS clients, MAX_DURATION_S seconds and --max-requests requests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

MAX_CLIENTS = 256
MAX_DURATION_S = 600.0
LOOPBACK_HOSTS = {"127.0.0.1", "localhost", "::1"}
WORDS = ("the old lighthouse keeper climbed the narrow stairs and watched ships pass far out at sea while "
         "children counted boats and bridges on their way to school").split()


@dataclass
class Sample:
    ok: bool
    ttft_s: float | None = None
    latency_s: float = 0.0
    completion_tokens: int = 0
    nfe: int = 0
    error: str | None = None


@dataclass
class Report:
    url: str
    route: str
    clients: int
    duration_s: float
    max_tokens: int
    requests: int
    errors: int
    requests_per_s: float
    tokens_per_s: float
    tpf: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    latency_p50_ms: float | None
    latency_p99_ms: float | None
    error_examples: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None without data."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def make_prompt(i: int, length: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(length))


async def one_request(http: httpx.AsyncClient, route: str, model: str | None, prompt: str, args: argparse.Namespace,
                      ) -> Sample:
    body: dict[str, Any] = {"max_tokens": args.max_tokens, "temperature": args.temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    if route == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    t0 = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    done = False
    try:
        async with http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return Sample(False, latency_s=time.perf_counter() - t0, error=f"HTTP {response.status_code}: {text}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return Sample(False, latency_s=time.perf_counter() - t0, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    text = choice.get("text") or (choice.get("delta") or {}).get("content")
                    if text and ttft is None:
                        ttft = time.perf_counter() - t0
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return Sample(False, latency_s=time.perf_counter() - t0, error=f"{type(err).__name__}: {err}"[:200])
    latency = time.perf_counter() - t0
    if not done:
        return Sample(False, latency_s=latency, error="stream ended without [DONE]")
    return Sample(True, ttft, latency, int(usage.get("completion_tokens", 0)), int(usage.get("nfe", 0)))


async def run_load(url: str, args: argparse.Namespace) -> Report:
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.request_timeout)
    samples: list[Sample] = []
    started = 0
    deadline = 0.0

    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as http:
        model = args.model
        if model is None:
            models = (await http.get("/v1/models")).json()
            model = models["data"][0]["id"]

        async def client(cid: int) -> None:
            nonlocal started
            while time.perf_counter() < deadline and started < args.max_requests:
                started += 1
                prompt = make_prompt(started + cid, args.prompt_words)
                samples.append(await one_request(http, args.route, model, prompt, args))

        t0 = time.perf_counter()
        deadline = t0 + args.duration
        await asyncio.gather(*(client(i) for i in range(args.clients)))
        elapsed = time.perf_counter() - t0

    ok = [s for s in samples if s.ok]
    tokens = sum(s.completion_tokens for s in ok)
    nfe = sum(s.nfe for s in ok)
    ttfts = [s.ttft_s * 1000 for s in ok if s.ttft_s is not None]
    latencies = [s.latency_s * 1000 for s in ok]
    errors = [s.error or "error" for s in samples if not s.ok]
    return Report(
        url=url, route=args.route, clients=args.clients, duration_s=round(elapsed, 3), max_tokens=args.max_tokens,
        requests=len(samples), errors=len(errors), requests_per_s=len(ok) / elapsed, tokens_per_s=tokens / elapsed,
        tpf=tokens / nfe if nfe else 0.0,
        ttft_p50_ms=percentile(ttfts, 50), ttft_p99_ms=percentile(ttfts, 99),
        latency_p50_ms=percentile(latencies, 50), latency_p99_ms=percentile(latencies, 99),
        error_examples=sorted(set(errors))[:5],
        machine={"platform": platform.platform(), "python": platform.python_version(),
                 "processor": platform.processor() or platform.machine(),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")},
    )


class InProcessServer:
    """A server on 127.0.0.1 (free port) in a background thread, for loading without a separate process."""

    def __init__(self, model: str, fields: dict[str, Any], max_waiting: int) -> None:
        import uvicorn

        from diffulex import Diffulex
        from diffulex.server.app import create_app
        from diffulex.server.engine_loop import EngineLoop

        engine = Diffulex(model, **fields)
        self.loop = EngineLoop(engine, max_waiting=max_waiting)
        app = create_app(self.loop, "load-test", shutdown_grace_s=5.0)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def build_parser() -> argparse.ArgumentParser:
    from diffulex.cli import add_engine_flags

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (loopback only); default: start one here")
    parser.add_argument("--model", default=None,
                        help="with --url: the model name to send; otherwise the checkpoint to serve "
                             "(default: a tiny random SDAR checkpoint written to a temporary folder)")
    parser.add_argument("--clients", type=int, default=8, help=f"concurrent streaming clients (1..{MAX_CLIENTS})")
    parser.add_argument("--duration", type=float, default=10.0, help=f"seconds of load (<= {MAX_DURATION_S:g})")
    parser.add_argument("--max-requests", type=int, default=10_000, help="stop after this many requests")
    parser.add_argument("--max-tokens", type=int, default=64, help="max_tokens of every request")
    parser.add_argument("--prompt-words", type=int, default=16, help="words per prompt")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--route", choices=("completions", "chat"), default="completions")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds before a request fails")
    parser.add_argument("--max-waiting", type=int, default=256, help="in-process server: waiting-queue bound")
    parser.add_argument("--json", default=None, help="also write the report to this file")
    add_engine_flags(parser)
    return parser


def check_bounds(args: argparse.Namespace) -> None:
    if not 1 <= args.clients <= MAX_CLIENTS:
        raise SystemExit(f"--clients={args.clients} is invalid: must be in [1, {MAX_CLIENTS}]")
    if not 0 < args.duration <= MAX_DURATION_S:
        raise SystemExit(f"--duration={args.duration} is invalid: must be in (0, {MAX_DURATION_S:g}]")
    if args.max_requests < 1:
        raise SystemExit(f"--max-requests={args.max_requests} is invalid: must be >= 1")
    if args.url is not None and urlparse(args.url).hostname not in LOOPBACK_HOSTS:
        raise SystemExit(f"--url={args.url!r} is refused: this load test only targets loopback (127.0.0.1)")


def print_report(report: Report) -> None:
    def ms(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f} ms"

    print(f"load test: {report.clients} streaming clients for {report.duration_s:.1f} s against {report.url} "
          f"({report.route}, max_tokens={report.max_tokens})")
    print(f"  requests     {report.requests} ({report.errors} errors), {report.requests_per_s:.2f} req/s")
    print(f"  tokens/s     {report.tokens_per_s:.1f} (TPF {report.tpf:.2f})")
    print(f"  TTFT         p50 {ms(report.ttft_p50_ms)}, p99 {ms(report.ttft_p99_ms)}")
    print(f"  latency      p50 {ms(report.latency_p50_ms)}, p99 {ms(report.latency_p99_ms)}")
    for example in report.error_examples:
        print(f"  error: {example}")


def main(argv: list[str] | None = None) -> int:
    from diffulex.cli import engine_overrides

    args = build_parser().parse_args(argv)
    check_bounds(args)
    if args.url is not None:
        report = asyncio.run(run_load(args.url.rstrip("/"), args))
    else:
        fields = {"max_num_reqs": max(args.clients, 1), **engine_overrides(args)}
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model
            if model is None:
                from diffulex.testing.checkpoints import write_tiny_checkpoint

                model = str(write_tiny_checkpoint(Path(tmp) / "tiny-sdar", family="sdar", seed=0))
            served = args.model
            args.model = None  # ask the in-process server for its name
            with InProcessServer(model, fields, args.max_waiting) as server:
                report = asyncio.run(run_load(server.url, args))
            report.machine["model"] = served or "tiny random SDAR (diffulex.testing.checkpoints)"
            report.machine["engine_fields"] = fields
    print_report(report)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(asdict(report), indent=2))
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())

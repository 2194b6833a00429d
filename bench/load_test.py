"""Load test of the HTTP server: N concurrent streaming clients for T seconds on loopback.

Each client sends streaming requests back to back until the time is up or the request budget is spent, and
records time to first token (first non-empty text), the gaps between streamed chunks, end-to-end latency,
completion tokens (from the final usage chunk) and errors. Reports requests/s, tokens/s, TTFT, chunk gap and
latency p50/p99, TPF and the error count (the exit code is 1 if any request failed). The client is
`diffulex.bench.load` (shared with ``diffulex bench sweep --targets serving``); this script is its command line.

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
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from diffulex.bench.load import (
    LOOPBACK_HOSTS,
    InProcessServer,
    RequestSpec,
    closed_loop,
    machine,
    make_prompt,
    summarize,
)

MAX_CLIENTS = 256
MAX_DURATION_S = 600.0


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
    chunk_gap_p50_ms: float | None = None
    chunk_gap_p99_ms: float | None = None
    error_examples: list[str] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)


async def run_load(url: str, args: argparse.Namespace) -> Report:
    """`args.clients` closed-loop clients (`diffulex.bench.load.closed_loop`) for `args.duration` seconds."""

    def spec_for(i: int) -> RequestSpec:
        return RequestSpec(make_prompt(i, args.prompt_words), args.max_tokens, args.temperature)

    samples, elapsed = await closed_loop(url, args.route, args.model, args.clients, args.duration,
                                         args.max_requests, spec_for, args.request_timeout)
    stats = summarize(samples, elapsed)
    return Report(
        url=url, route=args.route, clients=args.clients, duration_s=round(elapsed, 3), max_tokens=args.max_tokens,
        requests=stats["requests"], errors=stats["errors"], requests_per_s=stats["requests_per_s"],
        tokens_per_s=stats["tokens_per_s"], tpf=stats["tpf"], ttft_p50_ms=stats["ttft_p50_ms"],
        ttft_p99_ms=stats["ttft_p99_ms"], latency_p50_ms=stats["latency_p50_ms"],
        latency_p99_ms=stats["latency_p99_ms"], chunk_gap_p50_ms=stats["chunk_gap_p50_ms"],
        chunk_gap_p99_ms=stats["chunk_gap_p99_ms"], error_examples=stats["error_examples"], machine=machine(),
    )


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
    print(f"  chunk gap    p50 {ms(report.chunk_gap_p50_ms)}, p99 {ms(report.chunk_gap_p99_ms)}")
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

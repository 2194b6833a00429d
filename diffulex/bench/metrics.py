"""Throughput and latency metrics of a benchmark run, as pure functions over trajectories and step records.

The definitions (docs/benchmarks.md, "Metrics") in one place:

* A *batch* is one ``generate`` call: every request of it is submitted at the batch's start (t = 0), and its
  engine steps run one after another. A step's ``step_time`` is the wall time of the whole engine step
  (scheduling, forward, sampling, bookkeeping); every request in the step shares it. The batch's *step clock*
  puts step k's end at the sum of the step times of the batch's steps up to and including k.
* *Generated tokens* of a request: ``Trajectory.num_generated_tokens`` (answer tokens, plus the stop token when
  the request ended on one). Prompt tokens are never counted. The tokens are *credited* to the steps that
  produced them: step i of a request is credited ``min(F_i, N) - min(F_{i-1}, N)`` tokens, where ``F_i`` is the
  running sum of ``num_new_tokens`` (positions filled) and N the generated tokens; whatever is left (never, in
  practice) goes to the request's last step. So credits sum to N exactly, and positions filled past the end
  of the answer are never counted.
* A request's first step is its *prefill step* (it also decodes). A *decode step* is an engine step that was
  no request's prefill step.

Per request: ``latency`` = end of its last step on the step clock; ``ttft`` = end of the first step credited
with a token (undefined when it generated none); ``tps`` = N / latency.

Per run (over all batches): aggregate TPS = sum N / sum batch wall time (``GenerationOutputs.wall_time``,
which also covers what the step clock does not: tokenizing prompts, the loop around the steps); mean request
TPS = mean of per-request tps; decode TPS = tokens credited to decode steps / time of decode steps; TPF = sum
N / sum NFE; mean NFE = sum NFE / requests; TTFT and latency: mean, p50 and p99 (linear interpolation between
the two nearest ranks, as ``numpy.percentile``'s default).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol


class StepLike(Protocol):
    step: int
    num_new_tokens: int
    step_time: float


class TrajectoryLike(Protocol):
    nfe: int
    steps: Sequence[StepLike]
    error: str | None
    completion_reason: str | None

    @property
    def num_generated_tokens(self) -> int: ...


class BatchLike(Protocol):
    trajectories: Sequence[TrajectoryLike]
    wall_time: float


@dataclass(frozen=True)
class Batch:
    """One generate call: its trajectories and its wall time in seconds (``GenerationOutputs`` fits too)."""

    trajectories: Sequence[Any]
    wall_time: float


@dataclass(frozen=True)
class RequestTiming:
    """The per-request quantities the run metrics are built from."""

    generated_tokens: int
    nfe: int
    latency_s: float
    ttft_s: float | None
    tps: float | None  # None when latency is 0 (only in constructed records)
    prefill_tokens: int  # tokens credited to its first step

    @property
    def tpf(self) -> float:
        return self.generated_tokens / self.nfe if self.nfe else 0.0


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between closest ranks; None for no values."""
    data = sorted(values)
    if not data:
        return None
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"q={q!r} is invalid: must be in [0, 100]")
    rank = (len(data) - 1) * q / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (rank - lo)


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def credited_tokens(num_new_tokens: Sequence[int], generated: int) -> list[int]:
    """Split a request's ``generated`` tokens over its steps (see the module docstring)."""
    credits = []
    filled = 0
    for n in num_new_tokens:
        before = min(filled, generated)
        filled += n
        credits.append(min(filled, generated) - before)
    if credits:
        credits[-1] += generated - sum(credits)
    return credits


def step_clock(trajectories: Iterable[TrajectoryLike]) -> dict[int, tuple[float, float]]:
    """Engine step index -> (start, end) seconds on the batch's step clock (t = 0 at the batch's start)."""
    durations: dict[int, float] = {}
    for traj in trajectories:
        for rec in traj.steps:
            durations.setdefault(rec.step, float(rec.step_time))
    clock: dict[int, tuple[float, float]] = {}
    t = 0.0
    for step in sorted(durations):
        clock[step] = (t, t + durations[step])
        t += durations[step]
    return clock


def _ran(trajectories: Iterable[TrajectoryLike]) -> list[TrajectoryLike]:
    """Requests that ran (a rejected prompt has ``error`` set and no steps)."""
    return [t for t in trajectories if getattr(t, "error", None) is None]


def request_timing(traj: TrajectoryLike, clock: dict[int, tuple[float, float]]) -> RequestTiming:
    """One request's timing on its batch's step clock (``step_clock`` of the batch)."""
    n = traj.num_generated_tokens
    credits = credited_tokens([r.num_new_tokens for r in traj.steps], n)
    latency = clock[traj.steps[-1].step][1] if traj.steps else 0.0
    ttft = next((clock[r.step][1] for r, c in zip(traj.steps, credits, strict=True) if c > 0), None)
    return RequestTiming(
        generated_tokens=n,
        nfe=traj.nfe,
        latency_s=latency,
        ttft_s=ttft,
        tps=n / latency if latency > 0 else None,
        prefill_tokens=credits[0] if credits else 0,
    )


def request_timings(trajectories: Sequence[TrajectoryLike]) -> list[RequestTiming]:
    """Per-request timings of one batch, in order (rejected requests are skipped)."""
    ran = _ran(trajectories)
    clock = step_clock(ran)
    return [request_timing(traj, clock) for traj in ran]


def step_tokens(trajectories: Sequence[TrajectoryLike]) -> dict[int, int]:
    """Engine step index -> generated tokens credited to it, summed over the batch's requests."""
    out: dict[int, int] = {}
    for traj in _ran(trajectories):
        credits = credited_tokens([r.num_new_tokens for r in traj.steps], traj.num_generated_tokens)
        for rec, c in zip(traj.steps, credits, strict=True):
            out[rec.step] = out.get(rec.step, 0) + c
    return out


def decode_split(trajectories: Sequence[TrajectoryLike]) -> tuple[int, float, int]:
    """(tokens credited to decode steps, time of decode steps, number of decode steps) of one batch."""
    ran = _ran(trajectories)
    clock = step_clock(ran)
    prefill_steps = {t.steps[0].step for t in ran if t.steps}
    decode_steps = set(clock) - prefill_steps
    per_step = step_tokens(ran)
    tokens = sum(per_step.get(s, 0) for s in decode_steps)
    seconds = sum(clock[s][1] - clock[s][0] for s in decode_steps)
    return tokens, seconds, len(decode_steps)


@dataclass
class RunMetrics:
    """Every metric of a run; ``to_dict`` is what metrics.json stores under ``"metrics"``."""

    num_requests: int  # requests that ran
    num_rejected: int  # prompts the engine refused (e.g. longer than max_model_len); no metric counts them
    num_batches: int
    generated_tokens: int
    prompt_tokens: int  # informational only: never part of any throughput
    total_nfe: int
    mean_nfe: float | None
    tpf: float | None
    wall_time_s: float
    step_time_s: float
    host_overhead_s: float  # wall time outside engine steps
    num_engine_steps: int
    num_decode_steps: int
    decode_tokens: int
    decode_time_s: float
    aggregate_tps: float | None
    mean_request_tps: float | None
    decode_tps: float | None
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    latency_mean_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    completion_reasons: dict[str, int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(batches: Sequence[BatchLike]) -> RunMetrics:
    """All run metrics from the batches (generate calls) of a run."""
    timings: list[RequestTiming] = []
    wall = step_time = decode_time = 0.0
    decode_tokens = num_steps = num_decode_steps = prompt_tokens = rejected = 0
    reasons: Counter[str] = Counter()
    for batch in batches:
        trajs = list(batch.trajectories)
        ran = _ran(trajs)
        rejected += len(trajs) - len(ran)
        timings += request_timings(trajs)
        clock = step_clock(ran)
        num_steps += len(clock)
        step_time += sum(end - start for start, end in clock.values())
        tokens, seconds, n_decode = decode_split(trajs)
        decode_tokens += tokens
        decode_time += seconds
        num_decode_steps += n_decode
        wall += float(batch.wall_time)
        prompt_tokens += sum(len(getattr(t, "prompt_token_ids", ()) or ()) for t in ran)
        reasons.update(str(t.completion_reason) for t in ran)
    generated = sum(t.generated_tokens for t in timings)
    total_nfe = sum(t.nfe for t in timings)
    latencies = [t.latency_s for t in timings]
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    request_tps = [t.tps for t in timings if t.tps is not None]
    return RunMetrics(
        num_requests=len(timings),
        num_rejected=rejected,
        num_batches=len(batches),
        generated_tokens=generated,
        prompt_tokens=prompt_tokens,
        total_nfe=total_nfe,
        mean_nfe=total_nfe / len(timings) if timings else None,
        tpf=generated / total_nfe if total_nfe else None,
        wall_time_s=wall,
        step_time_s=step_time,
        host_overhead_s=max(wall - step_time, 0.0),
        num_engine_steps=num_steps,
        num_decode_steps=num_decode_steps,
        decode_tokens=decode_tokens,
        decode_time_s=decode_time,
        aggregate_tps=generated / wall if wall > 0 else None,
        mean_request_tps=_mean(request_tps),
        decode_tps=decode_tokens / decode_time if decode_time > 0 else None,
        ttft_mean_s=_mean(ttfts),
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        latency_mean_s=_mean(latencies),
        latency_p50_s=percentile(latencies, 50),
        latency_p99_s=percentile(latencies, 99),
        completion_reasons=dict(sorted(reasons.items())),
    )


# Display names and units of the headline metrics, in report order (report.md, compare).
METRIC_LABELS: dict[str, tuple[str, str]] = {
    "aggregate_tps": ("Aggregate TPS", "tok/s"),
    "mean_request_tps": ("Mean per-request TPS", "tok/s"),
    "decode_tps": ("Decode-only TPS", "tok/s"),
    "tpf": ("TPF", "tok/forward"),
    "mean_nfe": ("Mean NFE", "forwards"),
    "ttft_mean_s": ("TTFT mean", "s"),
    "ttft_p50_s": ("TTFT p50", "s"),
    "ttft_p99_s": ("TTFT p99", "s"),
    "latency_mean_s": ("Latency mean", "s"),
    "latency_p50_s": ("Latency p50", "s"),
    "latency_p99_s": ("Latency p99", "s"),
    "generated_tokens": ("Generated tokens", "tok"),
    "prompt_tokens": ("Prompt tokens (not counted)", "tok"),
    "num_requests": ("Requests", ""),
    "num_rejected": ("Rejected prompts", ""),
    "total_nfe": ("Total NFE", "forwards"),
    "wall_time_s": ("Generation wall time", "s"),
    "step_time_s": ("Engine step time", "s"),
    "host_overhead_s": ("Host overhead (wall - steps)", "s"),
    "num_engine_steps": ("Engine steps", ""),
    "num_decode_steps": ("Decode steps", ""),
    "decode_tokens": ("Decode-step tokens", "tok"),
    "decode_time_s": ("Decode-step time", "s"),
}

"""Server metrics in the Prometheus text exposition format, written by hand (no client library needed).

The engine thread records every step and every finished request; HTTP handlers record rejections and time to
first token; ``GET /metrics`` renders a consistent snapshot. One lock guards everything: updates are a few
additions, far cheaper than a step.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence

from diffulex.engine.engine_load import EngineLoad

# Step times on CPU test models are milliseconds, on a GPU under load up to seconds.
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_WINDOW_S = 10.0  # tokens/s is averaged over this many recent seconds


class Histogram:
    """Cumulative-bucket histogram, the shape Prometheus expects."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        for bound, count in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{name}_bucket{{le="{bound:g}"}} {count}')
        lines.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{name}_sum {self.total:.6f}")
        lines.append(f"{name}_count {self.count}")
        return lines


class ServerMetrics:
    """Counters, gauges and histograms of one server process."""

    def __init__(self, model_name: str = "") -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.kv_pages_used = 0
        self.kv_pages_total = 0
        self.replicas: tuple[EngineLoad, ...] = ()  # data-parallel replicas, in rank order
        self.engine_steps = 0
        self.continued_steps = 0  # of the engine's steps, continued on the device (as the engine counts them)
        self.dropped_continuations = 0  # continuations computed and never applied (the host's step differed)
        self.device_wait_s = 0.0  # seconds the engine waited for the device's step results
        self.refused_continuations: dict[str, int] = {}  # the steps the host launched itself, by reason
        self.decoded_tokens = 0  # mask positions filled, summed over steps
        self.request_forwards = 0  # sum over steps of the batch size: one forward per scheduled request
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests_finished: dict[str, int] = {}
        self.rejected: dict[str, int] = {}  # HTTP status -> count of refused requests
        self.step_seconds = Histogram(STEP_BUCKETS)
        self.batch_size = Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.ttft_seconds = Histogram(LATENCY_BUCKETS)
        self.latency_seconds = Histogram(LATENCY_BUCKETS)
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens) of recent steps, for tokens/s

    # ----- recording --------------------------------------------------------------------------------------

    def observe_step(self, step_time: float, num_tokens: int, batch_size: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.engine_steps += 1
            self.decoded_tokens += num_tokens
            self.request_forwards += batch_size
            self.step_seconds.observe(step_time)
            self.batch_size.observe(batch_size)
            self._recent.append((now, num_tokens))
            self._trim(now)

    def set_state(self, load: EngineLoad) -> None:
        with self._lock:
            self.running, self.waiting = load.running, load.waiting
            self.kv_pages_used, self.kv_pages_total = load.kv_pages_used, load.kv_pages_total
            self.replicas = load.replicas
            self.continued_steps = load.continued_steps
            self.dropped_continuations = load.dropped_continuations
            self.device_wait_s = load.device_wait_s
            self.refused_continuations = dict(load.refused_continuations)

    def observe_admitted(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prompt_tokens += prompt_tokens

    def observe_finished(self, completion_reason: str, generated_tokens: int, latency_s: float) -> None:
        with self._lock:
            self.requests_finished[completion_reason] = self.requests_finished.get(completion_reason, 0) + 1
            self.generation_tokens += generated_tokens
            self.latency_seconds.observe(latency_s)

    def observe_rejected(self, status: int) -> None:
        with self._lock:
            key = str(status)
            self.rejected[key] = self.rejected.get(key, 0) + 1

    def observe_ttft(self, seconds: float) -> None:
        with self._lock:
            self.ttft_seconds.observe(seconds)

    def _trim(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > RATE_WINDOW_S:
            self._recent.popleft()

    # ----- reading ----------------------------------------------------------------------------------------

    def tokens_per_second(self) -> float:
        with self._lock:
            self._trim(time.monotonic())
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def tpf(self) -> float:
        with self._lock:
            return self.decoded_tokens / self.request_forwards if self.request_forwards else 0.0

    def occupancy(self) -> tuple[int, int, int, int]:
        """Requests running and waiting after the last step, and the tokens decoded and steps run so far: what a
        benchmark samples to find the time the engine held a full batch (`diffulex.bench.sweep_serving`)."""
        with self._lock:
            return self.running, self.waiting, self.decoded_tokens, self.engine_steps

    def render(self) -> str:
        tps = self.tokens_per_second()
        tpf = self.tpf()
        with self._lock:
            lines: list[str] = []

            def scalar(name: str, kind: str, help_text: str, value: float) -> None:
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value:g}"])

            def labelled(name: str, kind: str, help_text: str, label: str, values: dict[str, int]) -> None:
                lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
                for key, value in sorted(values.items()):
                    lines.append(f'{name}{{{label}="{key}"}} {value}')

            scalar("diffulex_num_requests_running", "gauge", "Requests in the engine's running set.", self.running)
            scalar("diffulex_num_requests_waiting", "gauge", "Requests admitted by the server, not running yet.",
                   self.waiting)
            scalar("diffulex_kv_pages_used", "gauge", "KV cache pages in use.", self.kv_pages_used)
            scalar("diffulex_kv_pages_total", "gauge", "KV cache pages in the pool.", self.kv_pages_total)
            scalar("diffulex_kv_cache_usage_ratio", "gauge", "Share of KV cache pages in use.",
                   self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else 0.0)
            if self.replicas:
                per_replica = (
                    ("diffulex_replica_up", "Whether the data-parallel replica is alive (1) or has died (0).",
                     lambda r: int(r.alive)),
                    ("diffulex_replica_requests_running", "Requests the replica runs.", lambda r: r.running),
                    ("diffulex_replica_requests_waiting", "Requests queued on the replica.", lambda r: r.waiting),
                    ("diffulex_replica_kv_pages_used", "KV cache pages the replica uses.", lambda r: r.kv_pages_used),
                )
                for name, help_text, value in per_replica:
                    labelled(name, "gauge", help_text, "replica",
                             {str(rank): value(r) for rank, r in enumerate(self.replicas)})
            scalar("diffulex_tokens_per_second", "gauge",
                   f"Tokens decoded per second over the last {RATE_WINDOW_S:g} s.", tps)
            scalar("diffulex_tpf", "gauge", "Tokens decoded per request forward since start (TPF).", tpf)
            scalar("diffulex_engine_steps_total", "counter", "Engine steps (forwards) run.", self.engine_steps)
            scalar("diffulex_continued_steps_total", "counter", "Engine steps continued on the device: queued "
                   "before the step before them was read, their host work overlapping the GPU's.", self.continued_steps)
            scalar("diffulex_dropped_continuations_total", "counter", "Steps continued on the device that the host "
                   "then found it would not have launched: computed, never applied.", self.dropped_continuations)
            scalar("diffulex_device_wait_seconds_total", "counter", "Seconds the engine waited for the device's step "
                   "results; against the wall time, how much of it the device bounds (the rest is host work).",
                   self.device_wait_s)
            labelled("diffulex_continuation_refusals_total", "counter", "Engine steps launched by the host although "
                     "continuations are on, by why the device could not continue the step before.", "reason",
                     self.refused_continuations)
            scalar("diffulex_decoded_tokens_total", "counter", "Mask positions filled by the engine.",
                   self.decoded_tokens)
            scalar("diffulex_request_forwards_total", "counter", "Forwards taken by requests (NFE, summed).",
                   self.request_forwards)
            scalar("diffulex_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", self.prompt_tokens)
            scalar("diffulex_generation_tokens_total", "counter", "Generated tokens of finished requests.",
                   self.generation_tokens)
            labelled("diffulex_requests_finished_total", "counter", "Finished requests by engine completion reason.",
                     "reason", self.requests_finished)
            labelled("diffulex_requests_rejected_total", "counter", "Requests refused, by HTTP status.", "status",
                     self.rejected)
            lines += self.step_seconds.render("diffulex_step_duration_seconds", "Wall time of one engine step.")
            lines += self.batch_size.render("diffulex_step_batch_size", "Requests scheduled in one engine step.")
            lines += self.ttft_seconds.render("diffulex_time_to_first_token_seconds",
                                              "Time from request arrival to its first streamed text.")
            lines += self.latency_seconds.render("diffulex_request_latency_seconds",
                                                 "Time from admission to finish, per request.")
        return "\n".join(lines) + "\n"

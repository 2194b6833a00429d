"""Measured peaks of the device the floors are divided by: copy bandwidth, matmul throughput, one linear's time.

Peaks are measured rather than taken from a data sheet, so a floor is what this machine (clocks, power limit,
memory configuration) can actually do: a large device-to-device ``copy_`` for bandwidth (bytes read plus bytes
written per second) and a large square matmul for throughput. On CUDA the timings are CUDA events around many
back-to-back launches; on CPU, wall time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def time_per_call(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Seconds per call of `fn`, averaged over `iters` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


@dataclass
class HardwarePeaks:
    """What the floors divide by; ``to_dict`` is what the benchmark JSON stores."""

    device: str
    copy_bytes: int  # size of the copied buffer
    copy_bandwidth_bps: float  # (read + write) bytes per second
    matmul_size: int
    matmul_flops_per_s: dict[str, float] = field(default_factory=dict)  # dtype name -> flops per second

    def to_dict(self) -> dict[str, object]:
        return {
            "device": self.device,
            "copy_bytes": self.copy_bytes,
            "copy_bandwidth_GBps": self.copy_bandwidth_bps / 1e9,
            "matmul_size": self.matmul_size,
            "matmul_TFLOPs": {name: flops / 1e12 for name, flops in self.matmul_flops_per_s.items()},
        }


# Readings of the copy rate a peak is the best of, this far apart: right after an engine's memory was freed the rate
# read low for about a second (two H100s, 2026-11-27: 2,505-2,547 GB/s in three readings right after an SDAR-8B
# engine, 2,923-2,952 three seconds later), which made that run's floors too high and its "x floor" too kind.
_COPY_READINGS = 6
_COPY_READING_SPACING_S = 0.3


def measure_copy_bandwidth(
    device: torch.device, num_bytes: int, iters: int = 10, readings: int = 1, spacing_s: float = 0.0
) -> float:
    """Bytes per second of ``dst.copy_(src)`` on `device`, counting each byte once read and once written: the best
    of ``readings`` timings of `iters` copies, ``spacing_s`` seconds apart."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    best = 0.0
    for reading in range(readings):
        if reading:
            time.sleep(spacing_s)
        best = max(best, 2 * num_bytes / time_per_call(lambda: dst.copy_(src), device, iters))
    return best


def measure_matmul_throughput(device: torch.device, dtype: torch.dtype, size: int, iters: int = 10) -> float:
    """Flops per second of an ``size x size x size`` matmul in `dtype` (2 flops per multiply-add)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=gen)
    out = torch.empty(size, size, device=device, dtype=dtype)
    seconds = time_per_call(lambda: torch.matmul(a, b, out=out), device, iters)
    return 2 * size**3 / seconds


def _sizes(device: torch.device, quick: bool) -> tuple[int, int, int]:
    """(copy bytes, matmul size, iterations): large enough to saturate an H100/H200 (1 GiB copies, 8192^3
    matmuls), small on CPU and with `quick` so a smoke run takes a second."""
    if device.type != "cuda":
        return 64 << 20, 512, 3
    return ((256 << 20), 4096, 5) if quick else ((1 << 30), 8192, 20)


def measure_peaks(device: torch.device, dtypes: list[torch.dtype], quick: bool = False) -> HardwarePeaks:
    """Copy bandwidth of `device` and its matmul throughput in each of `dtypes`."""
    copy_bytes, size, iters = _sizes(device, quick)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    readings = (_COPY_READINGS, _COPY_READING_SPACING_S) if device.type == "cuda" else (1, 0.0)
    peaks = HardwarePeaks(name, copy_bytes, measure_copy_bandwidth(device, copy_bytes, iters, *readings), size)
    for dtype in dtypes:
        add_matmul_peak(peaks, device, dtype, quick)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return peaks


def add_matmul_peak(peaks: HardwarePeaks, device: torch.device, dtype: torch.dtype, quick: bool = False) -> float:
    """The matmul throughput of `dtype`, measured once and remembered in `peaks`."""
    key = str(dtype).removeprefix("torch.")
    if key not in peaks.matmul_flops_per_s:
        _, size, iters = _sizes(device, quick)
        peaks.matmul_flops_per_s[key] = measure_matmul_throughput(device, dtype, size, iters)
    return peaks.matmul_flops_per_s[key]


# Weights cycled through by `time_linear` add up to at least this many bytes, so that no call finds its weight in
# the GPU's L2 cache (50 MB on an H100) left there by the previous one, as no layer of a real forward does.
_COLD_WEIGHT_BYTES = 256 * 2**20


def time_linear(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype, iters: int = 20) -> float:
    """Seconds of one ``torch.nn.functional.linear`` of an ``[m, k]`` input by an ``[n, k]`` weight.

    On CUDA the calls are captured in a CUDA graph and replayed, each on another copy of the weight: this is how
    a decode step runs its linears (launched from a graph, weights streamed from memory), whereas eagerly
    launched small GEMMs measure the host's launch latency and repeated ones the L2 cache.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, dtype=dtype, generator=gen)
    if device.type != "cuda":
        w = torch.randn(n, k, device=device, dtype=dtype, generator=gen)
        return time_per_call(lambda: torch.nn.functional.linear(x, w), device, iters, warmup=3)
    weight_bytes = n * k * torch.empty((), dtype=dtype).element_size()
    copies = max(1, min(iters, -(-_COLD_WEIGHT_BYTES // weight_bytes)))
    weights = [torch.randn(n, k, device=device, dtype=dtype, generator=gen) for _ in range(copies)]

    def calls() -> None:
        for i in range(iters):
            torch.nn.functional.linear(x, weights[i % copies])

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        calls()  # warm-up: library handles and kernel choices exist before capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls()
    return time_per_call(graph.replay, device, 3, warmup=1) / iters


def time_graph_calls(
    call: Callable[[int], object],
    calls: int,
    replays: int = 5,
    warmup: int = 3,
    before_replay: Callable[[], object] | None = None,
) -> float:
    """Microseconds per call of ``call(i)`` for ``i`` in ``range(calls)``, captured once in a CUDA graph and
    replayed (the best of ``replays``): a kernel's time as a decode step's graph launches it, without the host's
    launch latency. ``call`` may cycle through copies of its weights by ``i`` so that none comes from the L2 cache.
    ``warmup`` untimed calls on a side stream first (library handles, Triton compiles). ``before_replay`` runs
    before each timed replay, after the device is idle (ranks that time a collective meet there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warmup):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        if before_replay is not None:
            torch.cuda.synchronize()
            before_replay()
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / calls)
    del graph
    return best


def time_checked_config(
    timed: Callable[[], float],
    out: torch.Tensor,
    expected: torch.Tensor | None,
    flops: float,
    flops_per_s: float,
    tolerance: float,
) -> dict[str, float]:
    """One kernel configuration of a candidate sweep: ``out`` filled with NaN, ``timed()`` (its seconds per launch,
    which writes ``out``), then ``out`` against ``expected`` (None: not checked) and the time priced against the
    flops floor. Raises RuntimeError where the output is off by more than ``tolerance`` (a NaN, a row left
    unwritten, fails too), so that the sweep reports the configuration rather than keeping it."""
    out.fill_(float("nan"))
    seconds = timed()
    row: dict[str, float] = {}
    if expected is not None:
        row["max_abs_error"] = (out.float() - expected).abs().max().item()
        if not row["max_abs_error"] <= tolerance:
            raise RuntimeError(f"max abs error {row['max_abs_error']:.3g} > {tolerance}")
    return row | {"ms": 1e3 * seconds, "floor_ms": 1e3 * flops / flops_per_s, "tflops": flops / seconds / 1e12,
                  "x_floor": seconds * flops_per_s / flops}  # fmt: skip

"""The HTTP load client's summary (diffulex/bench/load.py): percentiles, tokens/s and the gaps between streamed
chunks, checked by hand on made-up samples."""

from __future__ import annotations

import pytest

from diffulex.bench.load import Sample, percentile, summarize


def test_percentile_is_nearest_rank_and_none_without_data() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert percentile(values, 50) == 3.0
    assert percentile(values, 99) == 5.0
    assert percentile(values, 0) == 1.0
    assert percentile([], 50) is None


def test_summary_counts_only_successful_requests_and_pools_their_chunk_gaps() -> None:
    samples = [
        Sample(True, ttft_s=0.010, latency_s=0.100, completion_tokens=30, nfe=10, chunk_gaps_s=[0.020, 0.030]),
        Sample(True, ttft_s=0.050, latency_s=0.200, completion_tokens=10, nfe=10, chunk_gaps_s=[0.040]),
        Sample(False, latency_s=0.5, completion_tokens=99, error="HTTP 503: busy"),
    ]
    stats = summarize(samples, elapsed_s=2.0)
    assert stats["requests"] == 3 and stats["errors"] == 1 and stats["error_examples"] == ["HTTP 503: busy"]
    assert stats["completion_tokens"] == 40 and stats["tokens_per_s"] == 20.0  # the failed request's tokens: none
    assert stats["tpf"] == 2.0
    assert stats["ttft_p50_ms"] == pytest.approx(10.0) and stats["ttft_p99_ms"] == pytest.approx(50.0)
    assert stats["chunk_gap_p50_ms"] == pytest.approx(30.0) and stats["chunk_gap_p99_ms"] == pytest.approx(40.0)
    assert stats["latency_p99_ms"] == pytest.approx(200.0)

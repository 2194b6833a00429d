"""``diffulex bench sweep --targets dp``: ``diffulex serve`` with one then two data-parallel replicas under the
same per-replica streaming load, on a tiny checkpoint on the CPU (``--quick``); a server that exits stops the wait
at once."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest

from diffulex.bench import sweep_common, sweep_data_parallel
from diffulex.bench.sweep_data_parallel import ServerDiedError, ServerProcess, dp_shape, while_alive
from diffulex.cli import main

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


def test_dp_is_measured_only_when_named() -> None:
    assert "dp" in sweep_common.TARGETS
    assert "dp" not in sweep_common.SweepSettings().targets


def test_quick_dp_serves_every_request_from_one_then_two_replicas(tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    assert main(["bench", "sweep", "--quick", "--targets", "dp", "--out", str(out)]) == 0
    data = json.loads((out / "dp.json").read_text())
    assert data["target"] == "dp" and data["error"] is None
    shape = dp_shape(quick=True)
    rows = {r["data_parallel_size"]: r for r in data["rows"]}
    assert sorted(rows) == [1, 2]
    for size, row in rows.items():
        assert row["error"] is None, row
        assert "--data-parallel-size" in row["command"] and row["command"][row["command"].index(
            "--data-parallel-size") + 1] == str(size)
        clients = shape.per_replica * size
        assert row["concurrency"] == clients
        assert row["requests"] == shape.requests_per_client * clients and row["errors"] == 0
        assert row["completion_tokens"] == row["requests"] * shape.max_tokens  # ignore_eos: every answer is full
        assert row["tokens_per_s"] > 0 and row["ttft_p50_ms"] <= row["ttft_p99_ms"]
        assert row["itl_p50_ms"] <= row["itl_p99_ms"]
        assert (out / f"dp{size}-server.log").is_file()
    assert rows[2]["vs_dp1"] == pytest.approx(rows[2]["tokens_per_s"] / rows[1]["tokens_per_s"])
    assert rows[2]["met"] == (rows[2]["vs_dp1"] >= sweep_data_parallel.DP_SCALING_TARGET)
    assert "| tiny-sdar | 2 | 8 |" in (out / "tables.md").read_text()


def test_a_server_that_exits_while_starting_fails_its_row_at_once(tmp_path: Path, monkeypatch) -> None:
    def exits(*args, **kwargs) -> list[str]:
        return [sys.executable, "-c", "import sys; print('no device for replica 1'); sys.exit(3)"]

    monkeypatch.setattr(sweep_data_parallel, "serve_command", exits)
    out = tmp_path / "sweep"
    started = time.monotonic()
    assert main(["bench", "sweep", "--quick", "--targets", "dp", "--out", str(out)]) == 1
    assert time.monotonic() - started < sweep_data_parallel.SERVER_START_TIMEOUT_S / 10
    rows = json.loads((out / "dp.json").read_text())["rows"]
    assert [r["data_parallel_size"] for r in rows] == [1, 2]
    for row in rows:
        log = out / f"dp{row['data_parallel_size']}-server.log"
        assert row["error"] == (f"ServerDiedError: the server exited with code 3; its log ({log}) ends: "
                                "no device for replica 1")
        assert row["server_log_tail"] == "no device for replica 1"


def test_a_load_run_stops_when_the_server_exits(tmp_path: Path) -> None:
    with ServerProcess([sys.executable, "-c", "import time; time.sleep(1)"], "http://127.0.0.1:9",
                       tmp_path / "server.log") as server:
        started = time.monotonic()
        with pytest.raises(ServerDiedError, match="exited with code 0"):
            asyncio.run(while_alive(server, asyncio.sleep(600), time.monotonic() + 600))
        assert time.monotonic() - started < 30


def test_a_load_run_stops_when_the_budget_is_spent(tmp_path: Path) -> None:
    with ServerProcess([sys.executable, "-c", "import time; time.sleep(600)"], "http://127.0.0.1:9",
                       tmp_path / "server.log") as server:
        with pytest.raises(TimeoutError, match="budget"):
            asyncio.run(while_alive(server, asyncio.sleep(600), time.monotonic() + 0.5))
    assert server.process.poll() is not None  # stopped on the way out


def test_engine_fields_reach_the_server_as_its_own_flags_read_them(tmp_path: Path) -> None:
    from diffulex.cli import engine_overrides
    from diffulex.server.cli import build_parser

    fields = {"max_num_reqs": 64, "enforce_eager": True, "enable_prefix_caching": False, "device_ids": [0, 1],
              "load_format": "dummy", "gpu_memory_utilization": 0.8, "data_parallel_size": 2}
    command = sweep_data_parallel.serve_command(tmp_path, 8123, 512, fields)
    assert command[:3] == [sys.executable, "-m", "diffulex.server"]
    args = build_parser().parse_args(command[3:])
    assert (args.model, args.port, args.max_waiting_requests) == (str(tmp_path), 8123, 512)
    assert engine_overrides(args) == fields

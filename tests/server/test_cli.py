"""``diffulex serve`` / ``python -m diffulex.server``: flags, startup, and a clean exit on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from diffulex.cli import build_parser, main
from diffulex.server.cli import listening_sockets, url_of
from diffulex.server.limits import DEFAULT_MAX_BODY_BYTES
from diffulex.testing.distributed import free_port


def test_serve_is_a_diffulex_subcommand_with_engine_flags() -> None:
    args = build_parser().parse_args(["serve", "--port", "9001", "--block-size", "8", "--queue-policy", "wait"])
    assert args.port == 9001 and args.host == "127.0.0.1" and args.queue_policy == "wait"
    assert args.block_size == 8 and args.model is None
    assert args.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 4 * 1024 * 1024
    assert callable(args.func)


@pytest.mark.parametrize(("flag", "value", "allowed"), [
    ("--port", "70000", "must be an integer in [0, 65535]"),
    ("--port", "-1", "must be an integer in [0, 65535]"),
    ("--port", "http", "must be an integer in [0, 65535]"),
    ("--queue-timeout", "-1", "must be a finite number of seconds >= 0"),
    ("--queue-timeout", "nan", "must be a finite number of seconds >= 0"),
    ("--shutdown-grace", "nan", "must be a finite number of seconds >= 0"),
    ("--shutdown-grace", "-1", "must be a finite number of seconds >= 0"),
    ("--shutdown-grace", "inf", "must be a finite number of seconds >= 0"),
    # an empty host (`--host "$HOST"` with HOST unset) would listen on every interface
    ("--host", "", "must be an address or a host name (0.0.0.0 listens on every interface)"),
    ("--host", " ", "must be an address or a host name (0.0.0.0 listens on every interface)"),
    ("--served-model-name", "", "must be a non-empty model id"),
    ("--max-body-bytes", "0", "must be an integer >= 1"),
    ("--max-waiting-requests", "-1", "must be an integer >= 0"),
    ("--max-waiting-requests", "many", "must be an integer >= 0"),
])
def test_a_server_flag_out_of_range_is_refused_while_parsing_before_anything_loads(
    flag: str, value: str, allowed: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import diffulex.server.engine_placement as placement

    built = []
    monkeypatch.setattr(placement, "build_served_engine", lambda *args, **kwargs: built.append(args))
    with pytest.raises(SystemExit) as exit_:
        main(["serve", f"{flag}={value}"])
    assert exit_.value.code == 2
    assert f"diffulex serve: error: argument {flag}: {value!r} is invalid: {allowed}" in capsys.readouterr().err
    assert built == []


@pytest.mark.parametrize(("flag", "value", "parsed"), [
    ("--port", "0", 0), ("--port", "65535", 65535), ("--queue-timeout", "0", 0.0), ("--queue-timeout", "2.5", 2.5),
    ("--shutdown-grace", "0", 0.0), ("--max-body-bytes", "1", 1), ("--max-waiting-requests", "0", 0),
])
def test_server_flags_at_the_ends_of_their_ranges_are_accepted(flag: str, value: str, parsed: float) -> None:
    args = build_parser().parse_args(["serve", flag, value])
    assert getattr(args, flag[2:].replace("-", "_")) == parsed


def test_a_port_in_use_is_refused_naming_the_flags_before_the_engine_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    import diffulex.server.engine_placement as placement

    built = []
    monkeypatch.setattr(placement, "build_served_engine", lambda *args, **kwargs: built.append(args))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        args = build_parser().parse_args(["serve", "--port", str(port)])
        with pytest.raises(ValueError, match=rf"^cannot listen on --host=127.0.0.1 --port={port}: "):
            args.func(args)
    assert built == []


def test_port_zero_is_reported_as_the_port_the_system_chose() -> None:
    sockets = listening_sockets("127.0.0.1", 0)
    try:
        assert len(sockets) == 1
        port = sockets[0].getsockname()[1]
        assert port != 0 and url_of(sockets[0]) == f"http://127.0.0.1:{port}/"
    finally:
        for sock in sockets:
            sock.close()


def test_module_entry_point_serves_and_exits_cleanly_on_sigterm(sdar_dir: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "diffulex.server", "--model", str(sdar_dir), "--port", str(port),
           "--served-model-name", "cli-test", "--block-size", "4", "--page-size", "8", "--max-model-len", "128",
           "--shutdown-grace", "3", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stdout.read().decode()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                         json={"model": "cli-test", "prompt": "hi", "max_tokens": 4, "temperature": 0}, timeout=30)
        assert out.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

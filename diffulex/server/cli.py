"""``diffulex serve``: build the engine, wrap it in the HTTP app, run uvicorn until interrupted.

Importing this module must stay cheap (``diffulex`` imports it to list subcommands): heavy imports happen inside
`serve`.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import socket
import sys
from collections.abc import Callable
from typing import Any

from diffulex.server.limits import DEFAULT_MAX_BODY_BYTES, SECONDS_RULE, is_seconds


def port_number(text: str) -> int:
    """``--port``: checked while the arguments are parsed, so that a port no socket can bind fails at once instead
    of after the engine has loaded (uvicorn would raise OverflowError only when it binds)."""
    try:
        port = int(text)
    except ValueError:
        port = None
    if port is None or not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be an integer in [0, 65535]")
    return port


def count_from(low: int) -> Callable[[str], int]:
    """An integer flag of at least ``low`` (``--max-waiting-requests`` >= 0, ``--max-body-bytes`` >= 1), checked
    while the arguments are parsed, before anything loads."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be an integer >= {low}")
        return value

    parse.__name__ = "integer"  # what argparse names in a message of its own
    return parse


def host_address(text: str) -> str:
    """``--host``: an empty host would make uvicorn listen on every interface, IPv4 and IPv6, as only ``0.0.0.0``
    (or ``::``) should ask for (there is no authentication); an empty ``--host "$HOST"`` must not do that."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be an address or a host name (0.0.0.0 listens "
                                         "on every interface)")
    return text


def model_name(text: str) -> str:
    """``--served-model-name``: an empty name would be replaced by the folder's without a word."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be a non-empty model id")
    return text


def listening_sockets(host: str, port: int) -> list[socket.socket]:
    """The server's sockets, bound before the engine loads, as uvicorn (asyncio's ``create_server``) would bind
    them: one per address ``host`` resolves to, IPv6 ones IPv6-only. A host that does not resolve, a port in use
    or one this user may not bind then fails at once, naming the flags, instead of after the model has loaded (a
    log line from uvicorn minutes later); and the address printed is the one bound, even for ``--port 0``."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"--host={host!r} is invalid: it does not resolve to an address ({err})") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(sockets) > 1:  # every address on the one port the system chose
                address = (address[0], sockets[0].getsockname()[1], *address[2:])
            sock.bind(address)
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise ValueError(f"cannot listen on --host={host} --port={port}: {err.strerror or err}") from None
    return sockets


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}/" if sock.family == socket.AF_INET6 else f"http://{host}:{port}/"


def seconds(text: str) -> float:
    """``--queue-timeout``, ``--shutdown-grace``: checked while the arguments are parsed (`limits.is_seconds`)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not is_seconds(value):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: {SECONDS_RULE}")
    return value


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    """The server's own flags (the engine fields are added by `diffulex.cli.add_engine_flags`)."""
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in demo model)")
    parser.add_argument("--config", default=None, help="YAML file with engine fields (flat or under 'engine:')")
    net = parser.add_argument_group("server")
    net.add_argument("--host", type=host_address, default="127.0.0.1",
                     help="address to listen on (default 127.0.0.1; 0.0.0.0: every interface)")
    net.add_argument("--port", type=port_number, default=8000, help="port to listen on, 0-65535 (default 8000)")
    net.add_argument("--served-model-name", type=model_name, default=None,
                     help="model id shown by /v1/models and accepted in requests (default: the folder name)")
    net.add_argument("--max-waiting-requests", type=count_from(0), default=256,
                     help="requests that may wait beyond the engine's max_num_reqs running ones (default 256)")
    net.add_argument("--queue-policy", choices=("reject", "wait"), default="reject",
                     help="when full: answer 429 at once (reject) or wait for a slot up to --queue-timeout (wait)")
    net.add_argument("--queue-timeout", type=seconds, default=30.0,
                     help="seconds (>= 0) a request may wait for a slot with --queue-policy wait (default 30)")
    net.add_argument("--shutdown-grace", type=seconds, default=30.0,
                     help="seconds (>= 0) in-flight requests get to finish at shutdown before they are aborted "
                     "(default 30)")
    net.add_argument("--max-body-bytes", type=count_from(1), default=DEFAULT_MAX_BODY_BYTES,
                     help="largest request body accepted; larger ones get 413 before they are parsed "
                     f"(default {DEFAULT_MAX_BODY_BYTES}, 4 MiB)")
    net.add_argument("--engine-placement", choices=("auto", "process", "thread"), default="auto",
                     help="where the engine steps: a process of its own (its host work never waits for the server's "
                     "GIL) or a thread of the server process; auto: the process unless the engine has several "
                     "tensor- or expert-parallel ranks or a backend other than mp (default auto; docs/serving.md)")
    net.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"),
                     help="log level of the server and uvicorn (default info)")


def add_parser(subparsers: Any) -> None:
    """Register ``serve`` on the ``diffulex`` command line."""
    from diffulex.cli import add_engine_flags

    parser = subparsers.add_parser("serve", help="serve a model over HTTP (OpenAI-compatible API and a live page)")
    add_serve_flags(parser)
    add_engine_flags(parser)
    parser.set_defaults(func=serve)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m diffulex.server`` (same flags as ``diffulex serve``)."""
    from diffulex.cli import CommandParser, add_engine_flags

    parser = CommandParser(prog="python -m diffulex.server", description="Serve a Diffulex model over HTTP")
    add_serve_flags(parser)
    add_engine_flags(parser)
    parser.set_defaults(func=serve)
    return parser


def serve(args: argparse.Namespace) -> int:
    """Build the engine, then run the app until SIGINT/SIGTERM; returns the process exit code."""
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ModuleNotFoundError as err:
        raise ValueError(f"diffulex serve needs the serving extras ({err.name} is missing): "
                         "pip install 'diffulex[serve]'") from None

    from diffulex.cli import default_model_dir, model_and_fields
    from diffulex.server.app import create_app
    from diffulex.server.engine_loop import EngineLoop
    from diffulex.server.engine_placement import build_served_engine
    from diffulex.server.metrics import ServerMetrics
    from diffulex.server.runner import GracefulServer

    level = getattr(logging, args.log_level.upper())
    logging.getLogger("diffulex").setLevel(level)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    model, fields = model_and_fields(args)
    if model is None:
        model = str(default_model_dir())
        print(f"no --model given: serving the built-in model at {model} (the model the project "
              "trained, docs/training.md)", file=sys.stderr)
    sockets = listening_sockets(args.host, args.port)
    try:
        engine = build_served_engine(str(model), fields, args.engine_placement)
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    name = args.served_model_name
    loop = EngineLoop(
        engine,
        max_waiting=args.max_waiting_requests,
        queue_policy=args.queue_policy,
        queue_timeout=args.queue_timeout,
        metrics=ServerMetrics(name or ""),
    )
    app = create_app(loop, name, shutdown_grace_s=args.shutdown_grace, max_body_bytes=args.max_body_bytes)
    print(f"serving {app.state.served_model_name} on {' and '.join(url_of(sock) for sock in sockets)}",
          file=sys.stderr)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    server = GracefulServer(config, loop, args.shutdown_grace)
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown), then re-raises the signal to the handler it found
    # installed. Install a no-op one so that a requested, completed shutdown ends the process with exit code 0.
    stop_signals = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda *_: None) for s in stop_signals}
    try:
        server.run(sockets=sockets)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return server.exit_code

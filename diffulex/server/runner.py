"""Running the app under uvicorn with a shutdown that keeps its promises.

uvicorn's own graceful shutdown waits for open connections and, past its timeout, cancels their tasks: a waiting
client then gets a plain-text 500 and a stream is cut without an error event or ``[DONE]``. `GracefulServer`
drains the engine first: at the first SIGINT/SIGTERM it stops listening, lets in-flight requests finish for the
grace period, then aborts the rest through the engine loop, so every handler still answers with the documented
error body (or error event and ``[DONE]``) before uvicorn closes the connections. A second signal exits at once.
If the engine fails as a whole the server stops with exit code 1, so that a supervisor restarts it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from types import FrameType

import uvicorn

from diffulex.server.engine_loop import EngineLoop

logger = logging.getLogger("diffulex.server")

# Once the engine has ended every request, how long handlers get to send their last bytes.
RESPONSE_FLUSH_S = 5


class GracefulServer(uvicorn.Server):
    """A uvicorn server that drains ``engine_loop`` before closing connections (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, engine_loop: EngineLoop, shutdown_grace_s: float) -> None:
        config.timeout_graceful_shutdown = RESPONSE_FLUSH_S
        super().__init__(config)
        self.engine_loop = engine_loop
        self.shutdown_grace_s = shutdown_grace_s
        self.exit_code = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            logger.warning("second %s during shutdown: exiting now", signal.Signals(sig).name)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + sig)
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.engine_loop.failure and not self.should_exit:
            logger.error("stopping the server: %s", self.engine_loop.failure)
            self.exit_code = 1
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets: list | None = None) -> None:
        for server in self.servers:  # stop accepting connections while the engine drains
            server.close()
        await self.engine_loop.shutdown(self.shutdown_grace_s)
        await super().shutdown(sockets)

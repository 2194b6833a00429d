"""HTTP serving for Diffulex: an OpenAI-compatible API, the native ``/generate`` route and a live denoising page.

`EngineLoop` (in `engine_loop`) owns the engine on one background thread and batches every in-flight request;
`create_app` (in `app`) builds the FastAPI application around it; ``diffulex serve`` (in `cli`) runs both under
uvicorn. See docs/serving.md.
"""

from __future__ import annotations

__all__ = ["create_app", "EngineLoop"]


def __getattr__(name: str):
    # Lazy, so that ``import diffulex.server.cli`` (done by every ``diffulex`` command) stays cheap and works
    # without the serving extras installed.
    if name == "create_app":
        from diffulex.server.app import create_app

        return create_app
    if name == "EngineLoop":
        from diffulex.server.engine_loop import EngineLoop

        return EngineLoop
    raise AttributeError(name)

"""The FastAPI application: OpenAI-compatible routes, the native ``/generate`` route, health, metrics and the page.

Handlers never touch the engine: they validate, submit to the `EngineLoop`, and turn its emissions into JSON or
server-sent events. Every failure is answered with an OpenAI-style error body, so a bad request costs the server
nothing but the answer.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from diffulex.sampling_params import SamplingParams
from diffulex.server.engine_loop import (
    Emission,
    EngineLoop,
    EngineUnavailableError,
    GenerationInput,
    Interest,
    QueueFullError,
    RequestTooLargeError,
    Submitted,
)
from diffulex.server.limits import DEFAULT_MAX_BODY_BYTES, SECONDS_RULE, is_seconds
from diffulex.server.prompts import PromptEncoder
from diffulex.server.protocol import (
    MAX_CHOICES_PER_REQUEST,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    ModelCard,
    ModelList,
    SamplingFields,
    error_body,
    escaped,
    openai_finish_reason,
)
from diffulex.server.request_body import BodyGuard
from diffulex.server.sse import TEXT_SLOT, EventTemplate, sse
from diffulex.server.streams import DenoiseView, TextStream

logger = logging.getLogger("diffulex.server")

STATIC_DIR = Path(__file__).parent / "static"
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

# Put into a request's sink by its disconnect watcher.
_DISCONNECTED = Emission(rid="", index=-1, error="client_disconnected")


@dataclass
class _Choice:
    """What one choice has produced so far."""

    prompt_len: int
    params: SamplingParams
    text: TextStream
    nfe: int = 0
    final: Emission | None = None
    sent_any: bool = False


@dataclass
class _Job:
    """One HTTP request's completions in the engine, and the watcher that aborts them if the client leaves."""

    loop: EngineLoop
    request: Request
    subs: list[Submitted]
    sink: asyncio.Queue[Emission]
    choices: list[_Choice]
    arrived: float
    n: int = 1  # choices per prompt: the prompt's tokens count once in the usage
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)

    def start_watching(self) -> None:
        self.watcher = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        """Abort when the client goes away. The body has been read, so the server's next message for this request
        is ``http.disconnect``, sent when the connection is lost (or the response complete): one wait per request,
        where polling `Request.is_disconnected` cost the event loop a call per request four times a second."""
        while (await self.request.receive())["type"] != "http.disconnect":
            pass
        self.abort()
        self.sink.put_nowait(_DISCONNECTED)

    def abort(self) -> None:
        unfinished = [s.rid for s, c in zip(self.subs, self.choices, strict=True) if c.final is None]
        self.loop.abort(unfinished)

    def close(self) -> None:
        """Abort whatever has not finished (client gone, error, or generator closed) and stop the watcher."""
        self.abort()
        if self.watcher is not None:
            self.watcher.cancel()

    @property
    def done(self) -> bool:
        return all(c.final is not None for c in self.choices)

    async def next(self) -> Emission:
        emission = await self.sink.get()
        if emission is not _DISCONNECTED:
            choice = self.choices[emission.index]
            if emission.update is not None:
                choice.nfe = emission.steps
            if emission.final:
                choice.final = emission
        return emission

    def usage(self) -> dict[str, Any]:
        prompt_tokens = sum(c.prompt_len for k, c in enumerate(self.choices) if k % self.n == 0)
        completion = sum(_generated(c) for c in self.choices)
        nfe = sum(c.nfe for c in self.choices)
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
            "nfe": nfe,
            "tpf": completion / nfe if nfe else 0.0,
        }


class HeadAsGet:
    """ASGI middleware: a ``HEAD`` request is answered as its ``GET`` would be, without the body.

    HTTP expects every GET route to answer HEAD (load balancers health-check with it), but FastAPI routes declared
    with ``@app.get`` answer it 405. The request goes to the app as a GET; its status and headers (Content-Length
    included, as HTTP asks) are sent as they are and its body is dropped here, whatever the server under the app
    does with a HEAD response's body. A route without GET answers HEAD as it answers GET (405, 404).
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            elif message["type"] == "http.response.pathsend":  # a file the server would send itself
                message = {"type": "http.response.body", "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


def _generated(choice: _Choice) -> int:
    if choice.final is None or choice.final.update is None or choice.final.update.trajectory is None:
        return 0
    return choice.final.update.trajectory.num_generated_tokens


def _trajectory(choice: _Choice) -> Any:
    final = choice.final
    return final.update.trajectory if final is not None and final.update is not None else None


def _end_error(emission: Emission) -> APIError | None:
    """The error of a request that ended without an answer, or None while it runs or once it has its answer.

    A request ends without an answer when the server aborts it (shutdown), when the engine fails as a whole, or
    when the engine fails the step it was part of (its trajectory then carries the error; the engine goes on).
    """
    if emission.error == "aborted":
        return APIError(503, "the request was aborted (server shutting down)", type="server_error", code="aborted")
    if emission.error is not None:
        return APIError(503, emission.error, type="server_error", code="engine_error")
    update = emission.update
    traj = update.trajectory if update is not None and update.finished else None
    if traj is not None and traj.error is not None:
        return APIError(500, f"the engine failed this request: {traj.error}", type="server_error",
                        code="engine_error")
    return None


def create_app(
    engine_loop: EngineLoop,
    served_model_name: str | None = None,
    *,
    shutdown_grace_s: float = 30.0,
    manage_engine_loop: bool = True,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """Build the app around ``engine_loop``.

    With ``manage_engine_loop`` the app's lifespan starts the loop's engine thread and shuts it down gracefully
    (in-flight requests get ``shutdown_grace_s`` to finish, then are aborted). A request body over
    ``max_body_bytes`` is refused (413) before it is parsed.
    """
    if not is_seconds(shutdown_grace_s):
        raise ValueError(f"shutdown_grace_s={shutdown_grace_s!r} is invalid: {SECONDS_RULE}")
    model_name = served_model_name or Path(engine_loop.config.model).name
    metrics = engine_loop.metrics
    tokenizer = engine_loop.tokenizer
    encoder = PromptEncoder(tokenizer, engine_loop.max_model_len, engine_loop.vocab_limit, engine_loop.mask_token_id)
    started = int(time.time())

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if manage_engine_loop:
            engine_loop.start(asyncio.get_running_loop())
        # The app, its schemas and the server live as long as the process: out of the collector's reach (as the
        # engine's build is), so that a full collection scans only what requests create. Each such collection
        # stops every stream and the engine loop at once (pauses of 50 ms at 128 streams before this).
        gc.freeze()
        try:
            yield
        finally:
            if manage_engine_loop:
                await engine_loop.shutdown(shutdown_grace_s)
            encoder.close()

    app = FastAPI(title="Diffulex", version="0.1.0", lifespan=lifespan)
    app.add_middleware(BodyGuard, max_body_bytes=max_body_bytes, json_paths=GENERATION_ROUTES,
                       on_reject=metrics.observe_rejected)
    app.add_middleware(HeadAsGet)
    app.state.engine_loop = engine_loop
    app.state.served_model_name = model_name

    # ----- errors ----------------------------------------------------------------------------------------

    def error_response(err: APIError) -> JSONResponse:
        metrics.observe_rejected(err.status)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
            return error_response(APIError(400, message, code="invalid_json"))
        message, param = validation_message(errors)
        return error_response(APIError(400, message, param=param, code="invalid_value"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(APIError(err.status_code, str(err.detail), type=kind))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {err!r}", type="server_error"))

    # ----- helpers ---------------------------------------------------------------------------------------

    def check_model(name: str | None) -> None:
        if name is not None and name not in (model_name, engine_loop.config.model):
            raise APIError(404, f"The model '{escaped(name)}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")

    async def start_job(
        request: Request, texts: list[str | list[int]], fields: SamplingFields, default_max_tokens: int,
        rid_prefix: str, interest: Interest, prompt_param: str = "prompt",
    ) -> _Job:
        arrived = time.monotonic()
        n = fields.num_choices
        if n < 1:
            raise APIError(400, f"n={n} is invalid: must be an integer >= 1", param="n")
        count = len(texts) * n
        limit = min(MAX_CHOICES_PER_REQUEST, engine_loop.capacity)
        if count > limit:
            param = "n" if n > 1 else "prompt"
            raise APIError(400, f"{len(texts)} prompt(s) x n={n} is too many completions for one request: this "
                           f"server runs at most {limit} per request", param=param, code="too_many_completions")
        params = [fields.sampling_params(default_max_tokens, choice=j) for j in range(n)]
        if engine_loop.draining:  # refuse before tokenizing anything
            raise APIError(503, engine_loop.failure or "the server is shutting down", type="server_error",
                           code="unavailable")
        parse_special = bool(fields.parse_special_tokens)
        token_ids = await asyncio.gather(*(encoder.encode(text, prompt_param, parse_special) for text in texts))
        inputs = [GenerationInput(ids, params[j]) for ids in token_ids for j in range(n)]
        sink: asyncio.Queue[Emission] = asyncio.Queue()
        try:
            subs = await engine_loop.submit(inputs, sink, rid_prefix, interest)
        except RequestTooLargeError as err:
            raise APIError(400, str(err), param="n" if n > 1 else "prompt", code="too_many_completions") from None
        except QueueFullError as err:
            raise APIError(429, str(err), type="rate_limit_error", code="queue_full") from None
        except EngineUnavailableError as err:
            raise APIError(503, str(err), type="server_error", code="unavailable") from None
        except ValueError as err:
            message, param = fields.as_sent(str(err))
            raise APIError(400, message, param=param) from None
        choices = [
            _Choice(len(s.prompt_token_ids), inp.params, TextStream(tokenizer, inp.params.stop))
            for s, inp in zip(subs, inputs, strict=True)
        ]
        job = _Job(engine_loop, request, subs, sink, choices, arrived, n)
        job.start_watching()
        return job

    async def run_to_end(job: _Job) -> None:
        """Wait for every choice (non-streaming); a client that leaves gets 499 and its requests are aborted."""
        try:
            while not job.done:
                emission = await job.next()
                if emission is _DISCONNECTED:
                    raise APIError(499, "client disconnected", code="client_disconnected")
                if (error := _end_error(emission)) is not None:
                    raise error
        finally:
            job.close()

    def streaming(body: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)

    async def guarded(job: _Job, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Closes the job however the stream ends, and turns failures into an error event plus ``[DONE]``."""
        try:
            async for event in events:
                yield event
        except APIError as err:
            yield sse(err.body())
            yield sse("[DONE]")
        except Exception as err:  # already streaming: the status line is gone, report in-band
            logger.exception("stream failed")
            yield sse(error_body(f"internal error: {err!r}", "server_error"))
            yield sse("[DONE]")
        finally:
            job.close()

    def note_first_text(job: _Job, choice: _Choice) -> None:
        if not choice.sent_any:
            choice.sent_any = True
            if choice is job.choices[0]:
                metrics.observe_ttft(time.monotonic() - job.arrived)

    async def delta_events(
        job: _Job, text_chunks: list[EventTemplate], final_chunk: Callable[[int, str, Emission], str]
    ) -> AsyncIterator[str]:
        """A stream's events for its choices' text: a chunk of new text rendered from the choice's template, a
        choice's last chunk (with its finish reason) in full."""
        async for index, text, final in _text_deltas(job):
            if final is None and not text:
                continue
            note_first_text(job, job.choices[index])
            yield text_chunks[index].render(text) if final is None else final_chunk(index, text, final)

    # ----- OpenAI routes ---------------------------------------------------------------------------------

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        card = ModelCard(id=model_name, created=started, root=engine_loop.config.model,
                         max_model_len=engine_loop.max_model_len)
        return ModelList(data=[card])

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | dict[str, Any]:
        check_model(body.model)
        prompts = _completion_prompts(body.prompt)
        job = await start_job(request, prompts, body, COMPLETIONS_DEFAULT_MAX_TOKENS, "cmpl",
                              "commits" if body.stream else "end")
        cid = job.subs[0].rid
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(index: int, text: str, finish: Emission | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
            if finish is not None:
                traj = finish.update.trajectory
                choice["finish_reason"] = openai_finish_reason(traj.completion_reason)
                choice["diffulex_completion_reason"] = traj.completion_reason
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [choice]}

        if body.stream:
            text_chunks = [EventTemplate(chunk(index, TEXT_SLOT, None)) for index in range(len(job.choices))]

            async def events() -> AsyncIterator[str]:
                async for event in delta_events(job, text_chunks, lambda i, text, final: sse(chunk(i, text, final))):
                    yield event
                if include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                               "choices": [], "usage": job.usage()})
                yield sse("[DONE]")

            return streaming(guarded(job, events()))

        await run_to_end(job)
        choices = []
        for index, choice in enumerate(job.choices):
            traj = _trajectory(choice)
            choices.append({
                "index": index,
                "text": traj.text,
                "logprobs": None,
                "finish_reason": openai_finish_reason(traj.completion_reason),
                "diffulex_completion_reason": traj.completion_reason,
            })
        return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                "choices": choices, "usage": job.usage()}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response | dict[str, Any]:
        check_model(body.model)
        prompt = await encoder.render_chat(body.messages, bool(body.parse_special_tokens))
        job = await start_job(request, [prompt], body, engine_loop.max_model_len, "chatcmpl",
                              "commits" if body.stream else "end", "messages")
        cid = job.subs[0].rid
        created = int(time.time())
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(index: int, delta: dict[str, Any], finish: Emission | None) -> dict[str, Any]:
            choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
            if finish is not None:
                traj = finish.update.trajectory
                choice["finish_reason"] = openai_finish_reason(traj.completion_reason)
                choice["diffulex_completion_reason"] = traj.completion_reason
            return {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                    "choices": [choice]}

        if body.stream:
            text_chunks = [EventTemplate(chunk(index, {"content": TEXT_SLOT}, None))
                           for index in range(len(job.choices))]

            async def events() -> AsyncIterator[str]:
                for index in range(len(job.choices)):
                    yield sse(chunk(index, {"role": "assistant", "content": ""}, None))
                async for event in delta_events(job, text_chunks, lambda i, text, final: sse(
                        chunk(i, {"content": text} if text else {}, final))):  # fmt: skip
                    yield event
                if include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                               "choices": [], "usage": job.usage()})
                yield sse("[DONE]")

            return streaming(guarded(job, events()))

        await run_to_end(job)
        choices = []
        for index, choice in enumerate(job.choices):
            traj = _trajectory(choice)
            choices.append({
                "index": index,
                "message": {"role": "assistant", "content": traj.text},
                "logprobs": None,
                "finish_reason": openai_finish_reason(traj.completion_reason),
                "diffulex_completion_reason": traj.completion_reason,
            })
        return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": choices, "usage": job.usage()}

    # ----- the native route ------------------------------------------------------------------------------

    @app.post("/generate", response_model=None)
    async def generate(body: GenerateRequest, request: Request) -> Response | dict[str, Any]:
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "exactly one of prompt or messages must be given", param="prompt")
        if body.num_choices != 1:
            raise APIError(400, f"n={body.n} is invalid on /generate: it answers one completion, so n must be 1 or "
                           "null (several choices: /v1/completions or /v1/chat/completions)", param="n")
        if body.messages is not None:
            prompt = await encoder.render_chat(body.messages, bool(body.parse_special_tokens))
        else:
            prompt = body.prompt
        if not body.stream:
            interest: Interest = "end"
        else:
            interest = "commits" if body.stream_mode == "block_append" else "steps"
        job = await start_job(request, [prompt], body, 512, "gen", interest,
                              "prompt" if body.messages is None else "messages")
        rid = job.subs[0].rid
        choice = job.choices[0]

        def final_payload() -> dict[str, Any]:
            traj = _trajectory(choice)
            return {
                "id": rid,
                "text": traj.text,
                "token_ids": traj.token_ids,
                "finish_reason": openai_finish_reason(traj.completion_reason),
                "diffulex_completion_reason": traj.completion_reason,
                "nfe": traj.nfe,
                "tpf": traj.tpf,
                "usage": job.usage(),
            }

        if not body.stream:
            await run_to_end(job)
            return final_payload()

        if body.stream_mode == "block_append":  # None: the default, denoise
            async def events() -> AsyncIterator[str]:
                async for _, text, final in _text_deltas(job):
                    if final is not None:
                        if text:
                            yield sse({"event": "append", "id": rid, "text": text, "nfe": choice.nfe})
                        yield sse({"event": "final", **final_payload()})
                    elif text:
                        note_first_text(job, choice)
                        yield sse({"event": "append", "id": rid, "text": text, "nfe": choice.nfe})
                yield sse("[DONE]")
        else:
            view = DenoiseView(tokenizer, engine_loop.mask_token_id, engine_loop.block_size, choice.prompt_len,
                               choice.params.max_tokens)

            async def events() -> AsyncIterator[str]:
                while not job.done:
                    emission = await job.next()
                    if emission is _DISCONNECTED:
                        return
                    if (error := _end_error(emission)) is not None:
                        raise error
                    update = emission.update
                    if update.record is not None and not update.finished:
                        note_first_text(job, choice)
                        yield sse({**view.snapshot(update), "id": rid, "nfe": choice.nfe})
                    if update.finished:
                        yield sse({"event": "final", **final_payload()})
                yield sse("[DONE]")

        return streaming(guarded(job, events()))

    # ----- operations ------------------------------------------------------------------------------------

    @app.get("/health", response_model=None)
    async def health() -> JSONResponse:
        state = engine_loop.state()
        if engine_loop.failure:
            status = "failed"
        elif not engine_loop.running:
            status = "stopped"
        else:
            status = "draining" if engine_loop.draining else "ok"
        code = 200 if status == "ok" else 503  # load balancers stop sending to anything else
        return JSONResponse({"status": status, "model": model_name, "error": engine_loop.failure, **state},
                            status_code=code)

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", media_type="text/html")

    @app.get("/page-config", include_in_schema=False)
    async def page_config() -> dict[str, Any]:
        """What the page needs to know: the model, block size, and the longest answer it may ask for."""
        return {"model": model_name, "block_size": engine_loop.block_size, "max_model_len": engine_loop.max_model_len}

    return app


def _is_type_tag(part: str) -> bool:
    """Whether a location part names a member of a union (``str``, ``list[int]``, a model) rather than a field."""
    return part in ("str", "int", "float", "bool", "dict", "list") or "[" in part or part[:1].isupper()


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """A request-validation failure as ``(message, param)``: the field the client sent, its value, what is allowed.

    A field whose type is a union (``stop``: a string or a list of strings) fails once per member, each error
    under a location naming the member (``stop.str``, ``stop.list[str].1``); reporting only the first would tell
    a client who sent ``["a", 1]`` that ``stop`` must be a string. Such a field's message lists every member.
    """
    first = errors[0] if errors else {}
    locs = [[str(p) for p in e.get("loc", ()) if p != "body"] for e in errors]
    loc = locs[0] if locs else []
    param = loc[0] if loc else None
    for depth, part in enumerate(loc):
        if not _is_type_tag(part):
            continue
        members = list(dict.fromkeys(other[depth] for other in locs if len(other) > depth and
                                     other[:depth] == loc[:depth]))  # fmt: skip
        if len(members) > 1 and all(_is_type_tag(m) for m in members):
            where = ".".join(loc[:depth]) or "body"
            # the value as sent: the input of a member that refused it whole (not one of its items)
            sent = next((e.get("input") for e, other in zip(errors, locs, strict=True)
                         if len(other) == depth + 1 and other[:depth] == loc[:depth]), first.get("input"))
            shown = json.dumps(sent, default=str)[:100]
            return f"{where}: must be {' or '.join(members)} (got {shown})", param
    where = ".".join(loc) or "body"
    message = f"{where}: {first.get('msg', 'invalid value')}"
    if "input" in first and first.get("type") != "missing":
        message += f" (got {json.dumps(first['input'], default=str)[:100]})"
    return message, param


def _completion_prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """OpenAI's four prompt forms -> a list of prompts (text or token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


async def _text_deltas(job: _Job) -> AsyncIterator[tuple[int, str, Emission | None]]:
    """``(choice index, new committed text, final emission or None)`` until every choice has finished."""
    while not job.done:
        emission = await job.next()
        if emission is _DISCONNECTED:
            return
        if (error := _end_error(emission)) is not None:
            raise error
        choice = job.choices[emission.index]
        update = emission.update
        if update.finished:
            yield emission.index, choice.text.finish(update.trajectory.text), emission
        else:
            delta = choice.text.update(update.committed_token_ids)
            if delta:
                yield emission.index, delta, None


"""The engine: builds the strategy's components from a Config and drives the step loop.

One step = the scheduler picks the batch and advances running sets -> the model runner does one forward and
samples -> each request applies its tokens, commits blocks, and is checked for completion. With
``async_scheduling`` a step whose successor has known rows gets that successor queued before its result is read
(`diffulex.engine.continuation`).
"""

from __future__ import annotations

import atexit
import gc
import logging
import threading
import time
import weakref
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from diffulex.config import Config
from diffulex.engine.assembly import assemble
from diffulex.engine.build_phases import BuildPhases
from diffulex.engine.continuation import ContinuationRefusal
from diffulex.engine.engine_load import EngineLoad
from diffulex.engine.generation_inputs import check_prompt
from diffulex.engine.offline import generate_offline
from diffulex.engine.request_update import RequestUpdate
from diffulex.engine.step_broadcast import MessageKind, StepMessage
from diffulex.engine.step_profiler import StepProfiler
from diffulex.engine.tensor_parallel import DEATH_WAIT_S
from diffulex.errors import EngineClosedError, EngineDeadError, RequestFailure
from diffulex.outputs import GenerationOutputs, Trajectory
from diffulex.prompts import Prompt, encode_prompt_values
from diffulex.sampler.rows import PendingWrites
from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import BlockStatus
from diffulex.strategy.request import CompletionReason, Request, RequestStatus, StepRecord
from diffulex.validation import check_int

logger = logging.getLogger("diffulex")

# The build's garbage is all in the youngest generation (the collector is paused while it is built): collecting
# that one before freezing frees it without rescanning every object the process holds (a full collection there
# took 0.4-0.6 s of the built-in model's build on a busy 2-core machine; older garbage, if any, is frozen too).
GC_BUILD_GENERATION = 0

# A request's view of a step: its query range and the indices of its running blocks.
StepView = tuple[tuple[int, int], tuple[int, ...]]


@dataclass
class _InFlightStep:
    """A launched step whose result the host has not applied yet."""

    batch: list[Request]
    views: list[StepView]  # per request
    # per request: its query range as the launch left it, which a continuation starts from: the view's, unless the
    # launch itself moved it (a strategy's own runner that encodes context before its rows: DiffusionGemma's canvas)
    launched_ranges: list[tuple[int, int]]
    pending: PendingWrites
    started: float  # perf_counter() at scheduling
    continuation: bool = False  # launched before the previous step's result (`diffulex.engine.continuation`)
    # a continuation that only stores decoded blocks samples nothing: the host applies it without waiting for it
    result_known: bool = False


@dataclass
class _AppliedStep:
    """A step whose result is applied to its requests, not yet reported (`DiffulexEngine.step`)."""

    index: int
    step_time: float  # seconds from scheduling to the applied result
    # per request: its view at launch (query range, running block indices) and how many masks it filled
    requests: list[tuple[Request, StepView, int]] = field(default_factory=list)


class DiffulexEngine:
    """Offline and online generation over one model replica."""

    def __init__(self, config: Config, build: BuildPhases | None = None) -> None:
        """`build` is the clock ``Diffulex(...)`` started before its imports and the config (so that the logged
        phases cover the whole call); a new one when the engine is built from a config directly."""
        self.config = config
        build = BuildPhases() if build is None else build
        # first, so that a profiler directory that cannot be created fails the build before the model loads
        self._profiler = StepProfiler(config.profiler_config) if config.profiler_config.enabled else None
        if self._profiler is not None:  # an engine never exited still writes its trace (at collection or exit)
            weakref.finalize(self, self._profiler.close)
        parts = assemble(config, build)
        self.device, self.dtype, self.tokenizer, self.model = parts.device, parts.dtype, parts.tokenizer, parts.model
        self.mask_token_id, self.vocab_limit, self.settings = parts.mask_token_id, parts.vocab_limit, parts.settings
        self.runner, self.scheduler, self.request_cls = parts.runner, parts.scheduler, parts.request_cls
        self.policy = parts.policy
        self.workers = parts.workers  # the other tensor-parallel ranks (None at one rank)
        if self.workers is not None:  # an engine never exited still ends its workers (at collection or exit)
            weakref.finalize(self, self.workers.shutdown)
        self._next_req_id = 0
        self._num_steps = 0
        self._num_launches = 0
        self._in_flight: deque[_InFlightStep] = deque()
        self.num_continuations = 0  # steps launched before their predecessor's result (statistics)
        self.num_dropped_continuations = 0  # of those, steps the host found it would not have launched
        self.num_continued_steps = 0  # applied steps that were continuations (not dropped, some request left)
        self.device_wait_s = 0.0  # seconds `_apply` waited for the device's results (`EngineLoad.device_wait_s`)
        self.num_opened_blocks = 0  # blocks a continuation opened on the device (statistics)
        # steps the host launched itself although continuations are on, by reason (statistics)
        self.refused_continuations: Counter[ContinuationRefusal] = Counter()
        # continuations launched while a request could have been admitted, since the host last scheduled
        self._admission_deferrals = 0
        self._closed = False
        self._generate_lock = threading.Lock()
        self._dead: str | None = None  # why the device stopped working, once it has
        self._launching: list[Request] = []  # the batch whose launch is under way (for a failure inside it)
        self._applying: _InFlightStep | None = None  # the step whose result is being applied (likewise)
        # Everything built so far (model, tokenizer tables, graphs) lives as long as the engine: move it out of
        # the collector's reach, or every full collection during generation rescans it (tens of ms per pause).
        gc.collect(GC_BUILD_GENERATION)
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once per process, however many engines
        atexit.register(gc.unfreeze)  # let interpreter shutdown free them (extension modules report leaks)
        build.done("freezing the build's objects")
        self.build_seconds = dict(build.seconds)  # where the build's time went, phase by phase
        logger.info(build.summary())

    def enable_static_decode(self, capture: bool) -> None:
        """Serve decode steps from the graphs' padded static buffers (`GraphPolicy.enable_static_decode`); CPU
        tests run that path with ``capture=False``."""
        if self.workers is not None:
            self.workers.send(StepMessage(MessageKind.STATIC_DECODE, capture=capture))
        self.policy.enable_static_decode(self.runner, self.config, capture)
        self.scheduler.limits.prefill_chunk_rows = self.policy.graph_path_chunk_rows  # chunks beside decoders fit them

    # ----- requests -----------------------------------------------------------------------------------------

    def _encode(self, prompt: Prompt) -> tuple[list[int], np.ndarray | None]:
        """The prompt's ids and, for token ids, their int64 values (`encode_prompt_values`)."""
        ids, values = encode_prompt_values(
            self.tokenizer, prompt, mask_token_id=self.mask_token_id, vocab_size=self.vocab_limit,
            max_model_len=self.config.max_model_len,
        )  # fmt: skip
        if len(ids) >= self.config.max_model_len:
            raise ValueError(
                f"prompt of {len(ids)} tokens is invalid: must be shorter than max_model_len="
                f"{self.config.max_model_len} so that at least one token can be generated"
            )
        return ids, values

    def add_request(self, prompt: str | Sequence[int], sampling_params: SamplingParams | None = None) -> int:
        """Queue one request; returns its id. Raises ValueError for bad input without touching engine state."""
        self._check_open()
        if not (isinstance(prompt, list | tuple) and prompt):  # token ids: `_encode` checks each, in one pass
            check_prompt(prompt)
        sp = sampling_params if sampling_params is not None else SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise ValueError(f"sampling_params={sp!r} is invalid: must be a SamplingParams")
        ids, values = self._encode(prompt)
        req = self.request_cls(self._next_req_id, ids, sp, self.settings)
        if values is not None:  # the check's conversion: a long prompt's rows and page hashes read it
            req.adopt_prompt_array(values)
        kv = self.scheduler.kv_cache
        needed = kv.pages_for(req.max_stored_len)
        if needed > kv.num_pages:
            raise ValueError(
                f"request needs up to {needed} KV pages but the pool has {kv.num_pages}; raise num_pages or lower "
                "max_tokens"
            )
        self._next_req_id += 1
        self.scheduler.add(req)
        return req.req_id

    def abort_request(self, req_id: int) -> bool:
        """Stop a waiting or running request now and free its pages; False if it is unknown or finished. The
        caller asked for the end, so `step` reports nothing more for it."""
        check_int("req_id", req_id)
        return self.scheduler.abort(req_id) is not None

    def is_finished(self) -> bool:
        return not self.scheduler.has_unfinished()

    def step(self) -> list[RequestUpdate]:
        """Run one forward over the scheduled requests and advance them.

        The call waits for the oldest launched step, applies its result, launches the next step, and only then
        builds the returned updates and step records: the GPU computes the next step while the host reports this
        one. So when a call returns, the next step is usually already in flight; a request added now joins the
        step after it, and one aborted now has the in-flight step's result dropped.

        With ``micro_batches=2`` the running requests form two micro-batches that take turns: one is in flight
        while the host finishes, schedules and collects the other. Each request sees exactly the steps it would
        see alone; only the interleaving with other requests changes.

        A failure inside the step finishes the requests it can be traced to (a `RequestFailure` names them, else
        every request of the failed step) with ``CompletionReason.ERROR`` and the error in their trajectory; the
        other requests go on, and so does the engine. Only a device that no longer works raises
        (`EngineDeadError`): nothing can be served on it any more.
        """
        self._check_open()
        if self._profiler is not None:
            self._profiler.before_step()
        applied: _AppliedStep | None = None
        try:
            self._launch_until_full()
            if not self._in_flight:
                if self.scheduler.waiting:
                    raise RequestFailure(
                        [req.req_id for req in self.scheduler.waiting],
                        "no request could be scheduled although requests are waiting",
                    )
                return []
            self._maybe_continue()
            self._applying = self._in_flight.popleft()
            applied = self._apply(self._applying)
            self._applying = None
            self._check_continuation()
            self._launch_until_full()
            updates = self._report(applied)
        except Exception as err:  # noqa: BLE001  (any failure of a step is contained, see the docstring)
            return self._recover(err, applied)
        except BaseException as err:  # an interrupt (Ctrl-C) ends the call: see `_interrupted`
            self._interrupted(err)
            raise
        if self._profiler is not None:
            self._profiler.after_step()
        return updates

    def _check_open(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine cannot serve any more: its device failed ({self._dead})")
        if self._closed:
            raise EngineClosedError("the engine has been shut down (exit() was called); build a new Diffulex engine")

    def _recover(self, err: Exception, applied: _AppliedStep | None) -> list[RequestUpdate]:
        """Contain a failed step: finish the requests it is traced to with the error, drop every launched step
        (a continuation's inputs come from the failed one, and a dropped step's rows are launched again when its
        requests are next scheduled, as for a dropped continuation), and report what was applied before the
        failure, so that no finished request goes unreported."""
        death = self._dead_worker(err)
        if death is not None or not self._device_works():
            self._dead = death or f"{type(err).__name__}: {err}"
            logger.error("the device failed; the engine stops serving", exc_info=err)
            raise EngineDeadError(f"the engine cannot serve any more: its device failed ({self._dead})") from err
        if isinstance(err, RequestFailure):
            queued = {req.req_id: req for req in (*self.scheduler.running, *self.scheduler.waiting)}
            victims = [queued[rid] for rid in err.req_ids if rid in queued]
            message = f"{err}"
        else:  # the batch of the step that failed: being launched, being applied, applied, else all in flight
            if self._launching:
                victims = list(self._launching)
            elif self._applying is not None:
                victims = list(self._applying.batch)
            elif applied is not None:
                victims = [req for req, _, _ in applied.requests]
            else:
                victims = [req for step in self._in_flight for req in step.batch]
            message = f"the engine step failed: {type(err).__name__}: {err}"
        logger.error("a step failed; %d request(s) finish with an error: %s", len(victims), message, exc_info=err)
        self._in_flight.clear()
        self._applying, self._launching = None, []
        self.runner.forget_launches()
        updates = self._safe_report(applied) if applied is not None else []
        reported = {update.req_id for update in updates}
        for req in victims:
            if req.is_finished:
                continue
            self.scheduler.finish(req, CompletionReason.ERROR)
            req.error = message
            trajectory = self._trajectory(req)
            if req.req_id in reported:  # it advanced in the applied step: replace that update with the failure
                updates = [u for u in updates if u.req_id != req.req_id]
            updates.append(RequestUpdate.of_request(req, None, trajectory))
        return updates

    def _safe_report(self, applied: _AppliedStep) -> list[RequestUpdate]:
        try:
            return self._report(applied)
        except Exception:  # noqa: BLE001  (a report that failed once fails again: its requests are failed)
            logger.exception("reporting the applied step failed")
            return []

    def _interrupted(self, err: BaseException) -> None:
        """An interrupt inside a step (Ctrl-C, `SystemExit`) ends the call; the engine serves on, unless it came
        after the step's inputs went to the tensor-parallel workers and before rank 0 joined the step's collectives:
        the workers then wait in a collective rank 0 never joins, and its next step's collectives would pair with
        theirs (a hang until ``distributed_timeout_seconds``, or another step's data). Then the workers are ended and
        the engine is dead: every later call raises `EngineDeadError` at once."""
        if self.workers is None or not getattr(self.runner, "out_of_step", False):
            return
        self._dead = (
            f"a step was interrupted on rank 0 ({type(err).__name__}) after its inputs went to the tensor-parallel "
            "workers; the ranks are out of step"
        )
        logger.error("the engine stops serving: %s", self._dead)
        self.workers.kill()

    def _dead_worker(self, err: Exception) -> str | None:
        """Why the tensor-parallel ranks cannot go on, if they cannot: a worker died (a failure that is not the
        request's own may be its rank leaving a collective, so its death is given a moment to be seen), or rank
        0's launch failed after the workers received its step, leaving them inside a collective (then they are
        ended)."""
        if self.workers is None:
            return None
        death = self.workers.dead(0.0 if isinstance(err, (RequestFailure, ValueError)) else DEATH_WAIT_S)
        if death is None and getattr(self.runner, "out_of_step", False):
            death = (
                f"a step failed on rank 0 after its inputs went to the tensor-parallel workers "
                f"({type(err).__name__}: {err}); the ranks are out of step"
            )
            self.workers.kill()
        return death

    def _device_works(self) -> bool:
        """Whether the device still runs work: a CUDA error that poisons the context fails every later call."""
        if self.device.type != "cuda":
            return True
        try:
            torch.cuda.synchronize(self.device)
            torch.zeros(1, device=self.device).add_(1).item()
        except Exception:  # noqa: BLE001
            return False
        return True

    def _launch_until_full(self) -> None:
        """Launch steps until ``micro_batches`` are in flight or nothing more can be scheduled."""
        while len(self._in_flight) < self.config.micro_batches:
            launched = self._launch()
            if launched is None:
                return
            self._in_flight.append(launched)

    def _launch(self) -> _InFlightStep | None:
        """Schedule the next (micro-)batch among the requests not in flight and queue its forward and sampler."""
        t0 = time.perf_counter()
        scheduler = self.scheduler
        busy = {req.req_id for step in self._in_flight for req in step.batch}
        active = len(scheduler.running) + len(scheduler.waiting)
        batch = scheduler.schedule(busy, max_reqs=-(-active // self.config.micro_batches))
        self._admission_deferrals = 0  # what could be admitted was, by this schedule
        if not batch:
            return None
        # the forward's view of each request, for its step record: its query range and its running set (none in a
        # prefill chunk, which computes prompt blocks only)
        views = [
            (req.query_range(), () if req.prefill_chunk_end is not None else tuple(b.index for b in req.running))
            for req in batch
        ]
        self._launching = batch
        pending = self.runner.launch(batch, self._num_launches % self.policy.staging_buffers)
        self._launching = []
        self._num_launches += 1
        return _InFlightStep(batch, views, [req.query_range() for req in batch], pending, t0)

    def _maybe_continue(self) -> None:
        """Queue the successor of the step in flight before reading its result, when its rows are known already
        (`diffulex.engine.continuation`), else count why not (`ContinuationRefusal`)."""
        if len(self._in_flight) != 1 or not self.policy.continues:
            return
        opened: list[int] = []
        views = self._continued_views(opened)
        if isinstance(views, ContinuationRefusal):
            self.refused_continuations[views] += 1
            return
        newest = self._in_flight[-1]
        t0 = time.perf_counter()
        pending = self.runner.launch_continuation(self._num_launches % self.policy.staging_buffers, opened)
        self._num_launches += 1
        self.num_continuations += 1
        self.num_opened_blocks += len(opened)
        ranges = [query for query, _ in views]
        self._in_flight.append(_InFlightStep(newest.batch, views, ranges, pending, t0, continuation=True))

    def _continued_views(self, opened: list[int]) -> list[StepView] | ContinuationRefusal:
        """Each request's view of the continuation of the step in flight (appending to ``opened`` the requests
        whose next block the device opens), or why there is none. There is one when nobody waits for admission
        who could be admitted (`Scheduler.admits_waiting`: one whose pages are not free waits for the host's next
        step anyway; with every request slot taken, a request that finishes in the step in flight frees
        its slot for the step after the continuation: what waits is admitted one step later, and a saturated engine
        keeps continuing) or it has waited fewer continuations than ``admission_delay_steps`` allows, every running
        request takes part (one that finished since rides along), and each computes
        the same rows next step whatever this step accepts (`Request.next_query_range`: an admitted prompt's prefix
        run in a prefill graph of its own is cached by then), or its running blocks one block further on where this
        step stores its leading block and the device can move them (`Request.next_step_opens_block`)."""
        if not self.runner.can_continue:
            return ContinuationRefusal.NO_PAGE if self.runner.missing_pages else ContinuationRefusal.NOT_GRAPHED
        newest, scheduler = self._in_flight[-1], self.scheduler
        if scheduler.admits_waiting():
            if self._admission_deferrals >= self.config.admission_delay_steps:
                return ContinuationRefusal.ADMISSION
            self._admission_deferrals += 1  # counted even if the continuation is refused below: a host step resets it
        if len(scheduler.running) != sum(not req.is_finished for req in newest.batch):
            return ContinuationRefusal.RUNNING_SET
        views: list[StepView] = []
        for req, (_, blocks), launched in zip(newest.batch, newest.views, newest.launched_ranges, strict=True):
            if req.is_finished:  # since its launch: its rows ride along, their result is never read
                views.append((launched, blocks))
                continue
            if req.query_range() != launched:
                return ContinuationRefusal.REQUEST_CHANGED
            if not self.runner.continues_rows(req):
                return ContinuationRefusal.PREFILL_IN_STEP
            if req.next_step_has_same_rows():
                views.append((req.next_query_range(), blocks))
            elif not req.next_step_opens_block():
                return ContinuationRefusal.ROWS_CHANGE
            elif not self.runner.opens_block_on_device(req):
                return ContinuationRefusal.HOST_OPENS_BLOCK
            else:
                size, (start, end) = req.settings.block_size, req.next_query_range()
                if req.block_joins_past_running_set():
                    views.append(((start + size, end + size), (*blocks[1:], blocks[-1] + 1)))
                else:  # its running set drains: the device's placeholder block after it is none of the host's
                    views.append(((start + size, end), blocks[1:]))
                opened.append(req.req_id)
        return views

    def _check_continuation(self) -> None:
        """Now that its predecessor's result is applied, check the continuation in flight against the step the
        host would launch itself, request by request; drop it if one differs (its result is never read, and what
        it stored is stored again by the step launched instead). A continuation that only stores decoded blocks
        samples nothing, so its result is known: the next call applies it at once and launches the step after it
        without waiting for the device.

        A continuation computes the predecessor's rows, samples the positions of its layout that are still masks,
        and stores a block once none is left where the request says the next step would (`Request.continued_rows`;
        an edit step samples all of them and stores nothing). The host's next step computes its
        `Request.query_range`, samples its `Request.sample_targets` and stores a block that became ``TO_CACHE``.
        They differ when a stop token in the middle of the block moved the decoding limit, or a strategy's next
        forward is another one (Fast-dLLM v2's sub-block completed, an edit block finished). A continuation whose
        requests have all finished is dropped too.
        """
        if not self._in_flight or not self._in_flight[0].continuation:
            return
        launched = self._in_flight[0]
        if all(req.is_finished for req in launched.batch):  # nothing left to apply it to
            self._in_flight.popleft()
            return
        pending = launched.pending
        left: dict[int, list[int]] = {}
        for owner, position in zip(pending.owners or (), pending.positions or (), strict=True):
            left.setdefault(owner, []).append(position)
        stores_only = True
        for req, (query, _) in zip(launched.batch, launched.views, strict=True):
            if req.is_finished:
                continue
            # a block joins the running set where the next schedule would add one (after a stored block, or once
            # the newest block is far enough along): the rows differ then, unless the device opened that block
            req.maybe_activate_block()
            device_rows, device_stores = req.continued_rows(left.get(req.req_id, []))
            host_rows = [p for target in req.sample_targets() for p in target.positions]
            stores = sum(block.status is BlockStatus.TO_CACHE for block in req.running)
            if req.query_range() != query or device_rows != host_rows or stores != device_stores:
                self._in_flight.popleft()
                self.num_dropped_continuations += 1
                logger.debug("dropped a continuation step: request %d differs from the host's next step", req.req_id)
                return
            stores_only &= stores > 0 and not host_rows
        launched.result_known = stores_only

    def _apply(self, launched: _InFlightStep) -> _AppliedStep:
        """Wait for a launched step's result and apply it to its requests: everything the next schedule reads.

        A request aborted while its step was in flight is skipped: nothing of that step is applied to it.
        """
        waited_from = time.perf_counter()
        writes = launched.pending.writes if launched.result_known else launched.pending.result()
        self.device_wait_s += time.perf_counter() - waited_from
        applied = _AppliedStep(self._num_steps, time.perf_counter() - launched.started)
        self.num_continued_steps += launched.continuation
        for req, view in zip(launched.batch, launched.views, strict=True):
            if req.is_finished:
                continue
            filled = self.scheduler.finish_step(req, writes[req.req_id])
            if req.sampling_params.stop:
                self._check_stop_strings(req)
            applied.requests.append((req, view, filled))
        self._num_steps += 1
        return applied

    def _report(self, applied: _AppliedStep) -> list[RequestUpdate]:
        """The step records and updates of an applied step.

        Built after the next step's launch, which may open blocks (masks appended after every decoded position)
        or preempt (cached blocks stay committed): neither moves a bound the record or the update takes, the
        first mask, the committed end, or the tokens of the step's own query range.
        """
        updates = []
        for req, ((start, end), ids), filled in applied.requests:
            lo = req.blocks[ids[0]].start if ids else end
            record = StepRecord(applied.index, end - start, filled, ids, tuple(req.token_ids[lo:end]))
            record.step_time = applied.step_time
            record.running_start = lo
            req.steps.append(record)
            trajectory = self._trajectory(req) if req.is_finished else None
            updates.append(RequestUpdate.of_request(req, record, trajectory))
        return updates

    def _check_stop_strings(self, req: Request) -> None:
        """Finish a running request whose settled answer (`Request.settled_answer_end`: in edit mode a decoded
        token may still be rewritten) contains one of its stop strings. A request this step finished otherwise (its
        end token, its length) is checked too, its whole answer final now: the tokens of its last step may hold a
        stop string, which then is its reason, and its answer is cut there (`_answer`)."""
        if req.is_finished:
            if req.completion_reason in (CompletionReason.ABORTED, CompletionReason.ERROR):
                return
            ids = req.answer_token_ids()
        else:
            ids = req.token_ids[req.prompt_len : req.settled_answer_end]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if not any(stop in text for stop in req.sampling_params.stop):
            return
        if req.is_finished:
            req.completion_reason = CompletionReason.STOP_STRING
        else:
            self.scheduler.finish(req, CompletionReason.STOP_STRING)

    def _answer(self, req: Request) -> tuple[list[int], str]:
        """The final answer; with a stop string, cut before its first occurrence (text and tokens)."""
        ids = req.answer_token_ids()
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if req.completion_reason is CompletionReason.STOP_STRING:
            text = text[: min(i for i in (text.find(s) for s in req.sampling_params.stop) if i >= 0)]
            # Keep the shortest token prefix whose text covers what remains of the answer.
            keep = next(
                k for k in range(len(ids) + 1)
                if len(self.tokenizer.decode(ids[:k], skip_special_tokens=True)) >= len(text)
            )
            ids = ids[:keep]
        return ids, text

    def _trajectory(self, req: Request, index: int = -1) -> Trajectory:
        answer, text = self._answer(req)
        return Trajectory(
            index=index,
            req_id=req.req_id,
            prompt_token_ids=req.prompt_token_ids,
            token_ids=answer,
            text=text,
            completion_reason=req.completion_reason.value if req.completion_reason else None,
            nfe=req.nfe,
            steps=req.steps,
            num_preemptions=req.num_preemptions,
            error=req.error,
        )

    # ----- offline generation --------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        apply_chat_template: bool = True,
        parse_special_tokens: bool = False,
    ) -> GenerationOutputs:
        """Generate for every prompt (`diffulex.engine.offline.generate_offline`): a rejected prompt gets a
        trajectory with ``error`` set, the rest run. A prompt is text, token ids or a conversation; a chat model's
        template is applied to text unless ``apply_chat_template=False``; special-token text is plain text unless
        ``parse_special_tokens`` (`diffulex.prompts`)."""
        self._check_open()
        with self._generate_lock:  # one call at a time: each steps the engine for its own prompts
            return generate_offline(
                self, prompts, sampling_params, use_tqdm, apply_chat_template=apply_chat_template,
                parse_special_tokens=parse_special_tokens,
            )  # fmt: skip

    @property
    def num_steps(self) -> int:
        """Engine steps run so far."""
        return self._num_steps

    def load(self) -> EngineLoad:
        """Requests running and waiting, KV pages in use, steps run and continued (what the server reports)."""
        scheduler = self.scheduler
        kv = scheduler.kv_cache
        running = sum(1 for r in scheduler.running if r.status is RequestStatus.RUNNING)
        serving = self._dead is None and not self._closed
        return EngineLoad(running, len(scheduler.waiting), kv.num_used_pages, kv.num_pages, alive=serving,
                          steps=self._num_steps,
                          continued_steps=self.num_continued_steps,
                          refused_continuations={str(k): v for k, v in self.refused_continuations.items()},
                          dropped_continuations=self.num_dropped_continuations,
                          device_wait_s=self.device_wait_s)

    # ----- lifetime ------------------------------------------------------------------------------------------

    def exit(self) -> None:
        """Abort what is left and release the KV cache. Safe to call twice."""
        if self._closed:
            return
        while self._in_flight:  # the device may still write into the cache these steps were given
            try:
                self._in_flight.popleft().pending.result()
            except Exception:  # noqa: BLE001  (shutting down: a failed step's result is not needed)
                logger.exception("a step in flight failed during exit()")
        for queue in (self.scheduler.waiting, self.scheduler.running):
            for req in list(queue):
                self.scheduler.finish(req, CompletionReason.ABORTED)
        self.runner.release_kv_cache()
        if self.workers is not None:
            self.workers.shutdown()
        if getattr(self, "_profiler", None) is not None:
            self._profiler.close()
        self._closed = True

    def __enter__(self) -> DiffulexEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.exit()

"""Offline generation over anything with the engine's step interface: one engine, or data-parallel replicas.

`generate_offline` queues every prompt (a rejected one gets a trajectory with ``error`` set, the others run), then
steps until each has finished, with a progress bar, and returns the trajectories in prompt order. The engine
needs ``tokenizer``, ``mask_token_id``, ``vocab_limit``, ``add_request(ids, params)``, ``abort_request(req_id)``,
``step()``, ``is_finished()`` and ``num_steps``. An error other than a rejected prompt (or an interrupt) aborts what
the call queued.

A call steps the engine until its own prompts finish and keeps only their updates, so it needs the engine to itself:
it refuses to start while requests queued through ``add_request`` are unfinished (their results would be consumed
and lost), and the engines let one call run at a time (a second thread's call waits for the first).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from diffulex.engine.generation_inputs import generation_inputs
from diffulex.outputs import GenerationOutputs, Trajectory
from diffulex.prompts import Prompt, encode_prompt
from diffulex.sampling_params import SamplingParams
from diffulex.validation import check_bool

logger = logging.getLogger("diffulex")


def generate_offline(
    engine: Any,
    prompts: Prompt | Sequence[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    use_tqdm: bool = True,
    *,
    apply_chat_template: bool = True,
    parse_special_tokens: bool = False,
) -> GenerationOutputs:
    """A chat model (its tokenizer has a chat template) is asked the way it was trained: a text prompt becomes the
    user message of its chat template; ``apply_chat_template=False`` sends text as it is. Special-token text inside
    text and messages (``<|im_end|>``) is plain text unless ``parse_special_tokens``: see `diffulex.prompts`."""
    check_bool("apply_chat_template", apply_chat_template)
    check_bool("parse_special_tokens", parse_special_tokens)  # "false" would let special-token text act as tokens
    prompts, params = generation_inputs(prompts, sampling_params)
    if not engine.is_finished():
        raise RuntimeError(
            "generate() steps the engine until its own prompts finish and would consume the results of the requests "
            "already queued with add_request(): step() them to completion or abort_request() them first"
        )
    t0 = time.perf_counter()
    results: list[Trajectory | None] = [None] * len(prompts)
    index_of: dict[int, int] = {}
    bar = None
    try:
        for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            try:
                ids = encode_prompt(
                    engine.tokenizer, prompt, mask_token_id=engine.mask_token_id, vocab_size=engine.vocab_limit,
                    apply_chat_template=apply_chat_template, parse_special_tokens=parse_special_tokens,
                    max_model_len=engine.config.max_model_len,
                )  # fmt: skip
                index_of[engine.add_request(ids, sp)] = i
            except ValueError as err:
                logger.warning("prompt %d rejected: %s", i, err)
                token_list = isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt)
                ids = list(prompt) if token_list else []
                results[i] = Trajectory(i, -1, ids, [], "", "rejected", 0, error=str(err))
        steps_before = engine.num_steps
        if use_tqdm and index_of:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(index_of), desc="Generating", unit="req", dynamic_ncols=True)
        while index_of and any(results[i] is None for i in index_of.values()):
            for update in engine.step():
                if update.finished and update.req_id in index_of:
                    traj = update.trajectory
                    traj.index = index_of[update.req_id]
                    results[traj.index] = traj
                    if bar is not None:
                        bar.update(1)
            if bar is not None:
                done_tokens = sum(t.num_generated_tokens for t in results if t is not None)
                if done_tokens:  # no rate to show before the first request finishes
                    rate = done_tokens / max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"{rate:.0f} tok/s", refresh=False)
    except BaseException:
        # An unexpected error (or Ctrl-C) ends the call: the requests it queued must not stay in the engine, where
        # the next call would run them unseen and drop their results.
        for req_id, i in index_of.items():
            if results[i] is None:
                with contextlib.suppress(Exception):  # an engine that failed may refuse; its error is the one to see
                    engine.abort_request(req_id)
        raise
    finally:
        if bar is not None:
            bar.close()
    outputs = GenerationOutputs(
        [t for t in results if t is not None], time.perf_counter() - t0, engine.num_steps - steps_before
    )
    logger.info("generate: %s", outputs.summary())
    return outputs

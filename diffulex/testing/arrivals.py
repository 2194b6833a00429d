"""Requests that arrive while others decode: the continuous-batching scenario tests and GPU checks replay."""

from __future__ import annotations

from typing import Any

from diffulex.sampling_params import SamplingParams


def serve_arrivals(
    llm: Any, prompts: list[list[int]], params: SamplingParams, gap: int, max_steps: int = 4000
) -> list[list[int]]:
    """Add one prompt every ``gap`` engine steps (the first at once) and step until every request has finished, so
    that each arrives while the earlier ones decode. Returns the token ids in prompt order; raises when requests are
    still running after ``max_steps`` steps (a stuck scenario)."""
    order: dict[int, int] = {}
    finished: dict[int, list[int]] = {}
    queue = list(prompts)
    for step in range(max_steps):
        if queue and step % gap == 0:
            order[llm.add_request(queue.pop(0), params)] = len(order)
        for update in llm.step():
            if update.finished:
                finished[update.req_id] = update.trajectory.token_ids
        if not queue and len(finished) == len(order):
            return [finished[req_id] for req_id in sorted(order, key=order.get)]
    raise RuntimeError(f"requests still running after {max_steps} steps")

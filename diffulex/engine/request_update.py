"""What one engine step did to one request, as its caller (offline loop, server, chat view) reads it."""

from __future__ import annotations

from typing import Literal

from diffulex.outputs import Trajectory
from diffulex.strategy.request import Request, StepRecord

# What a caller reads of a request's updates, hence which it needs: every step's (a live view of the running
# blocks), those where its committed tokens grew (streamed text), or only its last (a whole answer).
Interest = Literal["steps", "commits", "end"]
INTERESTS = ("steps", "commits", "end")


class RequestUpdate:
    """What one step did to one request; ``trajectory`` is set once the request has finished.

    ``committed_token_ids`` (answer tokens in committed blocks: final, safe to stream) and ``answer_token_ids``
    (the decoded answer prefix so far, up to the first mask) are cut from the request's token list when first
    read, not at every step: decoded positions never change again, so the bounds taken at the step stay valid,
    and a caller that reads neither (offline generation) pays nothing per request and step.
    """

    __slots__ = ("req_id", "record", "finished", "trajectory", "nfe", "_tokens", "_start", "_committed_end",
                 "_answer_end")

    def __init__(
        self,
        req_id: int,
        record: StepRecord | None,
        finished: bool,
        committed_token_ids: list[int],
        answer_token_ids: list[int],
        trajectory: Trajectory | None = None,
    ) -> None:
        if answer_token_ids[: len(committed_token_ids)] != committed_token_ids:
            raise ValueError("committed_token_ids must be a prefix of answer_token_ids")
        self._set(req_id, record, finished, trajectory, answer_token_ids, 0, len(committed_token_ids))

    def _set(
        self,
        req_id: int,
        record: StepRecord | None,
        finished: bool,
        trajectory: Trajectory | None,
        tokens: list[int],
        start: int,
        committed_end: int,
        answer_end: int | None = None,
    ) -> None:
        """The answers are ``tokens[start:answer_end]`` (default: to the end), committed up to ``committed_end``."""
        self.req_id, self.record, self.finished, self.trajectory = req_id, record, finished, trajectory
        # forwards the request has taken part in so far, where the engine reports only some of its steps (a replica
        # sending what its caller reads); None: one per update that has a record
        self.nfe: int | None = None
        self._tokens, self._start = tokens, start
        self._committed_end = committed_end
        self._answer_end = len(tokens) if answer_end is None else answer_end

    @classmethod
    def of_request(cls, req: Request, record: StepRecord, trajectory: Trajectory | None) -> RequestUpdate:
        """The update of a request right after its step (a finished one reports its trajectory's answer)."""
        update = cls.__new__(cls)
        if trajectory is not None:
            answer = trajectory.token_ids
            update._set(req.req_id, record, True, trajectory, answer, 0, len(answer))
            return update
        answer_end = req.answer_end
        committed_end = min(req.committed_len, answer_end)
        update._set(req.req_id, record, False, None, req.token_ids, req.prompt_len, committed_end, answer_end)
        return update

    @classmethod
    def of_answer(
        cls, req_id: int, record: StepRecord | None, answer: list[int], committed_len: int, answer_len: int,
        trajectory: Trajectory | None = None,
    ) -> RequestUpdate:
        """An update over ``answer``, a list its owner only appends to (a data-parallel parent's copy of a request's
        answer, grown from each step's message): the update reads its first ``answer_len`` tokens when asked."""
        update = cls.__new__(cls)
        update._set(req_id, record, trajectory is not None, trajectory, answer, 0, committed_len, answer_len)
        return update

    @property
    def num_committed(self) -> int:
        """``len(committed_token_ids)`` without the copy (the committed end may lie inside the prompt)."""
        return max(self._committed_end - self._start, 0)

    @property
    def num_answer(self) -> int:
        """``len(answer_token_ids)`` without the copy."""
        return max(self._answer_end - self._start, 0)

    def answer_tokens_from(self, offset: int) -> list[int]:
        """The answer's tokens from ``offset`` on, without copying those before (what a replica sends is growth)."""
        return self._tokens[self._start + offset : self._answer_end]

    @property
    def committed_token_ids(self) -> list[int]:
        return self._tokens[self._start : self._committed_end]

    @property
    def answer_token_ids(self) -> list[int]:
        return self._tokens[self._start : self._answer_end]

    def __repr__(self) -> str:
        return (
            f"RequestUpdate(req_id={self.req_id}, finished={self.finished}, record={self.record!r}, "
            f"answer_token_ids={self.answer_token_ids!r})"
        )

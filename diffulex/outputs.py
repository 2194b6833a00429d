"""What `generate` returns: one trajectory per prompt, with per-step records and aggregate metrics.

Metric definitions (also in docs/benchmarks.md):

* generated tokens of a request = its answer tokens, plus the stop token when it ended on one; prompt tokens
  never count;
* NFE of a request = forwards it took part in (its first, prefill forward included: it decodes too);
* TPF = generated tokens / NFE, aggregated over requests as a ratio of sums;
* TPS = generated tokens of all requests / wall time of the call.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from diffulex.strategy.request import StepRecord


@dataclass
class Trajectory:
    index: int  # position of the prompt in the generate() call
    req_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # the answer, without the stop token
    text: str
    completion_reason: str | None
    nfe: int
    steps: list[StepRecord] = field(default_factory=list)
    num_preemptions: int = 0
    error: str | None = None  # set when the prompt was rejected; the other prompts still ran

    @property
    def ended_on_stop_token(self) -> bool:
        return self.completion_reason == "eos_token_generated"

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) + (1 if self.ended_on_stop_token else 0)

    @property
    def tpf(self) -> float:
        return self.num_generated_tokens / self.nfe if self.nfe else 0.0


@dataclass
class GenerationOutputs:
    trajectories: list[Trajectory]
    wall_time: float  # seconds spent in generate()
    num_engine_steps: int

    def __iter__(self) -> Iterator[Trajectory]:
        return iter(self.trajectories)

    def __len__(self) -> int:
        return len(self.trajectories)

    def __getitem__(self, i: int) -> Trajectory:
        return self.trajectories[i]

    @property
    def texts(self) -> list[str]:
        return [t.text for t in self.trajectories]

    @property
    def num_generated_tokens(self) -> int:
        return sum(t.num_generated_tokens for t in self.trajectories)

    @property
    def total_nfe(self) -> int:
        return sum(t.nfe for t in self.trajectories)

    @property
    def nfe(self) -> float:
        """Mean forwards per request."""
        ran = [t for t in self.trajectories if t.error is None]
        return self.total_nfe / len(ran) if ran else 0.0

    @property
    def tpf(self) -> float:
        return self.num_generated_tokens / self.total_nfe if self.total_nfe else 0.0

    @property
    def tps(self) -> float:
        return self.num_generated_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def summary(self) -> str:
        """One line for people (the command line prints it after the answers): counts, speed, TPF, mean NFE."""
        n = len(self.trajectories)
        return (
            f"{n} request{'' if n == 1 else 's'}, {self.num_generated_tokens} tokens in {self.wall_time:.2f} s "
            f"({self.tps:.1f} tok/s), TPF {self.tpf:.2f}, mean NFE {self.nfe:.1f}"
        )

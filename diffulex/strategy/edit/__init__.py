"""Edit decoding (LLaDA2.1): multi-block decoding in which an active block's decoded tokens may still be rewritten.

Reached through ``multi_bd`` with ``sampling_mode="edit"`` (the family must support it: `Family.sampling_modes`).
Requests are `diffulex.strategy.edit.request.EditRequest` (a block commits once the sampler stops changing it), the
rule is `diffulex.strategy.edit.sampler.EditSampler`: greedy steps run it inside the decode graph's sampling graph
(`diffulex.strategy.edit.acceptance`), the others on the host. Greedy steps without a repetition penalty are
continued on the device (`diffulex.engine.continuation`, `advance_edit_inputs`): the next step samples the same
positions, with each block's phase moved on there; the host reads every block's verdict after the step, and drops
the continuation of a step that finished a block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffulex.strategy.edit.request import EditRequest
from diffulex.strategy.edit.sampler import EditSampler, EditSettings
from diffulex.strategy.strategy import SamplerContext, Strategy
from diffulex.validation import check_int, check_number

if TYPE_CHECKING:
    from diffulex.config import Config


# Post-edit steps a block may take at most: LLaDA2.1 uses 16. A block that keeps changing ends only at its timeout
# (block size + this), so an unbounded value would let one request run forever.
MAX_POST_EDIT_STEPS = 1024


@dataclass(frozen=True)
class EditOptions:
    max_post_edit_steps: int = 16  # steps a block may keep editing once it holds no mask
    penalty_lambda: float = 0.0  # lowers the logit of the token at the position before (repetition)

    def __post_init__(self) -> None:
        check_int("max_post_edit_steps", self.max_post_edit_steps, low=0, high=MAX_POST_EDIT_STEPS)
        object.__setattr__(self, "penalty_lambda", check_number("penalty_lambda", self.penalty_lambda, low=0.0))


class EditDecoding(Strategy):
    name = "edit"
    Options = EditOptions
    request_class = EditRequest
    sampling_modes = ("edit",)

    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            self.name = name  # the registered strategy this is the edit mode of

    def continues_steps(self, config: Config) -> bool:
        """At ``buffer_size=1`` (the device rule moves one block's phase on), where the device runs the rule: not
        with a repetition penalty (`EditOptions.penalty_lambda`), whose steps sample on the host."""
        one_block = config.buffer_size == 1
        return super().continues_steps(config) and one_block and config.strategy_options.penalty_lambda == 0

    def edit_settings(self, context: SamplerContext) -> EditSettings:
        options = context.options
        return EditSettings(
            context.vocab_limit, context.mask_token_id, context.accept_threshold, context.edit_threshold,
            options.penalty_lambda, context.base_seed,
        )  # fmt: skip

    def make_sampler(self, context: SamplerContext) -> EditSampler:
        return EditSampler(self.edit_settings(context))

"""DMax: LLaDA2 edit decoding where every decoded token of an active block is refreshed each step and masks are
filled as a left-to-right run of confident positions (`diffulex.strategy.dmax.sampler`); a block commits once a
step changes nothing or everything is confident. With token merge (``token_merge_weight > 0``) decoded positions
enter the next forward as soft inputs (`diffulex.layers.token_merge`; on the CUDA-graph path static graph inputs,
`diffulex.engine.static_soft_inputs`). Greedy steps sample in the decode graph and are continued on the device, as
edit decoding's are (`diffulex.strategy.dmax.acceptance`). Requests are edit-mode requests; attention is
block-causal, so prefix caching defaults to on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diffulex.layers.token_merge import TokenMergeSettings
from diffulex.strategy.dmax.sampler import DMaxSampler
from diffulex.strategy.edit import EditDecoding, EditOptions
from diffulex.strategy.strategy import SamplerContext, register_strategy
from diffulex.validation import check_bool, check_choice, check_int, check_number, invalid_value

if TYPE_CHECKING:
    from diffulex.config import Config

# How the candidates of a soft input are built: the decoded token at its confidence, or the top-k of the position.
TOKEN_MERGE_MODES = ("dmax_topk", "iter_smooth_topk")


# Candidates per position at most: every row of a step keeps this many ids and probabilities (the soft inputs'
# static buffers are [rows, k]), and the candidates past the first few carry almost no probability.
MAX_TOKEN_MERGE_TOP_K = 1024


@dataclass(frozen=True)
class DMaxOptions(EditOptions):
    token_merge_mode: str = "dmax_topk"
    token_merge_top_k: int = 1  # candidates kept per position
    token_merge_renormalize: bool = True  # renormalize the candidates' probabilities after filtering
    token_merge_weight: float = 1.0  # interpolation weight of the soft inputs; 0 turns token merge off
    dmax_sampler_fast_path: bool = True  # a decoded position's confidence counts as 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("token_merge_mode", self.token_merge_mode, TOKEN_MERGE_MODES)
        check_int("token_merge_top_k", self.token_merge_top_k, low=1, high=MAX_TOKEN_MERGE_TOP_K)
        check_bool("token_merge_renormalize", self.token_merge_renormalize)
        weight = check_number("token_merge_weight", self.token_merge_weight, low=0.0)
        object.__setattr__(self, "token_merge_weight", weight)
        check_bool("dmax_sampler_fast_path", self.dmax_sampler_fast_path)


class DMax(EditDecoding):
    name = "dmax"
    Options = DMaxOptions

    def continues_steps(self, config: Config) -> bool:
        """As edit decoding's, where the device writes the soft inputs too: not with ``iter_smooth_topk``, whose
        candidates (each position's top-k) are found on the host."""
        options = config.strategy_options
        merges_on_host = options.token_merge_weight > 0 and options.token_merge_mode != "dmax_topk"
        return super().continues_steps(config) and not merges_on_host

    def make_sampler(self, context: SamplerContext) -> DMaxSampler:
        options = context.options
        if options.token_merge_top_k > context.vocab_limit:  # known once the model is: checked before any request
            raise invalid_value(
                "token_merge_top_k",
                options.token_merge_top_k,
                f"must be <= the model's vocabulary size {context.vocab_limit}",
            )
        settings = dataclasses.replace(
            self.edit_settings(context),
            dmax_fast_path=options.dmax_sampler_fast_path,
            token_merge=self.soft_inputs(options, context.mask_token_id),
        )
        return DMaxSampler(settings)

    def soft_inputs(self, options: DMaxOptions, mask_token_id: int) -> TokenMergeSettings | None:
        if options.token_merge_weight <= 0:
            return None
        return TokenMergeSettings(
            options.token_merge_mode, options.token_merge_top_k, options.token_merge_weight,
            options.token_merge_renormalize, mask_token_id,
        )  # fmt: skip


register_strategy(DMax())

"""What a decoding strategy is to the engine: one object that answers every question the engine has about it.

The engine never branches on a strategy's name. It asks the strategy (resolved once by `diffulex.config.Config`):

* its **options**: a dataclass of the strategy's own settings (`Strategy.Options`), filled from the engine fields of
  the same names and the ``strategy_options`` dict, and validated there;
* its **normalizer**: the settings it cannot work without (attention visibility, prefix caching, sizes);
* its **request class**: the block state of one request (`diffulex.strategy.request.Request` or a subclass);
* its **sampler** for a model family: the acceptance rule, which a strategy may specialise per family;
* what it needs of the runner: the span of its blocks (`Strategy.attention_block_size`), soft inputs
  (`Strategy.soft_inputs`), and which fast paths it supports (CUDA graphs, greedy sampling inside them, continuing
  a step on the device before its predecessor's result is read);
* what its requests need of a forward, asked of the request (`diffulex.strategy.request.Request`): the rows to
  compute (``query_range``), their input tokens, which blocks' K/V to store, cached keys after the rows
  (``keys_end``) and the pages that takes (``stored_len``);
* its **runner**, for a model whose forward is not the engine's block-causal forward over paged K/V
  (`Strategy.make_runner`; DiffusionGemma's encoder and canvas decoder): None, the default, keeps the engine's
  `diffulex.engine.model_runner.ModelRunner` with the strategy's sampler.

Shared machinery stays shared: block state (`diffulex.strategy.request`), proposals, top-1 and drawing
(`diffulex.sampler`), and the scheduler, KV cache manager and runner of `diffulex.engine`. A strategy is one
`register_strategy` call, in the package (`diffulex/strategy/<name>/`) or in a plugin (`diffulex.plugins`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from diffulex.layers.token_merge import TokenMergeSettings
from diffulex.models.family import Family
from diffulex.registry import Registry
from diffulex.sampler.rows import PendingWrites, RowLayout
from diffulex.strategy.request import Request, SampleTarget
from diffulex.validation import force_setting, format_choices, invalid_value, reject_unknown_keys

if TYPE_CHECKING:
    from diffulex.config import Config
    from diffulex.engine.step_broadcast import StepMessage
    from diffulex.engine.tensor_parallel import TensorParallelWorkers

# blocks per request the default short decode graphs hold (`Strategy.short_step_rows`)
SHORT_STEP_BLOCKS = 2
# the fewest requests a default short decode graph holds (`Strategy.short_step_buckets`): below that a step reads
# its weights far longer than it computes its rows (SDAR-1.7B geometry, buffer 4, one request on an H100: 1.85 ms a
# step padded to four blocks, 1.76 ms to two), so the captures would cost the engine's start more than they save
SHORT_STEP_MIN_REQUESTS = 16


class Sampler(Protocol):
    """What the model runner calls on a strategy's sampler (`diffulex.sampler.host.HostSampler` implements it for
    rules decided on the host; `diffulex.strategy.multi_bd.sampler.ConfidenceSampler` also samples in a graph).

    A sampler that samples in a graph has ``greedy_result``; it may also have ``greedy_reads_inputs`` (its greedy
    step compares proposals with the tokens the rows hold), ``result_fields`` (rows its result has beyond the
    accepted flag and the token) and ``continuation_advance`` (its own way to turn a step's inputs into its
    continuation's, soft inputs included): `diffulex.strategy.edit.sampler.EditSampler`,
    `diffulex.strategy.dmax.sampler.DMaxSampler`."""

    def row_layout(self, work: list[tuple[Request, list[SampleTarget]]]) -> RowLayout: ...

    def launch(
        self, logits: torch.Tensor, work: list[tuple[Request, list[SampleTarget]]], layout: RowLayout | None = None
    ) -> PendingWrites: ...

    def warm_up(self, device: torch.device, dtype: torch.dtype, vocab_size: int, max_rows: int) -> None: ...


class StepRunner(Protocol):
    """What the engine calls on a runner: `diffulex.engine.model_runner.ModelRunner` implements it for every
    strategy that brings none (`Strategy.make_runner`). ``launch`` runs one step for a batch of requests the
    scheduler formed; its writes are applied by each request's ``apply_tokens`` when the engine applies the step.
    The runner owns the K/V pages: ``page_bytes`` is what one page costs, ``allocate_kv_cache`` allocates the
    number the memory plan chose; the engine's KV cache manager hands them to requests (``Request.page_table``)."""

    can_continue: bool
    missing_pages: bool  # the last launch could be continued but for a block without its page

    def page_bytes(self) -> int: ...

    def allocate_kv_cache(self, num_pages: int) -> None: ...

    def release_kv_cache(self) -> None: ...

    def warm_up_attention(self) -> None: ...

    def warm_up_sampling(self, max_rows: int, dtype: torch.dtype) -> None: ...

    def profile_run(self, num_tokens: int, max_model_len: int, num_sample_rows: int) -> None: ...

    def launch(self, batch: list[Request], micro_batch: int = 0) -> PendingWrites: ...

    def continues_rows(self, req: Request) -> bool: ...

    def opens_block_on_device(self, req: Request) -> bool: ...

    def launch_continuation(self, micro_batch: int, opened: Collection[int] = ()) -> PendingWrites: ...

    def forget_launches(self) -> None: ...

    # Over several ranks (`Strategy.runner_follows_ranks`): the engine sets ``workers`` on rank 0's runner, which
    # tells them each step's device work; each worker's runner repeats it in ``follow_step`` (its collectives meet
    # rank 0's) and returns the hidden states it queued, or None. ``out_of_step`` is True while a launch that
    # tells the workers (from just before its message) has not queued its collectives yet (a failure or an interrupt
    # then leaves them waiting).
    workers: TensorParallelWorkers | None
    out_of_step: bool

    def follow_step(self, message: StepMessage) -> torch.Tensor | None: ...


@dataclass(frozen=True)
class RunnerContext:
    """What a strategy may read when it builds a runner of its own."""

    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    page_size: int
    vocab_limit: int  # ids at or above this are padding rows of the embedding: never proposed
    base_seed: int  # the seed of requests that bring none
    options: Any  # the strategy's options object
    enforce_eager: bool = False  # the user asked for no CUDA graphs


@dataclass(frozen=True)
class NoOptions:
    """The options of a strategy that has no settings of its own."""


@dataclass(frozen=True)
class SamplerContext:
    """What a strategy may read when it builds its sampler."""

    family: Family
    vocab_limit: int  # ids at or above this are padding rows of the embedding: never proposed
    mask_token_id: int
    accept_threshold: float
    edit_threshold: float
    base_seed: int  # the seed of requests that bring none
    options: Any  # the strategy's options object


class Strategy:
    """A decoding strategy. Subclass it, set the class attributes that differ, implement `make_sampler`."""

    name: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()  # old spellings of the name, accepted with a deprecation warning
    Options: ClassVar[type] = NoOptions  # a dataclass; __post_init__ validates
    # The block state of one request; None for a strategy whose configuration exists but that the engine cannot run.
    request_class: ClassVar[type[Request] | None] = Request
    # The prompt attends to itself bidirectionally (else block-causally, like generated blocks). A prompt page's K/V
    # then depends on later prompt tokens, so prefix caching is off.
    bidirectional_prompt: ClassVar[bool] = False
    requires_prefix_caching: ClassVar[bool] = False  # committed blocks live in shared pages: prefix caching always on
    sampling_modes: ClassVar[tuple[str, ...]] = ("naive",)  # the Config.sampling_mode values it runs with
    families: ClassVar[tuple[str, ...] | None] = None  # the model families it runs (None: every one)
    cuda_graphs: ClassVar[bool] = True  # its decode steps may replay captured CUDA graphs (else every step is eager)
    samples_in_graph: ClassVar[bool] = True  # greedy steps may sample inside the decode CUDA graph
    continues_on_device: ClassVar[bool] = True  # a step may be continued on the device (`engine.continuation`)
    # a request may attend to cached keys after its rows (`Request.keys_end`): its graphs stage the key ends
    attends_past_rows: ClassVar[bool] = False
    # The scheduler admits prompts by token count, so max_num_batched_tokens must hold the longest prompt.
    budgets_prompt_tokens: ClassVar[bool] = True
    # Its own runner (`make_runner`) repeats rank 0's steps on tensor- and expert-parallel workers (`StepRunner`'s
    # ``follow_step``); the engine's runner always does.
    runner_follows_ranks: ClassVar[bool] = False
    # The short graphs' buckets may hold more requests than run at once (`short_step_buckets` is then offered
    # buckets up to those whose short rows equal the full graphs' largest bucket's): for a strategy whose steps'
    # rows vary widely between requests, so that a batch's step often exceeds its requests' short rows but not by
    # the full graphs' padding. It costs captures at the engine's start and a graph pool as large as the full one.
    short_buckets_past_max_requests: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Aliases are other spellings of one name, so a subclass registered under a name of its own does not take
        its parent's: a plugin's ``class MyRule(MultiBD)`` would otherwise claim multi_bd's old names and be refused
        for aliases it never chose."""
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__ and "aliases" not in cls.__dict__:
            cls.aliases = ()

    # ----- configuration -----------------------------------------------------------------------------------

    def for_sampling_mode(self, mode: str) -> Strategy:
        """The strategy that runs under ``sampling_mode=mode`` (itself, or a variant of it)."""
        if mode not in self.sampling_modes:
            modes = format_choices(self.sampling_modes)
            raise invalid_value("sampling_mode", mode, f"decoding_strategy={self.name!r} runs with {modes}")
        return self

    def check_family(self, family: Family) -> None:
        """The family must be one the strategy runs, in a sampling mode both support."""
        if self.families is not None and family.name not in self.families:
            raise invalid_value(
                "decoding_strategy",
                self.name,
                f"requires model_name {format_choices(self.families)}, got model_name={family.name!r}",
            )
        if not set(self.sampling_modes) & set(family.sampling_modes):
            raise invalid_value(
                "decoding_strategy",
                self.name,
                f"runs with sampling_mode {format_choices(self.sampling_modes)}, which model_name={family.name!r} "
                "does not support",
            )

    def normalize(self, config: Config) -> None:
        """Set what the strategy cannot work without; override to add more (call this one too)."""
        name = self.name
        if self.bidirectional_prompt:
            force_setting(config, "multi_block_prefix_full", True, f"{name} attends the whole prompt bidirectionally")
            force_setting(config, "enable_prefix_caching", False, f"{name} prompt pages depend on the whole prompt")
            return
        force_setting(config, "multi_block_prefix_full", False, f"{name} uses block-causal attention")
        if self.requires_prefix_caching:
            force_setting(config, "enable_prefix_caching", True, f"{name} keeps committed blocks in shared pages")
        elif config.enable_prefix_caching is None:
            config.enable_prefix_caching = True

    def attention_block_size(self, config: Config) -> int:
        """The span attention is block-causal at, which a request's blocks have and which commits as one unit
        (`diffulex.strategy.request.DecodeSettings.block_size`): ``block_size`` unless the strategy reads that field
        otherwise."""
        return config.block_size

    def continues_steps(self, config: Config) -> bool:
        """Whether, under ``config``, a step may be continued on the device (`diffulex.engine.continuation`): the
        requests' `Request.next_step_has_same_rows` can ever say yes. By default wherever the strategy's steps
        can be (a full running set keeps its rows until its first block is stored) and its greedy steps sample in the
        graph: the engine runner's continuation replays the graph's own sampling."""
        return self.continues_on_device and self.samples_in_graph

    def short_step_rows(self, config: Config, logits_shift: bool) -> int | None:
        """Rows per request, on average over a step's requests, that this strategy's most frequent decode steps fit
        in (a shifted family's recomputed row included), where that is fewer than its running set (Fast-dLLM v2:
        most requests refine one sub-block while a few compute a whole block). The engine then captures a second set
        of decode graphs whose buckets hold that many rows per request (`GraphShape.row_capacity`), so those steps do
        not compute every request's padding to the running set; a step replays whichever set computes fewer rows.
        None: one set.

        By default two blocks where the buffer holds more: a block joins the running set only once the newest one
        has made progress and may force only once the block before it is nearly decoded, so a request mostly runs
        its leading block and the one after it (with one accepted token a step, always), and padding every request
        to ``buffer_size`` blocks would compute twice the rows at a buffer of 4."""
        if config.buffer_size <= SHORT_STEP_BLOCKS:
            return None
        return SHORT_STEP_BLOCKS * config.block_size + int(logits_shift)

    def short_step_buckets(self, buckets: list[int]) -> list[int]:
        """Of the full decode graphs' request buckets, those the short graphs (`short_step_rows`) are captured for;
        smaller steps, and those no short bucket holds, replay the full graphs. By default the powers of two from
        `SHORT_STEP_MIN_REQUESTS`: a step of ``r`` requests finds one of fewer than ``2r``, which at half the full
        graphs' rows a request holds no more rows than a full bucket of ``r``, for a third of the captures at the
        engine's start (its default 128 requests: 4 buckets of 12); at a buffer of 4 their row counts are those of
        smaller full buckets, so they need no kernel variant the full graphs lack."""
        return [b for b in buckets if b >= SHORT_STEP_MIN_REQUESTS and b & (b - 1) == 0]

    def options(self, config: Config, given: Any = None) -> Any:
        """The strategy's options: each field from ``given`` (a dict, or the options object itself), else the
        engine field of the same name, else its default. Unknown keys of ``given`` are an error."""
        if isinstance(given, self.Options):
            return given
        if given is None:
            given = {}
        names = [f.name for f in dataclasses.fields(self.Options)]
        if not isinstance(given, Mapping):
            raise invalid_value("strategy_options", given, f"must be a dict of the options of {self.name!r}")
        reject_unknown_keys(f"strategy_options of decoding_strategy={self.name!r}", given, names)
        values = {name: getattr(config, name) for name in names if hasattr(config, name)}
        values.update(given)
        return self.Options(**values)

    # ----- runtime -----------------------------------------------------------------------------------------

    def make_sampler(self, context: SamplerContext) -> Sampler:
        raise NotImplementedError(f"decoding_strategy={self.name!r} has no sampler")

    def make_runner(self, context: RunnerContext) -> StepRunner | None:
        """A runner of the strategy's own, for a model the engine's `ModelRunner` cannot drive; None (the
        default): the engine's runner with `make_sampler`'s sampler."""
        return None

    def soft_inputs(self, options: Any, mask_token_id: int) -> TokenMergeSettings | None:
        """Soft inputs (a mix of candidate embeddings instead of a token's) the next forward takes; None: none."""
        return None

    def __repr__(self) -> str:
        return f"<decoding strategy {self.name!r}>"


# Reading the table imports the package's strategies (`diffulex.strategy.builtin`).
STRATEGIES: Registry[Strategy] = Registry(
    "decoding_strategy", builtins="diffulex.strategy.builtin", kind="decoding strategy"
)


def register_strategy(strategy: Strategy) -> Strategy:
    """Make ``strategy`` known under its name (and its old spellings). The package's strategies are registered
    first; a name or alias one of them (or any earlier registration) holds is refused, and nothing is registered."""
    return STRATEGIES.add(strategy.name, strategy, aliases=strategy.aliases)

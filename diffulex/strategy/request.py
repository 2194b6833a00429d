"""One generation request and its logical block state (see docs/strategies.md for the rules it implements).

The request owns its token sequence (prompt, then every opened block, masks where not decoded yet), its blocks,
and its running set. It knows nothing about pages, batches or devices: the scheduler decides when it runs, the
KV cache manager gives it pages, the model runner turns its query range into tensors.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from diffulex.layers.token_merge import SoftInput
from diffulex.sampling_params import SamplingParams
from diffulex.strategy.block import Block, BlockStatus
from diffulex.strategy.block_list import BlockList, UnreadBlocks
from diffulex.strategy.page_table import PageTable

if TYPE_CHECKING:
    from diffulex.engine.kv_cache_manager import PrefixWalk


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no pages (new, or preempted)
    RUNNING = "running"  # admitted; holds pages for its committed blocks
    FINISHED = "finished"


class CompletionReason(enum.StrEnum):
    """Why a request stopped (the original's names, so logs and tooling stay comparable)."""

    EOS = "eos_token_generated"
    MAX_TOKENS = "max_new_tokens_reached"
    MAX_MODEL_LEN = "max_model_len_reached"
    MAX_NFE = "max_nfe_reached"
    REPETITION = "max_repetition_run_reached"
    STOP_STRING = "stop_string_matched"
    ABORTED = "aborted"
    ERROR = "error"  # a step the request took part in failed (`Request.error` says how); the engine went on


@dataclass(frozen=True)
class DecodeSettings:
    """Engine-wide decoding constants, resolved once from the config, the checkpoint and the tokenizer."""

    block_size: int  # the span of a request's blocks (`Strategy.attention_block_size`)
    buffer_size: int
    mask_token_id: int
    max_model_len: int
    stop_token_ids: frozenset[int]
    accept_threshold: float
    add_block_threshold: float
    semi_complete_threshold: float
    auto_max_nfe_warmup_steps: int
    auto_max_nfe_tpf_floor: float
    logits_shift: bool = False  # the family predicts the token at p from the hidden state at p - 1
    token_stability_threshold: float = 0.0  # edit mode: stable share the newest block needs before another opens
    options: Any = None  # the strategy's options object (`diffulex.strategy.strategy.Strategy.Options`)


@dataclass
class SampleTarget:
    """The positions of one active block that the sampler should fill in this step."""

    block: Block
    positions: list[int]
    force_allowed: bool  # accept the most confident position even if none passes the threshold


@dataclass
class StepRecord:
    """What one engine step did for one request (kept on the request, returned in its trajectory)."""

    step: int
    query_len: int  # tokens this request contributed to the forward
    num_new_tokens: int  # mask positions filled in this step
    # Tuples, not lists: a record lives as long as its request, and the garbage collector stops scanning a tuple of
    # ints after its first pass, while it rescans every list in each full collection (at batch 64 the engine keeps
    # about 200 such objects per step).
    running_block_ids: tuple[int, ...]  # the running set during the forward
    running_token_ids: tuple[int, ...]  # its tokens after this step's writes (masks still shown)
    step_time: float = 0.0  # wall time of the whole engine step, seconds
    # position of running_token_ids[0]; None: the first running block's index times the block size (blocks on the
    # block grid), which a strategy whose blocks start elsewhere (DiffusionGemma's canvases) does not satisfy
    running_start: int | None = None


@dataclass
class Request:
    """The state of one request; created by the engine, advanced by scheduler, runner and sampler."""

    # Whether the scheduler may compute this request's uncached prompt prefix over several steps
    # (`begin_prefill_chunk`), and the runner its store-only prompt rows before the rest of a step on the graph path
    # (`store_only_end`). A subclass that chooses its own query range or stored blocks says False.
    supports_prefill_chunks: ClassVar[bool] = True

    req_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    settings: DecodeSettings
    token_ids: list[int] = field(init=False)
    blocks: BlockList = field(init=False)  # a plain list where a strategy makes its own (DiffusionGemma canvases)
    running: list[Block] = field(init=False)  # the running set, oldest block first
    status: RequestStatus = field(init=False, default=RequestStatus.WAITING)
    completion_reason: CompletionReason | None = field(init=False, default=None)
    nfe: int = field(init=False, default=0)
    num_new_tokens_total: int = field(init=False, default=0)
    num_preemptions: int = field(init=False, default=0)
    stop_pos: int | None = field(init=False, default=None)  # first stop token at a generated position
    frontier: int = field(init=False)  # first position >= prompt_len that still holds the mask token
    num_cached_blocks: int = field(init=False, default=0)  # leading blocks whose K/V is in the cache
    page_table: PageTable = field(init=False, default_factory=PageTable)  # owned by the KV cache manager
    page_hashes: list[bytes] = field(init=False, default_factory=list)  # owned by the KV cache manager
    # while waiting: how far its last prefix-cache lookup got (owned by the KV cache manager)
    prefix_walk: PrefixWalk | None = field(init=False, default=None, repr=False)
    steps: list[StepRecord] = field(init=False, default_factory=list)
    error: str | None = field(init=False, default=None)  # why it finished with CompletionReason.ERROR
    # Fixed at creation and read many times per step, so stored rather than derived.
    prompt_len: int = field(init=False)
    generation_end: int = field(init=False)  # positions at or after this are never decoded
    max_nfe: int = field(init=False)  # the explicit cap, or one a request making the guaranteed progress never hits
    # End of this step's prefill chunk (block aligned), or None: the step computes the whole query range
    prefill_chunk_end: int | None = field(init=False, default=None)
    _prompt_array: np.ndarray | None = field(init=False, default=None, repr=False, compare=False)  # `prompt_array`

    def __post_init__(self) -> None:
        s = self.settings
        size, prompt_len = s.block_size, len(self.prompt_token_ids)
        self.prompt_len = prompt_len
        self.generation_end = min(prompt_len + self.sampling_params.max_tokens, s.max_model_len)
        self.max_nfe = self._max_nfe()
        self.token_ids = list(self.prompt_token_ids)
        self.blocks = BlockList(size, prompt_len // size)  # the prompt's whole blocks, made when first read
        self.running = []
        if prompt_len % size:  # the prompt ends mid-block: the rest of that block is generated first
            start = len(self.blocks) * size
            self.token_ids.extend([s.mask_token_id] * (start + size - prompt_len))
            block = Block(len(self.blocks), start, size, BlockStatus.ACTIVE)
            self.blocks.append(block)
            self.running.append(block)
        self.frontier = prompt_len

    # ----- derived quantities -------------------------------------------------------------------------

    @property
    def decode_limit(self) -> int:
        """Positions at or after this are not decoded any more (the generation end, or the first stop token)."""
        end = self.generation_end
        return end if self.stop_pos is None else min(end, self.stop_pos)

    def _max_nfe(self) -> int:
        if self.sampling_params.max_nfe is not None:
            return self.sampling_params.max_nfe
        s, max_tokens = self.settings, self.sampling_params.max_tokens
        return (
            s.auto_max_nfe_warmup_steps
            + math.ceil(max_tokens / s.auto_max_nfe_tpf_floor)
            + math.ceil(max_tokens / s.block_size)
            + 1
        )

    @property
    def prompt_array(self) -> np.ndarray:
        """The prompt's tokens as a read-only int64 array, converted once: a long prompt's rows and page hashes read
        it at memory speed (its tokens never change)."""
        if self._prompt_array is None:
            values = np.array(self.prompt_token_ids, dtype=np.int64)
            values.flags.writeable = False
            self._prompt_array = values
        return self._prompt_array

    def adopt_prompt_array(self, values: np.ndarray) -> None:
        """Take ``values`` (int64, equal to the prompt's tokens: the prompt check's conversion) as `prompt_array`."""
        if values.shape != (self.prompt_len,) or values.dtype != np.int64:
            raise ValueError(
                f"prompt array of shape {values.shape} and dtype {values.dtype} is invalid: must be int64 of shape "
                f"({self.prompt_len},)"
            )
        values.flags.writeable = False
        self._prompt_array = values

    def token_array(self, start: int, end: int) -> np.ndarray:
        """The tokens of positions ``[start, end)`` as int64: the prompt's part a view of `prompt_array`, the
        rest converted from the sequence."""
        prompt_len = self.prompt_len
        if end <= prompt_len:
            return self.prompt_array[start:end]
        rest = np.array(self.token_ids[max(start, prompt_len) : end], dtype=np.int64)
        return np.concatenate((self.prompt_array[start:prompt_len], rest)) if start < prompt_len else rest

    @property
    def num_cached_tokens(self) -> int:
        return self.num_cached_blocks * self.settings.block_size

    @property
    def committed_len(self) -> int:
        """End of the last committed block: every position before it is final and needs (or has) K/V.

        Blocks commit in order (a block commits only after the one before it) and an active block is always in the
        running set, so the committed blocks are all those before the running set's first active one: found in
        the few blocks of the running set, not by walking a long prompt's blocks on every call."""
        first_active = next((block for block in self.running if not block.is_committed), None)
        if first_active is not None:
            return first_active.start
        return self.blocks[-1].end if len(self.blocks) > self.num_cached_blocks else self.num_cached_tokens

    @property
    def stored_len(self) -> int:
        """End of the positions whose K/V the cache holds or the next forward stores: what the request's pages must
        cover. The committed blocks here; a strategy that also keeps K/V of a block still being decoded says more."""
        return self.committed_len

    @property
    def max_stored_len(self) -> int:
        """The most `stored_len` can grow to: what the page pool must be able to hold for this request alone."""
        return self.generation_end

    @property
    def shareable_len(self) -> int:
        """Final positions outside the running set: the part a prefix-cache lookup may cover."""
        limit = self.committed_len
        return min(limit, self.running[0].start) if self.running else limit

    def remaining(self, block: Block) -> int:
        """Decodable positions of ``block`` that still hold the mask token."""
        lo, hi = max(block.start, self.prompt_len), min(block.end, self.decode_limit)
        return self.token_ids[lo:hi].count(self.settings.mask_token_id) if lo < hi else 0

    def progress(self, block: Block) -> float:
        return (block.size - self.remaining(block)) / block.size

    @property
    def answer_end(self) -> int:
        """End of the decoded answer: the first stop token, first mask, or generation end (never before the
        prompt end)."""
        return max(self.prompt_len, min(self.frontier, self.decode_limit))

    def answer_token_ids(self) -> list[int]:
        """Decoded tokens from the prompt end up to the first stop token, first mask, or generation end."""
        return self.token_ids[self.prompt_len : self.answer_end]

    @property
    def settled_answer_end(self) -> int:
        """End of the answer's tokens that no later step can change: what a stop string may be matched in while the
        request runs. Here every decoded token is final; a strategy whose steps rewrite decoded tokens says less."""
        return self.answer_end

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    # ----- running-set policy --------------------------------------------------------------------------

    def _open_block(self) -> Block:
        size = self.settings.block_size
        block = Block(len(self.blocks), len(self.token_ids), size, BlockStatus.ACTIVE)
        self.token_ids.extend([self.settings.mask_token_id] * size)
        self.blocks.append(block)
        self.running.append(block)
        return block

    def maybe_activate_block(self) -> bool:
        """Open the next block if the running set has room and its newest block is far enough along."""
        if not self._has_room_for_a_block():
            return False
        if self.running and self.progress(self.running[-1]) < self.settings.add_block_threshold:
            return False
        self._open_block()
        return True

    def _has_room_for_a_block(self) -> bool:
        """Whether a block may still join the running set: it is not full, and the decoding has not ended."""
        if self.stop_pos is not None or len(self.running) >= self.settings.buffer_size:
            return False
        return len(self.token_ids) < self.generation_end

    @property
    def prefill_end(self) -> int:
        """End of the committed prefix before the running set: the part a prefill chunk may cover."""
        return min(self.committed_len, self.running[0].start) if self.running else self.committed_len

    def chunk_start(self) -> int:
        """First row of a prefill chunk (see `query_range` for the row a shifted family recomputes)."""
        start = self.num_cached_tokens
        return start - 1 if self.settings.logits_shift and start > 0 else start

    def begin_prefill_chunk(self, max_rows: int) -> bool:
        """Compute only the leading whole blocks of the uncached prefix that fit in ``max_rows`` rows this step:
        their K/V is stored and nothing is sampled. False (and nothing set) when not even one block fits."""
        size, cached = self.settings.block_size, self.num_cached_tokens
        prompt_rows = min(max_rows - (cached - self.chunk_start()), self.prefill_end - cached)
        end = cached + max(prompt_rows, 0) // size * size
        if end <= self.num_cached_tokens:
            return False
        self.prefill_chunk_end = end
        return True

    def query_range(self) -> tuple[int, int]:
        """Positions this step's forward must compute: uncached committed blocks, then the running set (only the
        chunk's blocks during a prefill chunk).

        A shifted family also recomputes the last cached position: its hidden state predicts the first
        position after it. That row reads the cache only before itself and is not stored again.
        """
        if self.prefill_chunk_end is not None:
            return self.chunk_start(), self.prefill_chunk_end
        end = self.running[-1].end if self.running else self.committed_len
        start = self.num_cached_tokens
        if self.settings.logits_shift and start > 0:
            start -= 1
        return start, end

    def store_only_end(self) -> int | None:
        """End of the leading rows of `query_range` that only store K/V (the uncached committed prefix before the
        running set, or the whole prefill chunk), when this step has any and they may run in a forward of their
        own before the rest (`diffulex.engine.prefill_graphs`); else None.

        Nothing is sampled from those rows, and under block-causal attention (which the caller checks) their K/V
        do not depend on the rows after them: the rest of the step may read them from the cache instead. The
        same holds for a request that computes its prompt in chunks, so a subclass that cannot
        (`supports_prefill_chunks`) cannot split its rows either.
        """
        if not self.supports_prefill_chunks:
            return None
        if self.prefill_chunk_end is not None:
            return self.prefill_chunk_end
        cached = self.num_cached_blocks * self.settings.block_size
        if self.running and self.running[0].start <= cached:  # a decoding request: nothing before its running set
            return None
        end = self.prefill_end
        return end if end > cached else None

    def keys_end(self) -> int | None:
        """End of the keys this step's rows attend to, when it lies past `query_range`: the keys after the rows are
        then read from the cache (`stored_len` covers them). None: the keys end with the rows."""
        return None

    def input_token_ids(self, start: int, end: int) -> list[int] | np.ndarray:
        """The tokens the forward reads at positions ``[start, end)`` of `query_range`: the sequence itself (with
        prompt rows, as `token_array`: no conversion of a long prompt's tokens)."""
        if start >= self.prompt_len:
            return self.token_ids[start:end]
        return self.token_array(start, end)

    def stores_kv(self, block: Block) -> bool:
        """Whether this step's forward writes the K/V of ``block``'s rows into the cache: once it is final. A
        subclass may store more blocks, but stores every ``TO_CACHE`` one: a prompt block not read yet
        (`diffulex.strategy.block_list`) is stored exactly when it is ``TO_CACHE`` (`stored_runs`)."""
        return block.status is BlockStatus.TO_CACHE

    def stored_runs(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The runs ``(start, end)`` of positions within ``[lo, hi)`` whose K/V this step's forward writes
        (`stores_kv`), adjacent ones merged: a cold prompt's are one run, found without making its blocks."""
        size = self.settings.block_size
        runs: list[tuple[int, int]] = []
        for segment in self.blocks.segments(lo // size, -(-hi // size)):
            if isinstance(segment, UnreadBlocks):
                if segment.status is not BlockStatus.TO_CACHE:
                    continue
                start, end = segment.indices.start * size, segment.indices.stop * size
            elif self.stores_kv(segment):
                start, end = segment.start, segment.end
            else:
                continue
            start, end = max(start, lo), min(end, hi)
            if runs and runs[-1][1] == start:
                runs[-1] = (runs[-1][0], end)
            elif start < end:
                runs.append((start, end))
        return runs

    def sample_targets(self) -> list[SampleTarget]:
        """The running blocks' masked positions to sample, block by block, each block forcing its best row where the
        block before it is decoded far enough (``semi_complete_threshold``, its `progress`). The masks of a running
        block are counted once here, for its own positions and as the `remaining` of the block after it: the engine
        asks this of every request several times a step."""
        if self.prefill_chunk_end is not None:
            return []
        targets = []
        lo_gen, limit, mask, token_ids = self.prompt_len, self.decode_limit, self.settings.mask_token_id, self.token_ids
        threshold = self.settings.semi_complete_threshold
        counted: Block | None = None  # the last running block whose masks were counted, and their number
        counted_masks = 0
        for block in self.running:
            if block.status is not BlockStatus.ACTIVE:
                continue
            lo, hi = max(block.start, lo_gen), min(block.end, limit)
            positions = [p for p in range(lo, hi) if token_ids[p] == mask]
            index = block.index
            if positions:
                if index == 0:
                    force = True
                elif counted is not None and counted.index == index - 1:
                    force = (counted.size - counted_masks) / counted.size >= threshold
                else:
                    force = self.progress(self.blocks[index - 1]) >= threshold
                targets.append(SampleTarget(block, positions, force))
            counted, counted_masks = block, len(positions)
        return targets

    def soft_inputs(self) -> dict[int, SoftInput]:
        """Positions whose next forward input is a mix of candidate embeddings (DMax's token merge), with their
        candidates; none outside edit mode."""
        return {}

    def continued_rows(self, positions: list[int]) -> tuple[list[int], int]:
        """What a continuation of this request's last step computes for it (`diffulex.engine.continuation`), now
        that the host has applied that step: of ``positions`` (those it sampled) the ones it samples, the masks
        left, and how many running blocks it stores: from the first on, each that it sampled, with none left, where
        its next forward would store it (a block's K/V are stored once the blocks before it are). A block the device
        opened is sampled up to `generation_end` (`diffulex.engine.continuation.BlockOpening`), not past it."""
        mask, end = self.settings.mask_token_id, self.generation_end
        rows = [p for p in positions if p < end and self.token_ids[p] == mask]
        stored = 0
        for block in self.running:
            sampled = any(block.start <= p < block.end for p in positions)
            if not sampled or any(block.start <= p < block.end for p in rows) or not self.stores_when_decoded(block):
                break
            stored += 1
        return rows, stored

    def cache_end_after_step(self) -> int:
        """Where the request's cached positions end once the step about to run is applied: a step that computes
        the whole uncached prefix before the running set (an admitted prompt, not a chunk of it) stores it; its
        running blocks' rows are then computed after that prefix again, which the step's decode graph already did
        (`diffulex.engine.prefill_graphs`: the prefix is a forward of its own before them)."""
        if self.prefill_chunk_end is None and self.running:
            prefix_end = self.store_only_end()
            if prefix_end is not None and prefix_end == self.running[0].start:
                return prefix_end
        return self.num_cached_tokens

    def next_query_range(self) -> tuple[int, int]:
        """`query_range` of the step after the one about to run, where that one computes the same running blocks
        (`next_step_has_same_rows`): its own, unless this step stores a prompt prefix before the running set."""
        start = self.cache_end_after_step()
        if start == self.num_cached_tokens:
            return self.query_range()
        if self.settings.logits_shift and start > 0:
            start -= 1
        return start, self.running[-1].end

    def next_step_has_same_rows(self) -> bool:
        """Whether the step after the one about to run computes the same rows, judged before this one's result.

        The running set's active blocks, right after the cache, with positions to decode: accepting then only fills
        masks, lets a block force once the one before it is decoded far enough, and at most makes leading blocks
        ``TO_CACHE``, which the next step stores while computing the same rows. Unless a block joins the running
        set: where it has room, the newest block's progress after this step decides (``add_block_threshold``). One
        far enough along already has the next block join; one that forces gains a token: if that is enough, the
        rows change. One that may not force gains
        only tokens above ``accept_threshold``, taken here as none, as a block at the decoding frontier rarely
        has any: a wrong guess is caught once the result is applied (the host's next step computes other rows)
        and costs the continued forward. A continuation step (`diffulex.engine.continuation`) relies on this.
        """
        running = self.running
        if not running or running[0].start != self.cache_end_after_step():
            return False
        if any(block.status is not BlockStatus.ACTIVE for block in running):
            return False
        targets = self.sample_targets()
        if not targets:
            return False
        return not self._has_room_for_a_block() or not self._next_block_joins(targets)

    def _next_block_joins(self, targets: list[SampleTarget]) -> bool:
        """Whether the newest running block is far enough along after the step about to run (sampling ``targets``)
        for the next block to join (``add_block_threshold``): it is already (a threshold of 0: one joins every
        step), or it reaches it with the token it forces; one that may not force is taken to gain none."""
        newest = self.running[-1]
        decoded = newest.size - self.remaining(newest)
        if decoded / newest.size >= self.settings.add_block_threshold:
            return True
        forced = any(target.block is newest and target.force_allowed for target in targets)
        return forced and (decoded + 1) / newest.size >= self.settings.add_block_threshold

    def next_step_opens_block(self) -> bool:
        """Whether the step after the one about to run computes this request's running blocks one block further on,
        which a continuation can do itself (`diffulex.engine.continuation.BlockOpening`): the step about to run
        stores the leading block (decoded; an answer's first block may hold the prompt's last positions, which
        count as decoded, as `progress` counts them) and no other, the block after them starts before the decoding
        limit (an answer's last block may end before the block does: the device samples it up to
        `generation_end`), and it joins the running set: a lone block's successor always does, else as
        `_next_block_joins` judges (the guess `next_step_has_same_rows` makes). The host opens that block when it
        next looks at the request (`maybe_activate_block`). A running set at the decoding limit has no block to
        join: the step after computes the blocks after the lead alone (`block_joins_past_running_set`)."""
        running = self.running
        if not running:
            return False
        lead = running[0]
        if lead.status is not BlockStatus.TO_CACHE or lead.start != self.cache_end_after_step():
            return False
        if any(block.status is not BlockStatus.ACTIVE for block in running[1:]):
            return False
        if not self.block_joins_past_running_set():  # the running set drains: the blocks after the lead stay
            return len(running) > 1
        return len(running) == 1 or self._next_block_joins(self.sample_targets())

    def block_joins_past_running_set(self) -> bool:
        """Whether a block after the running set may still join it: not once the running set reaches the decoding
        limit (its answer's end, or a stop token's), from where it drains, block by block. A continuation moves a
        draining set on too, with a placeholder block after it (`diffulex.engine.continuation.BlockOpening`)."""
        return bool(self.running) and self.running[-1].end < self.decode_limit

    def stores_when_decoded(self, block: Block) -> bool:
        """Whether the step after the one that decodes the last sampled mask of ``block`` stores its K/V over this
        step's rows: then a continuation of this step (`diffulex.engine.continuation`) turns on the store of the
        block's rows once the device has decoded it. True here: a decoded block becomes ``TO_CACHE`` and the next
        forward, over the same rows, stores it."""
        return True

    # ----- after the forward -----------------------------------------------------------------------------

    def apply_tokens(self, writes: list[tuple[int, int]]) -> int:
        """Write accepted ``(position, token)`` pairs; returns how many masks were filled."""
        mask, stops = self.settings.mask_token_id, self.settings.stop_token_ids
        honour_stop = not self.sampling_params.ignore_eos
        filled = 0
        for pos, token in writes:
            if self.token_ids[pos] != mask:
                raise RuntimeError(f"request {self.req_id}: position {pos} was already decoded")
            self.token_ids[pos] = token
            filled += 1
            if honour_stop and token in stops and (self.stop_pos is None or pos < self.stop_pos):
                self.stop_pos = pos
        while self.frontier < len(self.token_ids) and self.token_ids[self.frontier] != mask:
            self.frontier += 1
        self.num_new_tokens_total += filled
        return filled

    def retire_and_commit(self) -> None:
        """Blocks stored by this forward become cached and leave the running set; complete blocks commit."""
        stored_end = self.prefill_chunk_end
        self.prefill_chunk_end = None
        blocks = self.blocks
        stored_to = len(blocks) if stored_end is None else stored_end // self.settings.block_size
        blocks.store(self.num_cached_blocks, stored_to)  # a cold prompt's blocks by one assignment
        self.running = [b for b in self.running if b.status is not BlockStatus.IN_CACHE]
        # the cached prefix grows by the leading blocks stored now
        self.num_cached_blocks = blocks.first_not_cached(self.num_cached_blocks)
        for block in self.running:
            prev = self.blocks[block.index - 1] if block.index > 0 else None
            prev_committed = prev is None or prev.is_committed
            if block.status is BlockStatus.ACTIVE and prev_committed and self.is_final(block):
                block.status = BlockStatus.TO_CACHE

    def is_final(self, block: Block) -> bool:
        """Whether ``block``'s tokens will not change any more, so that it may commit: no mask left."""
        return self.remaining(block) == 0

    def check_completion(self) -> CompletionReason | None:
        """Called after every step, once ``nfe`` counts it."""
        if self.stop_pos is not None and self.frontier >= self.stop_pos:
            return CompletionReason.EOS
        if self.frontier >= self.generation_end:
            return self.length_reason()
        if self.nfe >= self.max_nfe:
            return CompletionReason.MAX_NFE
        return self.repetition_reason()

    def length_reason(self) -> CompletionReason:
        """Why a request that has generated up to its end stopped: ``max_model_len`` when that bounded it, else
        ``max_tokens``."""
        limited_by_len = self.settings.max_model_len < self.prompt_len + self.sampling_params.max_tokens
        return CompletionReason.MAX_MODEL_LEN if limited_by_len else CompletionReason.MAX_TOKENS

    def repetition_reason(self) -> CompletionReason | None:
        """REPETITION once the answer ends in ``max_repetition_run`` equal tokens."""
        run_cap = self.sampling_params.max_repetition_run
        if run_cap is not None and _trailing_run(self.answer_token_ids()) >= run_cap:
            return CompletionReason.REPETITION
        return None

    # ----- preemption ------------------------------------------------------------------------------------

    def forget_cache(self) -> None:
        """The request lost its pages: every cached block must have its K/V computed again."""
        self.blocks.uncache()
        self.num_cached_blocks = 0
        self.num_preemptions += 1
        self.prefill_chunk_end = None

    def mark_prefix_cached(self, num_tokens: int) -> None:
        """A prefix-cache hit supplied the K/V of the first ``num_tokens`` positions (block aligned)."""
        num_blocks = num_tokens // self.settings.block_size
        self.blocks.mark_cached(num_blocks)
        self.num_cached_blocks = num_blocks


def decoded_for_progress(block_size: int, threshold: float) -> int:
    """The fewest decoded positions of a block whose progress reaches ``threshold`` (`Request.progress`), as a count
    a continuation's device rule compares: with ``semi_complete_threshold``, from which the block after it may force
    its best row (`Request.sample_targets`, `diffulex.engine.continuation.BlockGates`); with
    ``add_block_threshold``, from which the next block joins the running set (`Request.maybe_activate_block`,
    `diffulex.engine.continuation.BlockOpening`). ``block_size + 1``: never."""
    return next((k for k in range(block_size + 1) if k / block_size >= threshold), block_size + 1)


def _trailing_run(tokens: list[int]) -> int:
    if not tokens:
        return 0
    run = 1
    for i in range(len(tokens) - 1, 0, -1):
        if tokens[i - 1] != tokens[i]:
            break
        run += 1
    return run

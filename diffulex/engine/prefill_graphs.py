"""CUDA graphs for a step's store-only prompt rows: one request, or a group of prompts, per replay; buckets by rows.

A step that carries a prompt (a new request's uncached prefix, a chunk of a long prompt, the committed blocks a
preempted request rebuilds) has rows no decode graph can hold: a decode bucket bounds each request's rows by its
running set. Those leading rows only store K/V; nothing is sampled from them. Under block-causal attention their
K/V do not depend on the rows after them (`Request.store_only_end` says where they end), so the runner computes
them in a forward of their own, before the rest of the step, and the rest (the decoders, and that request's
running set, which then reads the prefix from the cache) replays the decode graphs as any decode step does.

Each bucket is a one-request `DecodeGraphs` of a power of two of prompt rows (``16, 32, 64, ...`` up to the largest,
the ``max_prefill_graph_tokens`` setting) and the rows one request adds to a decode step (its running set): a prefix
of ``n`` rows replays the smallest bucket of at least ``n`` rows, padded as a decode bucket is (padded rows store
nothing). A store-only replay reads no row (nothing is sampled), so its last layer skips what only the LM head
would read; a lone request's replay (below) reads the rows it samples from. Several prefixes in one step replay one
after another on the same stream, each staged from its own snapshot of the host buffer (`DecodeGraphs`
``snapshot_uploads``), before the step's decode graph; the graphs share the decode graphs' memory pool, since one
stream runs them in turn.

Several prompts in one step (the arrivals an admission step takes in, the first step of a batch) would each replay
a bucket of their own, each reading every weight, and each padded to a power of two: the group graphs hold up to
`MAX_PROMPTS_PER_GROUP` requests in a bucket of as many rows as a one-request bucket's prompt rows, shared however
long each prompt is (`GraphShape.total_rows`), and `group_prompts` puts prompts together where the group's replay
costs no more rows than theirs apart (measured on an H200 at SDAR-1.7B, the serving sweep's mix: a step admitting
prompts beside 128 decoders 20.7 -> 17.1 ms; docs/benchmarks.md, "Prompts admitted together in one replay").

A request alone needs no second forward for the few rows it samples from: the smallest bucket that holds its whole
step replays over it and those rows are read from it (`ModelRunner._lone_prompt_plan`); a second forward would read
every weight and the whole context again for them. The running set's rows on top of each power of two are for this:
a prompt of ``2^k`` tokens and its first block replay one bucket (measured on an H100, a 2,048-token prompt with
buckets of powers of two replayed 2,048 rows and then a decode graph for its block's 4: at SDAR-8B 54 ms against 50
for the whole step eagerly).

A short prefix beside decoders (a chunk of a long prompt sized by cost, `max_prefill_chunk_cost`) would make its
step two forwards, each reading every weight. The chunk graphs (`chunk_graph_shape`) take such a step whole: decode
buckets whose requests may each have up to `CHUNK_GRAPH_ROWS` rows, and whose attention splits every long context
(the chunk's) while the decoders' short ones stay whole, although their grid fills the GPU. Not a prompt that ends
in its step beside `MIN_DECODERS_PER_SPLIT_PROMPT` decoders or more when the step after it could be continued on the
device (`ModelRunner._split_lets_successor_continue`): ridden whole, the prompt's rows would be in the layout a
continuation replays, so the host would launch that step itself, and at 64-128 decoders such a step costs the GPU
far more idle time than the prompt's extra weight read.
The straggler graphs (`straggler_graph_shape`) split long contexts the same way in the decode graphs' shape, for
decode steps among which one context stands out.

A prefix longer than the largest bucket runs eagerly with the rest of its step: at that size the forward is
bound by its matmuls, not by the launches a graph saves, and a lone long prompt keeps the larger matmuls of one
forward. Below it the launches can bound an eager forward: a 2,048-token prompt at SDAR-1.7B took 17-38 ms eagerly on
an H100 (its host's launches; 13.7 ms of kernels) and 14.6 ms replayed, hence the default largest bucket of 2,048
prompt rows. The scheduler keeps the chunks of a prompt beside decoding requests within `CHUNK_BESIDE_DECODERS_ROWS`
and the largest bucket (`diffulex.engine.scheduler.SchedulerLimits.prefill_chunk_rows`), so those steps replay
and the decoders wait for no more than that.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import torch

from diffulex.engine.cuda_graph import DecodeGraphs, Forward, GraphShape
from diffulex.engine.step_inputs import StepInputs

logger = logging.getLogger("diffulex")

# The smallest prefill bucket: fewer rows pad to it (a forward that small is bound by its weight reads anyway).
MIN_PREFILL_BUCKET_ROWS = 16
# The chunk graphs: the most rows one request of a step may have (the chunk); the rows a bucket holds per request
# beyond the decode width, few, since every padded row costs the whole forward's flops (a chunk of CHUNK_GRAPH_ROWS
# fits beside 31 decoders of one block in a bucket of 32, a chunk of 28 rows beside 8 in a bucket of 16; smaller
# batches split the step as before); and their attention's split of a long context: CHUNK_SPLITS splits of at
# least CHUNK_MIN_SPLIT_KEYS keys, so a 32k context folds in 16 parallel programs per tile while a decoder's
# context of under 2k keys is not split.
CHUNK_GRAPH_ROWS = 64
CHUNK_EXTRA_ROWS_PER_REQUEST = 2
CHUNK_SPLITS = 16
CHUNK_MIN_SPLIT_KEYS = 1024
# A decode step where one context stands out replays the straggler graphs (`straggler_graph_shape`): the decode
# graphs' attention splits keys only where its grid cannot fill the GPU, so among many short decoders one long
# context is folded by a single program per head while the rest of the GPU idles (measured on an H100: 32 decoders
# and one 32k context, 33 ms a step against 3.4 alone at SDAR-1.7B). A step's longest key range counts as standing
# out from the first length those graphs split (two splits' worth) at CHUNK_CONTEXT_IMBALANCE times its requests'
# mean or more (such a step's successor is continued on them, `diffulex.engine.continuation`); balanced long
# contexts fill the grid evenly and stay on the decode graphs.
CHUNK_CONTEXT_MIN_KEYS = 2 * CHUNK_MIN_SPLIT_KEYS
CHUNK_CONTEXT_IMBALANCE = 4
# A step whose prompts end in it and fit the chunk graphs splits them off into prefill graphs instead, so that the
# step after it is continued on the device (`ModelRunner._split_lets_successor_continue`), where its decoding requests
# number at least this many per prompt: each prompt split off reads every weight once more (about 0.8 ms at SDAR-1.7B
# on an H200), and a step the host launches leaves the GPU idle for about 0.08 ms per request there (5 ms at 64
# requests, 10 at 128: docs/benchmarks.md, "Online serving while the batch is held").
MIN_DECODERS_PER_SPLIT_PROMPT = 10
# Several prompts' store-only rows in one step replay a group bucket together (`group_prompts`), each group reading
# every weight once: at most this many prompts a group (each a request slot of the group graphs' buffers; a slot
# without rows costs a group's attention only programs that return at once).
MAX_PROMPTS_PER_GROUP = 16
# A prompt whose rows follow a cached context of this many keys or more replays alone: its attention fills the GPU
# only with its keys split (the split settles on a graph's shape, and a group's grid, every prompt's query tiles,
# counts as full), so in a group its keys would be folded by one program per query tile.
GROUP_MAX_CONTEXT_KEYS = CHUNK_MIN_SPLIT_KEYS
# What a replay of fewer rows costs as if it had this many: below it a forward's matmuls take less time than reading
# its weights (a bf16 weight's two bytes serve two flops a row: the matmul rate over the copy rate, about 184 rows on
# an H200 at its peaks; a 2,048-row prefill replay at SDAR-1.7B took 7.1 us a row on an H100, against 0.8-1.1 ms to
# read its weights), so two short prompts cost one replay together and two alone.
MIN_REPLAY_COST_ROWS = 128
# The most prompt rows a step computes beside decoding requests, whatever the largest prefill bucket: each such step
# makes the decoders wait for the chunk's forward (512, the largest bucket before lone prompts took larger ones; a
# cost budget, `max_prefill_chunk_cost`, bounds the wait more tightly).
CHUNK_BESIDE_DECODERS_ROWS = 512


def contexts_may_straggle(max_model_len: int) -> bool:
    """Whether a request may reach a context that `has_straggling_context` counts as standing out."""
    return max_model_len >= CHUNK_CONTEXT_MIN_KEYS


def has_straggling_context(key_ends: list[int]) -> bool:
    """Whether a step whose requests' key ranges end at ``key_ends`` has one long enough, and long enough against
    the others', that its attention is bound by folding it serially unless its keys are split
    (`CHUNK_CONTEXT_MIN_KEYS`, `CHUNK_CONTEXT_IMBALANCE`)."""
    if not key_ends:
        return False
    longest = max(key_ends)
    return longest >= CHUNK_CONTEXT_MIN_KEYS and longest * len(key_ends) >= CHUNK_CONTEXT_IMBALANCE * sum(key_ends)


def chunk_graph_shape(decode: GraphShape, max_rows: int) -> GraphShape:
    """The chunk graphs' shape from the decode graphs': requests of up to ``max_rows`` rows (a prompt chunk and
    decoders), `CHUNK_EXTRA_ROWS_PER_REQUEST` more rows per request on average than a decode bucket holds, and
    the split of long contexts fixed (`CHUNK_SPLITS`, `CHUNK_MIN_SPLIT_KEYS`)."""
    return GraphShape(
        max_requests=decode.max_requests,
        max_query_len=max(max_rows, decode.max_query_len),
        max_pages=decode.max_pages,
        max_kv_len=decode.max_kv_len,
        block_size=decode.block_size,
        page_size=decode.page_size,
        prefix_full=decode.prefix_full,
        key_tails=decode.key_tails,
        row_capacity=decode.rows_per_request + CHUNK_EXTRA_ROWS_PER_REQUEST,
        num_splits=CHUNK_SPLITS,
        min_split_keys=CHUNK_MIN_SPLIT_KEYS,
    )


def straggler_graph_shape(decode: GraphShape) -> GraphShape:
    """The straggler graphs' shape: the decode graphs' with the chunk graphs' split of long contexts fixed. A
    decode step among which one context stands out (`has_straggling_context`) replays them: its rows are a decode
    step's, so its attention keeps the decode-sized query tiles (the chunk graphs, shaped for a prompt chunk's 64
    rows, take 64-row tiles for every request: measured on an H100, 32 decoders beside a 16k context took 5.5 ms a
    step there against 2.5 alone, the same beside a 4k one)."""
    return dataclasses.replace(decode, num_splits=CHUNK_SPLITS, min_split_keys=CHUNK_MIN_SPLIT_KEYS)


def prefill_buckets(max_rows: int, running_rows: int = 0) -> list[int]:
    """``16, 32, 64, ...`` below ``max_rows``, then ``max_rows`` itself (the only one when it is below 16), each
    plus ``running_rows`` (a request's running set: a lone prompt of that many tokens and its first block fit)."""
    prompt_rows = []
    rows = MIN_PREFILL_BUCKET_ROWS
    while rows < max_rows:
        prompt_rows.append(rows)
        rows *= 2
    return [rows + running_rows for rows in [*prompt_rows, max_rows]]


def replay_cost(rows: int, buckets: Sequence[int]) -> int:
    """The rows a prefill replay of ``rows`` rows computes (its bucket's, the smallest of ``buckets`` that holds
    them), counted as `MIN_REPLAY_COST_ROWS` at least: what `group_prompts` weighs."""
    bucket = next(b for b in buckets if b >= rows)
    return max(bucket, MIN_REPLAY_COST_ROWS)


def group_prompts(
    rows: Sequence[int], buckets: Sequence[int], max_prompts: int = MAX_PROMPTS_PER_GROUP
) -> list[list[int]]:
    """The prompts of a step, by their store-only rows ``rows`` (each at most the largest of ``buckets``), in
    groups that each replay one prefill graph (their indices, in order): the longest first, each prompt joins the
    first group whose replay it makes no more costly than a replay of its own would be (`replay_cost`: a larger
    bucket for the group, or none, against its own bucket and weight read), else starts a group."""
    groups: list[list[int]] = []
    totals: list[int] = []
    for index in sorted(range(len(rows)), key=lambda i: -rows[i]):
        own = replay_cost(rows[index], buckets)
        for g, total in enumerate(totals):
            joined = total + rows[index]
            if (
                len(groups[g]) < max_prompts
                and joined <= buckets[-1]
                and replay_cost(joined, buckets) <= replay_cost(total, buckets) + own
            ):
                groups[g].append(index)
                totals[g] = joined
                break
        else:
            groups.append([index])
            totals.append(rows[index])
    return [sorted(group) for group in groups]


class PrefillGraphs:
    """One single-request graph set per row bucket, for the store-only prefix of one request at a time, or a lone
    request's whole step (`prefill_buckets`: ``max_rows`` prompt rows and ``running_rows`` more at most); and one
    group graph set per row bucket (``max_rows`` at most, no running set), whose replay stores the store-only
    prefixes of up to `MAX_PROMPTS_PER_GROUP` prompts at once (`group_prompts`).

    With ``capture=False`` (no CUDA) the padded buffers run through the eager forward, as `DecodeGraphs` does.
    """

    def __init__(
        self,
        max_rows: int,
        running_rows: int,
        max_pages: int,
        max_kv_len: int,
        block_size: int,
        page_size: int,
        forward: Forward,
        device: torch.device,
        capture: bool,
    ) -> None:
        if max_rows < 1:
            raise ValueError(f"prefill graphs need at least one row, got max_rows={max_rows}")
        self.max_pages = max_pages

        def graphs_of(rows: int, requests: int) -> DecodeGraphs:
            """One bucket of ``rows`` rows that ``requests`` requests or fewer share however long each is."""
            shape = GraphShape(
                max_requests=requests,
                max_query_len=rows,
                max_pages=max_pages,
                max_kv_len=max_kv_len,
                block_size=block_size,
                page_size=page_size,
                prefix_full=False,  # only block-causal rows are split off (`Request.store_only_end`)
                total_rows=rows,
            )
            return DecodeGraphs(shape, forward, device, capture, snapshot_uploads=True, buckets=[requests])

        self.buckets = prefill_buckets(max_rows, running_rows)
        self.graphs = {rows: graphs_of(rows, 1) for rows in self.buckets}
        self.group_buckets = prefill_buckets(max_rows)
        self.group_graphs = {rows: graphs_of(rows, MAX_PROMPTS_PER_GROUP) for rows in self.group_buckets}

    def _set_for(self, part: StepInputs) -> tuple[list[int], dict[int, DecodeGraphs], int]:
        """The buckets, graphs and request count of the set that runs ``part``: the one-request graphs for one
        request, the group graphs for several."""
        if part.num_requests == 1:
            return self.buckets, self.graphs, 1
        return self.group_buckets, self.group_graphs, MAX_PROMPTS_PER_GROUP

    def bucket_for(self, part: StepInputs) -> int | None:
        """The rows of the smallest bucket that holds the store-only rows of ``part``'s request, or of its group of
        requests, or None (the step is eager)."""
        if not 0 < part.num_requests <= MAX_PROMPTS_PER_GROUP or part.max_pages > self.max_pages or part.soft_rows:
            return None
        buckets, _, _ = self._set_for(part)
        return next((rows for rows in buckets if rows >= part.num_tokens), None)

    def run(self, part: StepInputs, rows: int) -> torch.Tensor:
        """Queue the bucket's forward over ``part`` (its K/V stored into the cache); returns its padded hidden
        states, which nothing reads but an event may follow."""
        _, graphs, requests = self._set_for(part)
        hidden, _ = graphs[rows].run(part, requests)
        return hidden

    def _all(self) -> list[DecodeGraphs]:
        """Every graph set, the one of the most rows first (the order of capture: a later one reuses the memory the
        larger ones' captures freed)."""
        every = [*self.graphs.values(), *self.group_graphs.values()]
        return sorted(every, key=lambda graphs: -graphs.shape.max_tokens)

    @property
    def num_replays(self) -> int:
        """Replays of captured graphs so far (`ModelRunner.graph_replays`)."""
        return sum(graphs.num_replays for graphs in self._all())

    def warm_up(self) -> None:
        """Run every bucket's forward once on its placeholder batch, as `capture` does first (a build's dry pass runs
        this alone: `diffulex.kernels.parallel_compile`)."""
        for graphs in self._all():
            graphs.warm_up()

    def capture(self, pool=None) -> None:
        """Capture every bucket, largest first, into ``pool`` (the decode graphs', where there are some)."""
        for graphs in self._all():
            graphs.capture(pool=pool, log=False)
            pool = graphs.pool if graphs.pool is not None else pool
        if any(graphs.pool is not None for graphs in self._all()):
            logger.info(
                "captured %d prefill CUDA graphs (rows %s, one request each; rows %s, up to %d prompts each)",
                len(self.buckets) + len(self.group_buckets), self.buckets, self.group_buckets, MAX_PROMPTS_PER_GROUP,
            )

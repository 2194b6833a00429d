"""Steps that carry a prompt stay on the graph path: each request's store-only prompt rows replay a prefill graph,
then the rest of the step (the decoders, and that request's running set) replays the decode graphs, with exactly
the eager engine's tokens; or, where the whole step fits them (a short prompt or chunk beside decoders), the step
replays the chunk graphs in one forward.

On the CPU the graphs' padded buffers run through the eager forward (``capture=False``), as in test_cuda_graph.py:
what can go wrong in our code (where a step is split, which rows store, which rows the rest reads from the cache,
the padding of each bucket, the order of the replays) goes wrong there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from diffulex import SamplingParams
from diffulex.engine.prefill_graphs import (
    GROUP_MAX_CONTEXT_KEYS,
    MAX_PROMPTS_PER_GROUP,
    MIN_DECODERS_PER_SPLIT_PROMPT,
    MIN_REPLAY_COST_ROWS,
    group_prompts,
    prefill_buckets,
)
from diffulex.engine.step_inputs import StepInputs
from diffulex.testing.arrivals import serve_arrivals
from tests.engine.test_engine_matches_reference import make_engine, random_prompts, shifted_sdar_family

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@dataclass
class Replays:
    """What the graph path ran, in order: ``("prefill", part, rows)``, ``("decode", step, bucket)``,
    ``("chunk", step, bucket)`` and ``("straggler", step, bucket)``."""

    events: list[tuple[str, StepInputs, int]] = field(default_factory=list)

    @property
    def prefills(self) -> list[StepInputs]:
        return [step for kind, step, _ in self.events if kind == "prefill"]

    @property
    def chunk_steps(self) -> list[StepInputs]:
        return [step for kind, step, _ in self.events if kind == "chunk"]

    @property
    def straggler_steps(self) -> list[StepInputs]:
        return [step for kind, step, _ in self.events if kind == "straggler"]

    def prefills_before_a_decode_of(self, min_requests: int) -> int:
        """Prefill replays directly followed (after the step's other prefills) by a decode graph of at least
        ``min_requests`` requests: prompts computed on the graph path beside decoders."""
        count = 0
        pending = 0
        for kind, step, _ in self.events:
            if kind == "prefill":
                pending += 1
                continue
            if step.num_requests >= min_requests:
                count += pending
            pending = 0
        return count


def record_replays(llm) -> Replays:
    """Wrap the runner's decode, prefill, chunk and straggler graphs so the test sees every run of the graph
    path."""
    replays = Replays()
    runner = llm.runner

    def recording(kind, run):
        def wrapped(step, bucket, *args):
            replays.events.append((kind, step, bucket))
            return run(step, bucket, *args)

        return wrapped

    runner.graphs.run = recording("decode", runner.graphs.run)
    if runner.prefill_graphs is not None:
        runner.prefill_graphs.run = recording("prefill", runner.prefill_graphs.run)
    if runner.chunk_graphs is not None:
        runner.chunk_graphs.run = recording("chunk", runner.chunk_graphs.run)
    if runner.straggler_graphs is not None:
        runner.straggler_graphs.run = recording("straggler", runner.straggler_graphs.run)
    return replays


def static_engine(model_dir: Path, chunk_graphs: bool = False, **fields):
    """An engine on the graph path, uncaptured; without ``chunk_graphs`` every step that carries a prompt splits
    into prefill replays and the rest."""
    llm = make_engine(model_dir, **fields)
    llm.enable_static_decode(capture=False)
    if not chunk_graphs:
        llm.runner.chunk_graphs = None
    return llm


@dataclass
class ArrivalRun:
    """One arrival scenario through the eager engine and through the graph path (uncaptured)."""

    prompts: list[list[int]]
    expected: list[list[int]]  # the eager engine's tokens, in prompt order
    got: list[list[int]]  # the graph path's
    eager_steps: int  # steps the graph path ran eagerly
    replays: Replays


def eager_then_graphed(
    model_dir: Path, fields: dict, make_prompts, params: SamplingParams, gap: int, chunk_graphs: bool = False
) -> ArrivalRun:
    """`serve_arrivals` of ``make_prompts(engine)`` on an eager engine, then on a graph-path engine of the same
    fields, recording the latter's replays."""
    with make_engine(model_dir, **fields) as eager:
        prompts = make_prompts(eager)
        expected = serve_arrivals(eager, prompts, params, gap)
    with static_engine(model_dir, chunk_graphs, **fields) as llm:
        replays = record_replays(llm)
        got = serve_arrivals(llm, prompts, params, gap)
        eager_steps = llm.runner.eager_steps
    return ArrivalRun(prompts, expected, got, eager_steps, replays)


def test_prefill_buckets_double_from_sixteen_up_to_the_largest() -> None:
    assert prefill_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(9) == [9]


def test_each_prefill_bucket_also_holds_a_running_set() -> None:
    """A lone prompt of a power of two of tokens and its first block replay one bucket."""
    assert prefill_buckets(2048, 4) == [20, 36, 68, 132, 260, 516, 1028, 2052]
    assert prefill_buckets(100, 9) == [25, 41, 73, 109]


BUCKETS = prefill_buckets(2048)


def test_prompts_join_a_group_where_its_replay_costs_no_more_than_their_own() -> None:
    """Longest first: 200 beside 350 would take the group from 512 rows to 1,024 (more than its own 256), so it
    starts a group; the other 200 joins it (512 rows, no more than 256 + 256); 100 and 40 fit the first group's
    512 rows."""
    groups = group_prompts([40, 350, 200, 200, 100], BUCKETS)
    assert sorted(groups) == [[0, 1, 4], [2, 3]]


def test_short_prompts_share_a_replay_that_costs_what_one_weight_read_does() -> None:
    assert MIN_REPLAY_COST_ROWS >= 64
    assert group_prompts([20, 30, 40], BUCKETS) == [[0, 1, 2]], "one bucket of 128 rows for three short prompts"


def test_a_group_holds_at_most_the_largest_bucket_and_the_most_prompts_a_group_graph_holds() -> None:
    assert sorted(group_prompts([1500, 1000], BUCKETS)) == [[0], [1]], "2,500 rows fit no bucket"
    many = group_prompts([4] * (MAX_PROMPTS_PER_GROUP + 1), BUCKETS)
    assert sorted(len(group) for group in many) == [1, MAX_PROMPTS_PER_GROUP]


def test_prompts_admitted_together_store_their_prefixes_in_one_group_replay_with_the_eager_tokens(
    peaky_sdar_dir: Path,
) -> None:
    """Five prompts at once: their store-only rows (whole blocks of each) replay one group graph, every weight
    read once, and the tokens are the eager engine's."""
    fields = dict(buffer_size=2, accept_threshold=0.7, max_num_reqs=8)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    lengths = [9, 14, 21, 26, 17]
    with make_engine(peaky_sdar_dir, **fields) as eager:
        prompts = random_prompts(eager, lengths, seed=46)
        expected = eager.generate(prompts, params, use_tqdm=False)
    with static_engine(peaky_sdar_dir, **fields) as llm:
        replays = record_replays(llm)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert llm.runner.eager_steps == 0
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]
    first = replays.prefills[0]
    assert first.num_requests == len(lengths), "every prompt's prefix in the step's one prefill replay"
    assert len(replays.prefills) == 1, "no other prefill replay"


def test_a_prompt_after_a_long_cached_context_replays_alone_beside_a_group(peaky_sdar_dir: Path) -> None:
    """A prefix-cache hit of `GROUP_MAX_CONTEXT_KEYS` cached keys or more keeps a prefill replay of its own (its
    attention's keys split there), while the short prompts admitted with it share one."""
    fields = dict(buffer_size=1, accept_threshold=0.7, max_num_reqs=8, max_model_len=GROUP_MAX_CONTEXT_KEYS + 96,
                  max_num_batched_tokens=2 * GROUP_MAX_CONTEXT_KEYS, enable_prefix_caching=True)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def serve(llm) -> list[list[int]]:
        long, short_a, short_b, tail = random_prompts(llm, [GROUP_MAX_CONTEXT_KEYS + 8, 10, 13, 9], seed=47)
        first = llm.generate([long], params, use_tqdm=False).trajectories[0].token_ids
        later = [long + tail, short_a, short_b]
        return [first] + [t.token_ids for t in llm.generate(later, params, use_tqdm=False).trajectories]

    with make_engine(peaky_sdar_dir, **fields) as eager:
        expected = serve(eager)
    with static_engine(peaky_sdar_dir, **fields) as llm:
        replays = record_replays(llm)
        got = serve(llm)
    assert got == expected
    hit = [part for part in replays.prefills if part.context_lens[0] >= GROUP_MAX_CONTEXT_KEYS]
    assert len(hit) == 1 and hit[0].num_requests == 1, "the tail after the long cached context alone"
    grouped = [part for part in replays.prefills if part.num_requests == 2]
    assert len(grouped) == 1 and grouped[0].context_lens == [0, 0], "the two short prompts together"


@pytest.mark.parametrize("shifted", [False, True], ids=["sdar", "shifted"])
def test_requests_arriving_while_others_decode_replay_prefill_graphs_with_the_eager_tokens(
    peaky_sdar_dir: Path, shifted: bool
) -> None:
    # each prompt admitted at the step after its arrival, beside the decoders (not grouped with later arrivals)
    fields = dict(buffer_size=2, accept_threshold=0.7, max_num_reqs=8, admission_delay_steps=0)
    if shifted:
        fields["model_name"] = shifted_sdar_family().name
    lengths = [9, 14, 21, 6, 17, 30, 12]
    run = eager_then_graphed(peaky_sdar_dir, fields, lambda llm: random_prompts(llm, lengths, seed=41), GREEDY, 2)
    assert run.got == run.expected
    assert run.eager_steps == 0, "every step, those carrying a prompt too, ran on the graph path"
    assert run.replays.prefills_before_a_decode_of(min_requests=2) >= len(lengths) - 1, "prompts beside decoders"
    assert all(part.num_requests == 1 for part in run.replays.prefills), "one request a replay"
    sampling = [part for part in run.replays.prefills if part.sample_rows]
    assert len(sampling) <= 1, "only a prompt arriving alone (the first) samples its first block in its replay"


def test_a_long_prompt_chunked_beside_eight_decoders_stays_on_the_graph_path(peaky_sdar_dir: Path) -> None:
    """With chunked prefill the scheduler keeps each chunk beside the decoders within the largest prefill graph
    (here 17 rows: four blocks and the recomputed row), however large the token budget."""
    fields = dict(buffer_size=1, accept_threshold=0.7, max_num_reqs=12, enable_chunked_prefill=True,
                  max_num_batched_tokens=96, max_prefill_graph_tokens=17)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    lengths = [6, 3, 9, 5, 7, 2, 10, 4, 110]
    run = eager_then_graphed(peaky_sdar_dir, fields, lambda llm: random_prompts(llm, lengths, seed=42), params, 1)
    assert run.got == run.expected
    assert run.eager_steps == 0
    long_rows = [part.num_tokens for part in run.replays.prefills if part.prefix_lens == [110]]
    assert len(long_rows) >= 110 // 17, "the long prompt took several chunks"
    assert max(long_rows) <= 17
    assert run.replays.prefills_before_a_decode_of(min_requests=8) >= 3, "chunks replayed beside the eight decoders"


@pytest.mark.parametrize("shifted", [False, True], ids=["sdar", "shifted"])
def test_prompts_arriving_beside_decoders_ride_with_them_in_one_chunk_graph_forward(
    peaky_sdar_dir: Path, shifted: bool
) -> None:
    """With the chunk graphs and no continued steps, a step whose new prompt fits them runs whole in one forward
    (every weight read once), with the eager engine's tokens; no prefill graph is replayed for those prompts."""
    # each prompt admitted at the step after its arrival, beside the decoders (not grouped with later arrivals)
    fields = dict(buffer_size=2, accept_threshold=0.7, max_num_reqs=8, admission_delay_steps=0, async_scheduling=False)
    if shifted:
        fields["model_name"] = shifted_sdar_family().name
    lengths = [9, 14, 21, 6, 17, 30, 12]
    run = eager_then_graphed(peaky_sdar_dir, fields, lambda llm: random_prompts(llm, lengths, seed=41), GREEDY, 2,
                             chunk_graphs=True)  # fmt: skip
    assert run.got == run.expected
    assert run.eager_steps == 0
    beside = [step for step in run.replays.chunk_steps if step.num_requests >= 2]
    assert len(beside) >= len(lengths) - 1, "prompts beside decoders, in one forward with them"
    assert max(step.num_tokens - 2 * 4 * (step.num_requests - 1) for step in beside) > 8, "a prompt's rows ride"


def test_chunks_of_a_long_prompt_beside_eight_decoders_ride_in_the_chunk_graphs(peaky_sdar_dir: Path) -> None:
    """Chunked prefill beside eight decoders: each chunk step replays the chunk graphs whole, the long prompt's
    chunk and the decoders' blocks in one forward, with the eager engine's tokens."""
    fields = dict(buffer_size=1, accept_threshold=0.7, max_num_reqs=12, enable_chunked_prefill=True,
                  max_num_batched_tokens=96, max_prefill_graph_tokens=17)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    lengths = [6, 3, 9, 5, 7, 2, 10, 4, 110]
    run = eager_then_graphed(peaky_sdar_dir, fields, lambda llm: random_prompts(llm, lengths, seed=42), params, 1,
                             chunk_graphs=True)  # fmt: skip
    assert run.got == run.expected
    assert run.eager_steps == 0
    long_steps = [step for step in run.replays.chunk_steps if 110 in step.prefix_lens and step.num_requests >= 8]
    assert len(long_steps) >= 3, "chunks of the long prompt beside the decoders, in the chunk graphs"


def test_one_context_standing_out_among_decoders_sends_the_step_to_the_chunk_graphs() -> None:
    from diffulex.engine.prefill_graphs import CHUNK_CONTEXT_MIN_KEYS, has_straggling_context

    long = 16 * CHUNK_CONTEXT_MIN_KEYS
    assert has_straggling_context([300] * 32 + [long]), "one long context among 32 short ones"
    assert not has_straggling_context([long] * 32), "balanced long contexts fill the grid evenly"
    assert not has_straggling_context([10] * 32 + [CHUNK_CONTEXT_MIN_KEYS - 1]), "too short to split"
    assert not has_straggling_context([long, long // 2]), "two contexts of the same order"
    assert not has_straggling_context([])


def test_decoders_beside_a_long_context_ride_in_the_straggler_graphs_with_the_eager_tokens(
    peaky_sdar_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a long prompt decodes among short decoders, their decode steps replay the straggler graphs (the decode
    graphs' shape, whose attention splits the long context) with the eager engine's tokens; the chunk graphs take
    only steps that carry a prompt. The length that counts as long is lowered to the tiny model's scale."""
    import diffulex.engine.prefill_graphs as prefill_graphs

    monkeypatch.setattr(prefill_graphs, "CHUNK_CONTEXT_MIN_KEYS", 64)
    fields = dict(buffer_size=1, accept_threshold=0.7, max_num_reqs=12, max_model_len=320)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    lengths = [200, 6, 3, 9, 5, 7, 2, 10, 4]
    run = eager_then_graphed(peaky_sdar_dir, fields, lambda llm: random_prompts(llm, lengths, seed=43), params, 1,
                             chunk_graphs=True)  # fmt: skip
    assert run.got == run.expected
    assert run.eager_steps == 0
    decode_rows = 4  # one block of four a request
    decodes = run.replays.straggler_steps
    assert len(decodes) >= 3, "decode steps with the long context among the decoders, in the straggler graphs"
    assert all(step.num_tokens <= decode_rows * step.num_requests for step in decodes), "decode steps only"


def test_a_prompt_split_off_beside_a_long_context_leaves_the_decoders_step_on_the_straggler_graphs(
    peaky_sdar_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A short prompt arriving beside enough decoders to run apart (`MIN_DECODERS_PER_SPLIT_PROMPT`) replays a
    prefill graph of its own; the rest of its step, the decoders among which one context stands out, replays the
    straggler graphs, as their decode steps do, with the eager engine's tokens."""
    import diffulex.engine.prefill_graphs as prefill_graphs

    monkeypatch.setattr(prefill_graphs, "CHUNK_CONTEXT_MIN_KEYS", 64)
    fields = dict(buffer_size=1, accept_threshold=0.7, max_num_reqs=16, max_model_len=320)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    lengths = [200, 6, 3, 9, 5, 7, 2, 10, 4, 6, 8, 5, 7]
    run = eager_then_graphed(peaky_sdar_dir, fields, lambda llm: random_prompts(llm, lengths, seed=43), params, 1,
                             chunk_graphs=True)  # fmt: skip
    assert run.got == run.expected
    assert run.eager_steps == 0
    assert len(lengths) > MIN_DECODERS_PER_SPLIT_PROMPT + 1, "the last prompts arrive beside enough decoders"
    events = run.replays.events
    kinds_after_a_prompt = [after for (kind, _, _), (after, _, _) in zip(events, events[1:], strict=False)
                            if kind == "prefill"]  # fmt: skip
    assert "straggler" in kinds_after_a_prompt, "a split step's rest on the straggler graphs"


def test_decode_steps_on_the_straggler_graphs_are_continued_on_them_with_the_eager_tokens(
    peaky_sdar_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode step among a context that stands out replays the straggler graphs; its successor is queued on them
    before its result is read (a continuation), as on the decode graphs, and the tokens stay the eager engine's.
    Equal prompts and one token a step (threshold 1) keep the decoders' blocks in step, so that most steps may be
    continued."""
    import diffulex.engine.prefill_graphs as prefill_graphs

    monkeypatch.setattr(prefill_graphs, "CHUNK_CONTEXT_MIN_KEYS", 64)
    fields = dict(buffer_size=1, accept_threshold=1.0, max_num_reqs=12, max_model_len=320)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with make_engine(peaky_sdar_dir, **fields) as eager:
        prompts = random_prompts(eager, [250] + [4] * 8, seed=47)
        expected = eager.generate(prompts, params, use_tqdm=False)
    with static_engine(peaky_sdar_dir, chunk_graphs=True, **fields) as llm:
        straggler = llm.runner.straggler_graphs
        continued = []
        replay_continuation = straggler.replay_continuation
        straggler.replay_continuation = lambda *args: continued.append(args) or replay_continuation(*args)
        got = llm.generate(prompts, params, use_tqdm=False)
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]
    assert len(continued) >= 10, "decode steps beside the long context continued on the straggler graphs"


def test_without_prefill_graphs_the_steps_with_a_standing_out_context_still_ride_in_the_straggler_graphs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """d2f, whose prompt rows see the whole prompt, has no prefill graphs (nor chunk graphs), so its steps that
    carry a prompt stay eager; the straggler graphs are built (a context may stand out at this model length) and
    take the decode steps where the long prompt's context stands out among short ones, with the eager engine's
    tokens."""
    import diffulex.engine.prefill_graphs as prefill_graphs
    from diffulex.testing.checkpoints import write_tiny_checkpoint

    monkeypatch.setattr(prefill_graphs, "CHUNK_CONTEXT_MIN_KEYS", 64)
    model = write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=2, init_std=1.0)
    fields = dict(decoding_strategy="d2f", buffer_size=2, accept_threshold=0.7, max_num_reqs=12, max_model_len=320)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    lengths = [250, 6, 3, 9, 5, 7, 2, 10]
    run = eager_then_graphed(model, fields, lambda llm: random_prompts(llm, lengths, seed=45), params, 1,
                             chunk_graphs=True)  # fmt: skip
    assert run.got == run.expected
    assert run.replays.prefills == [], "no prefill graphs"
    assert run.eager_steps >= 2, "each step carrying a prompt ran eagerly"
    assert run.replays.chunk_steps == [], "no chunk graphs"
    assert len(run.replays.straggler_steps) >= 3, "decode steps beside the long context, in the straggler graphs"
    assert all(step.num_tokens < 250 for step in run.replays.straggler_steps), "no prompt rode in them"


def test_the_chunk_graphs_fix_the_split_of_long_contexts_and_widen_the_decode_buckets() -> None:
    from diffulex.engine.cuda_graph import GraphShape
    from diffulex.engine.prefill_graphs import (
        CHUNK_EXTRA_ROWS_PER_REQUEST,
        CHUNK_MIN_SPLIT_KEYS,
        CHUNK_SPLITS,
        chunk_graph_shape,
    )

    decode = GraphShape(max_requests=48, max_query_len=5, max_pages=64, max_kv_len=1024, block_size=4, page_size=16,
                        prefix_full=False)  # fmt: skip
    chunk = chunk_graph_shape(decode, 64)
    assert chunk.max_query_len == 64 and chunk.max_requests == 48 and chunk.max_kv_len == 1024
    assert chunk.rows_per_request == 5 + CHUNK_EXTRA_ROWS_PER_REQUEST
    assert chunk.bucket_rows(32) >= 31 * 5 + 64, "a full chunk beside 31 decoders fits a bucket of 32"
    assert (chunk.num_splits, chunk.min_split_keys) == (CHUNK_SPLITS, CHUNK_MIN_SPLIT_KEYS)
    assert decode.num_splits is None and decode.min_split_keys is None


def test_the_straggler_graphs_are_the_decode_graphs_with_the_split_of_long_contexts_fixed() -> None:
    """Decode-sized query tiles for decode steps (the chunk graphs' 64-row requests take 64-row tiles)."""
    from diffulex.engine.cuda_graph import GraphShape
    from diffulex.engine.prefill_graphs import CHUNK_MIN_SPLIT_KEYS, CHUNK_SPLITS, straggler_graph_shape

    decode = GraphShape(max_requests=48, max_query_len=5, max_pages=64, max_kv_len=1024, block_size=4, page_size=16,
                        prefix_full=False, key_tails=True)  # fmt: skip
    straggler = straggler_graph_shape(decode)
    assert (straggler.num_splits, straggler.min_split_keys) == (CHUNK_SPLITS, CHUNK_MIN_SPLIT_KEYS)
    assert straggler.max_query_len == 5 and straggler.rows_per_request == decode.rows_per_request
    assert straggler.key_tails and straggler.bucket_rows(32) == decode.bucket_rows(32)


def test_chunks_of_a_prompt_alone_are_steps_of_prefill_replays_only(peaky_sdar_dir: Path) -> None:
    """Without decoders beside it a chunk takes the whole budget; a chunk samples nothing, so its step is its
    prefill replay and no decode graph."""
    fields = dict(buffer_size=1, accept_threshold=0.7, enable_chunked_prefill=True, max_num_batched_tokens=16)
    run = eager_then_graphed(peaky_sdar_dir, fields, lambda llm: random_prompts(llm, [70], seed=45), GREEDY, 1)
    assert run.got == run.expected
    assert run.eager_steps == 0
    kinds = [kind for kind, _, _ in run.replays.events]
    assert kinds[:4] == ["prefill"] * 4, "four chunks of 16 rows, each a step of its own"
    assert [part.num_tokens for part in run.replays.prefills[:4]] == [16] * 4


def test_a_prefix_cache_hit_replays_its_uncached_tail_in_a_prefill_graph(peaky_sdar_dir: Path) -> None:
    family = shifted_sdar_family()
    for model_name in ("sdar", family.name):
        fields = dict(model_name=model_name, buffer_size=2, accept_threshold=0.7, enable_prefix_caching=True)

        def with_follow_up(llm) -> list[list[int]]:
            first, other = random_prompts(llm, [24, 7], seed=43)
            return [first, other, first[:16] + other[:5] + first[:11]]

        run = eager_then_graphed(peaky_sdar_dir, fields, with_follow_up, GREEDY, 3)
        follow_up = run.prompts[2]
        assert run.got == run.expected, model_name
        assert run.eager_steps == 0, model_name
        tails = [(part, i) for part in run.replays.prefills for i, n in enumerate(part.prefix_lens)
                 if n == len(follow_up)]  # fmt: skip
        assert len(tails) == 1, f"{model_name}: the tail replayed once"
        part, i = tails[0]
        assert part.context_lens[i] > 0, f"{model_name}: the tail read the cached prefix"
        first_row = part.positions[part.cu_seqlens_q[i]]
        assert first_row == part.context_lens[i] >= 16 - int(model_name == family.name)


def test_a_preempted_request_rebuilds_its_committed_blocks_in_a_prefill_graph(peaky_sdar_dir: Path) -> None:
    fields = dict(buffer_size=2, accept_threshold=0.7, num_pages=12, max_num_reqs=4)
    params = SamplingParams(temperature=0.0, max_tokens=40)
    with make_engine(peaky_sdar_dir, **fields) as eager:
        prompts = random_prompts(eager, [9, 14, 6, 11], seed=21)
        expected = eager.generate(prompts, params, use_tqdm=False).trajectories
    assert sum(t.num_preemptions for t in expected) > 0, "the pool should be too small for all four"
    with static_engine(peaky_sdar_dir, **fields) as llm:
        replays = record_replays(llm)
        got = llm.generate(prompts, params, use_tqdm=False).trajectories
        eager_steps = llm.runner.eager_steps
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert eager_steps == 0
    rebuilt = [part for part in replays.prefills if part.positions[-1] >= part.prefix_lens[0]]
    assert rebuilt, "a rebuild stores generated blocks, past the prompt, through a prefill graph"


def test_d2f_whose_prompt_rows_see_the_whole_prompt_keeps_its_prompts_eager(tmp_path: Path) -> None:
    from diffulex.testing.checkpoints import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path / "dream", family="dream", seed=2, init_std=1.0)
    fields = dict(decoding_strategy="d2f", buffer_size=2, accept_threshold=0.7, admission_delay_steps=0)
    with make_engine(model, **fields) as eager:
        prompts = random_prompts(eager, [4, 9, 13], seed=7)
        expected = serve_arrivals(eager, prompts, GREEDY, gap=2)
    with static_engine(model, **fields) as llm:
        assert llm.runner.prefill_graphs is None
        got = serve_arrivals(llm, prompts, GREEDY, gap=2)
        eager_steps = llm.runner.eager_steps
    assert got == expected
    assert eager_steps >= 2, "each step carrying a prompt of full blocks ran eagerly"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured CUDA graphs need a GPU")
def test_captured_prefill_graphs_replay_with_the_eager_tokens(peaky_sdar_dir: Path) -> None:
    # each prompt admitted at the step after its arrival (not grouped with later arrivals): one replay per prompt
    fields = dict(buffer_size=2, accept_threshold=0.7, max_num_reqs=8, dtype="float32", device_start=0,
                  admission_delay_steps=0)  # fmt: skip
    lengths = [9, 14, 21, 6, 17, 30, 12, 90]  # the longest is wider than the chunk graphs
    with make_engine(peaky_sdar_dir, enforce_eager=True, **fields) as eager:
        prompts = random_prompts(eager, lengths, seed=41)
        expected = serve_arrivals(eager, prompts, GREEDY, gap=2)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        got = serve_arrivals(llm, prompts, GREEDY, gap=2)
        runner = llm.runner
        assert runner.prefill_graphs is not None and runner.eager_steps == 0
        prompt_replays = runner.prefill_replays + (runner.chunk_graphs.num_replays if runner.chunk_graphs else 0)
        assert prompt_replays >= len(lengths), "every prompt's rows replayed a captured prefill or chunk graph"
        assert runner.prefill_replays >= 1, "the prompt wider than the chunk graphs replayed a prefill graph"
    assert got == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captured CUDA graphs need a GPU")
def test_captured_group_graphs_store_prompts_admitted_together_with_the_eager_tokens(peaky_sdar_dir: Path) -> None:
    fields = dict(buffer_size=2, accept_threshold=0.7, max_num_reqs=8, max_model_len=320, dtype="float32",
                  device_start=0)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    lengths = [9, 14, 21, 26, 17, 90]  # the longest is wider than the chunk graphs: the step splits
    with make_engine(peaky_sdar_dir, enforce_eager=True, **fields) as eager:
        prompts = random_prompts(eager, lengths, seed=48)
        expected = eager.generate(prompts, params, use_tqdm=False)
    with make_engine(peaky_sdar_dir, **fields) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.runner
        assert runner.eager_steps == 0
        group_replays = sum(graphs.num_replays for graphs in runner.prefill_graphs.group_graphs.values())
        assert group_replays == 1, "the six prompts' prefixes in one captured group replay"
    assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories]


def test_a_prompt_longer_than_the_largest_prefill_graph_runs_its_step_eagerly(peaky_sdar_dir: Path) -> None:
    fields = dict(buffer_size=1, accept_threshold=0.7, max_prefill_graph_tokens=17)
    run = eager_then_graphed(peaky_sdar_dir, fields, lambda llm: random_prompts(llm, [6, 40], seed=44), GREEDY, 2)
    assert run.got == run.expected
    assert run.eager_steps == 1, "only the long prompt's step"
    assert all(part.num_tokens <= 17 for part in run.replays.prefills)


@pytest.mark.parametrize("shifted", [False, True], ids=["sdar", "shifted"])
def test_a_lone_prompt_and_its_first_block_run_in_one_prefill_graph_forward(
    peaky_sdar_dir: Path, shifted: bool
) -> None:
    """A request alone: its store-only prompt rows and the block it samples from replay one prefill bucket together
    (one forward, the block's rows sampled after it), the smallest that holds both: each bucket holds a power of two
    of prompt rows and a running set's (4 rows, 5 for a shifted family), so a prompt of 32 or 64 tokens fits its
    own. Only a step that no bucket holds splits (a prompt longer than the largest bucket's prompt rows: its block
    replays a decode graph). The tokens are the eager engine's."""
    fields = dict(buffer_size=1, accept_threshold=0.7, max_num_reqs=4, max_prefill_graph_tokens=64)
    if shifted:
        fields["model_name"] = shifted_sdar_family().name
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    running = 5 if shifted else 4
    for length, rows, bucket in ((21, 24, 32 + running), (32, 36, 32 + running), (64, 68, 64 + running),
                                 (68, 68, 64 + running)):  # fmt: skip
        with make_engine(peaky_sdar_dir, **fields) as eager:
            prompts = random_prompts(eager, [length], seed=length)
            expected = eager.generate(prompts, params, use_tqdm=False)
        with static_engine(peaky_sdar_dir, **fields) as llm:
            replays = record_replays(llm)
            got = llm.generate(prompts, params, use_tqdm=False)
            assert llm.runner.eager_steps == 0
        assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in expected.trajectories], length
        (kind, first, first_bucket), (next_kind, _, _) = replays.events[:2]
        assert (kind, first_bucket) == ("prefill", bucket), f"a {length}-token prompt's first forward and its bucket"
        assert first.num_tokens == rows
        assert bool(first.sample_rows) == (length < 68), f"a {length}-token prompt's block sampled in that forward"
        assert next_kind == "decode"
        unsampled = sum(1 for _, step, _ in replays.events if not step.sample_rows)
        assert unsampled == (length == 68), "a forward without rows to sample only where the step split"

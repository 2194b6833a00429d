"""A prefix-cache hit on a prompt of many pages: the tokens of the reference decoder (float32, eager and on the
graph path), and host work after the lookup that follows the uncached tail, not the prompt: the hit's steps make
only the blocks they compute, and stage each page-table entry once."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffulex import SamplingParams
from tests.engine.test_engine_matches_reference import assert_matches_reference, make_engine, random_prompts
from tests.engine.test_prefill_graphs import record_replays, static_engine

PAGE = 8
BLOCK = 4
CACHED = 60 * PAGE  # the shared prefix: 60 pages, 120 blocks
TAIL = 13
LONG = dict(max_model_len=640, max_num_batched_tokens=640, enable_prefix_caching=True)
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def prompt_and_hit(llm, cached: int = CACHED) -> tuple[list[int], list[int]]:
    prompt, tail = random_prompts(llm, [cached + 1, TAIL], seed=11)
    return prompt, prompt[:cached] + tail


def test_a_hit_on_a_prompt_of_sixty_pages_gives_the_reference_tokens(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, **LONG) as llm:
        prompt, hit = prompt_and_hit(llm)
        assert_matches_reference(llm, [prompt], PARAMS)
        (traj,) = assert_matches_reference(llm, [hit], PARAMS)
    # the first step computes the tail and the block it ends in, not the shared pages
    assert traj.steps[0].query_len == -(-len(hit) // BLOCK) * BLOCK - CACHED


def test_a_hit_on_the_graph_path_replays_its_tail_against_sixty_cached_pages(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, **LONG) as eager:
        prompt, hit = prompt_and_hit(eager)
        expected = [t.token_ids for t in eager.generate([prompt, hit], PARAMS, use_tqdm=False).trajectories]
    with static_engine(peaky_sdar_dir, **LONG) as llm:
        replays = record_replays(llm)
        staged_tables = staged_page_tables(llm)
        llm.generate([prompt], PARAMS, use_tqdm=False)
        (got,) = llm.generate([hit], PARAMS, use_tqdm=False).trajectories
        assert llm.runner.eager_steps == 0
    assert got.token_ids == expected[1]
    (tail,) = [part for part in replays.prefills if part.prefix_lens == [len(hit)]]
    assert tail.context_lens == [CACHED]
    prompt_pages = staged_tables[0][: CACHED // PAGE]  # the first prompt's prefill, the first staging
    assert all(table[: CACHED // PAGE] == prompt_pages for table in staged_tables if len(table) >= CACHED // PAGE)
    assert len(staged_tables) > 2  # the tail's prefill and its decode steps read the shared pages too


def staged_page_tables(llm) -> list[list[int]]:
    """Every page table the graph path stages, as its static buffer received it (the first request's row)."""
    tables: list[list[int]] = []
    graph_sets = [llm.runner.graphs, *llm.runner.prefill_graphs.graphs.values()]
    for graphs in graph_sets:
        fill = graphs._fill

        def recorded(step, bucket, buffer=0, sampled=None, fill=fill, graphs=graphs):
            fill(step, bucket, buffer, sampled)
            start = graphs._head_len
            staged = graphs._layout_np[buffer][start : start + graphs.shape.max_pages].tolist()
            tables.append([page for page in staged if page >= 0])

        graphs._fill = recorded
    return tables


@pytest.mark.parametrize("cached", [20 * PAGE, CACHED])
def test_a_hit_makes_only_its_answer_blocks_however_long_the_prompt(
    peaky_sdar_dir: Path, cached: int
) -> None:
    with make_engine(peaky_sdar_dir, **LONG) as llm:
        prompt, hit = prompt_and_hit(llm, cached)
        llm.generate([prompt], PARAMS, use_tqdm=False)
        req_id = llm.add_request(hit, PARAMS)
        req = next(r for r in llm.scheduler.waiting if r.req_id == req_id)
        while not llm.is_finished():
            llm.step()
    assert req.num_cached_blocks * BLOCK >= cached
    # the answer's blocks (the one the prompt ends in included) and the prompt block before them (read for its
    # status), whatever the cached prefix's and the tail's length: the tail's blocks are stored without being made
    answer_end = len(hit) + PARAMS.max_tokens
    assert req.blocks.num_made == -(-answer_end // BLOCK) - len(hit) // BLOCK + 1

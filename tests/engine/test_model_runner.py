"""The inputs the runner stages for a step equal what walking every position and block of every request gives.

Each engine step below is intercepted right after the runner collected it (before its forward), and its rows are
compared with a straightforward reference: for every request of the batch, each position of its rows in turn, its
token, and its cache slot when the block holding it is stored (`Request.stores_kv`, read block by block, which
makes every block it reads), plus the request's layout and page table. Cold prompts of many pages, prefix-cache
hits, requests decoding beside them and a preempted request are all staged; so are the prefill graphs' split steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from diffulex import SamplingParams
from diffulex.engine.step_inputs import StepInputs
from diffulex.strategy.request import Request
from tests.engine.test_engine_matches_reference import make_engine, random_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
LONG = dict(max_model_len=640, max_num_batched_tokens=1024, enable_prefix_caching=True)


def reference_rows(req: Request, start: int, end: int, store_from: int, page_size: int):
    """Tokens, positions and slots of ``req``'s rows ``[start, end)``, position by position."""
    size = req.settings.block_size
    ids, positions, slots = [], [], []
    for position in range(start, end):
        ids.append(req.token_ids[position])
        positions.append(position)
        block = req.blocks[position // size]
        if position >= store_from and req.stores_kv(block):
            page = req.page_table[position // page_size]
            slots.append(page * page_size + position % page_size)
        else:
            slots.append(-1)
    return ids, positions, slots


def assert_staged(step: StepInputs, spans: list[tuple[Request, int, int, int]], page_size: int) -> None:
    """``step`` holds each ``(request, start, end, store_from)`` span in turn, as the reference stages it."""
    ids, positions, slots = [], [], []
    for req, start, end, store_from in spans:
        for got, expected in zip((ids, positions, slots), reference_rows(req, start, end, store_from, page_size),
                                 strict=True):  # fmt: skip
            got.extend(expected)
    assert np.asarray(step.input_ids).tolist() == ids
    assert np.asarray(step.positions).tolist() == positions
    assert np.asarray(step.slot_mapping).tolist() == slots
    assert step.query_lens == [end - start for _, start, end, _ in spans]
    assert step.context_lens == [start for _, start, _, _ in spans]
    assert step.cu_seqlens_q == list(np.cumsum([0] + step.query_lens))
    assert [list(t) for t in step.page_tables] == [list(req.page_table) for req, *_ in spans]


class StagingCheck:
    """Wraps the runner's `collect` and `collect_split` to compare every step they stage with the reference."""

    def __init__(self, llm) -> None:
        runner, self.page_size = llm.runner, llm.config.page_size
        self.steps = self.split_steps = self.prompt_rows = 0
        self.inside_prompt = 0  # spans that start inside their prompt: a prefix hit's tail (or a later chunk)
        collect, collect_split = runner.collect, runner.collect_split

        def checked_collect(batch):
            step = collect(batch)
            spans = [(req, *req.query_range(), req.query_range()[0]) for req in batch]
            assert_staged(step, spans, self.page_size)
            self.steps += 1
            self.prompt_rows += sum(max(0, min(end, req.prompt_len) - start) for req, start, end, _ in spans)
            self.inside_prompt += sum(0 < start < req.prompt_len for req, start, _, _ in spans)
            return step

        def checked_split(batch):
            split = collect_split(batch)
            if split is None:
                return None
            prefills = iter(split.prefills)
            rest = []
            for req in batch:
                start, end = req.query_range()
                prefix_end = req.store_only_end()
                if prefix_end is None or prefix_end <= start:
                    rest.append((req, start, end, start))
                    continue
                part, _ = next(prefills)
                assert_staged(part, [(req, start, prefix_end, start)], self.page_size)
                if end > prefix_end:
                    rest.append((req, prefix_end - int(req.settings.logits_shift), end, prefix_end))
            assert next(prefills, None) is None
            assert_staged(split.rest, rest, self.page_size)
            self.split_steps += 1
            return split

        runner.collect, runner.collect_split = checked_collect, checked_split


def serve(llm, prompts: list[list[int]], gap: int = 2) -> None:
    """Add the prompts ``gap`` steps apart, then run until every request finished."""
    for prompt in prompts:
        llm.add_request(prompt, PARAMS)
        for _ in range(gap):
            llm.step()
    while not llm.is_finished():
        llm.step()


def test_cold_prompts_of_many_pages_arriving_beside_decoders_are_staged_as_the_reference_stages_them(
    peaky_sdar_dir: Path,
) -> None:
    with make_engine(peaky_sdar_dir, **LONG) as llm:
        check = StagingCheck(llm)
        short, long, unaligned = random_prompts(llm, [9, 400, 301], seed=3)
        serve(llm, [short, long, unaligned])
    assert check.steps > 10 and check.prompt_rows >= 700


def test_prefix_hits_and_their_cold_twins_are_staged_as_the_reference_stages_them(peaky_sdar_dir: Path) -> None:
    with make_engine(peaky_sdar_dir, **LONG) as llm:
        check = StagingCheck(llm)
        prompt, tail = random_prompts(llm, [321, 37], seed=4)
        serve(llm, [prompt, prompt[:320] + tail, prompt[:200] + tail])  # the second and third hit the first's pages
        serve(llm, [prompt[:320] + tail[:5]])  # a hit on the pages the second registered too
    assert check.steps > 10 and check.inside_prompt >= 3


def test_preempted_requests_rebuilding_their_blocks_are_staged_as_the_reference_stages_them(
    peaky_sdar_dir: Path,
) -> None:
    # 10 pages of 8 tokens cannot hold eight requests of up to ~45 tokens: requests are preempted and rebuilt
    with make_engine(peaky_sdar_dir, buffer_size=2, accept_threshold=0.8, num_pages=10, max_model_len=64) as llm:
        check = StagingCheck(llm)
        prompts = random_prompts(llm, [3, 6, 9, 12, 14, 5, 7, 2], seed=8)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert sum(t.num_preemptions for t in outputs.trajectories) > 0 and check.steps > 10


def test_split_steps_of_the_prefill_graphs_are_staged_as_the_reference_stages_them(peaky_sdar_dir: Path) -> None:
    # one step in flight: every step is staged by the host (continuations would take most decode steps)
    with make_engine(peaky_sdar_dir, **LONG, max_prefill_graph_tokens=64, async_scheduling=False) as llm:
        llm.enable_static_decode(capture=False)
        check = StagingCheck(llm)
        short, mid, long = random_prompts(llm, [9, 50, 300], seed=7)
        serve(llm, [short, mid, long, mid[:40] + short])
    assert check.split_steps > 10


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_an_eager_steps_inputs_reach_the_device_without_holding_the_host(peaky_sdar_dir: Path) -> None:
    """Staged through pinned memory, an eager step's inputs never wait for the device: a copy from pageable memory
    would hold the host until the device has run everything queued before it (a step still in flight)."""
    with make_engine(peaky_sdar_dir, enforce_eager=True, **LONG) as llm:
        assert llm.runner.settings.device.type == "cuda"
        stage, staged = llm.runner._eager_inputs, []

        def without_syncs(step: StepInputs):
            torch.cuda.set_sync_debug_mode("error")  # a synchronizing call raises
            try:
                staged.append(stage(step))
            finally:
                torch.cuda.set_sync_debug_mode(0)
            return staged[-1]

        llm.runner._eager_inputs = without_syncs
        serve(llm, random_prompts(llm, [9, 300], seed=5))
    assert len(staged) > 5

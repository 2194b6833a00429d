"""Denoising steps whose decoder pass runs from a graph bucket's static buffers give exactly the eager tokens.

On the CPU the buffers run through the forward without capture: the part of the graph path that can go wrong in
our code (padding canvases, bucket choice, page tables and positions refilled in place, self-conditioning inputs
zeroed for first steps). On a GPU the same test captures and replays CUDA graphs (float32), against an engine with
``enforce_eager``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from diffulex import SamplingParams
from diffulex.strategy.diffusion_gemma import graphs
from diffulex.strategy.diffusion_gemma.graphs import bucket_for
from tests.strategy.test_diffusion_gemma_strategy import engine, folder, one_thread, prompts  # noqa: F401

BUCKETS = (1, 2, 4, 8)


def test_a_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    assert [bucket_for(n, BUCKETS) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert bucket_for(1, ()) is None


def test_static_decoder_steps_give_the_eager_tokens(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    """Five requests (greedy and sampled, budgets of one to three canvases, so the batch shrinks from 5 to 1 and
    canvases at different steps share a pass): the same tokens and forwards as the eager engine, with buckets
    of 8 (3 canvases of padding), 4, 2 and 1 used."""
    batch = prompts(5, seed=3)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=[40, 24, 16, 33, 8][i], seed=i, ignore_eos=True)
        for i in range(5)
    ]
    with engine(folder, enforce_eager=True) as eager:
        assert eager.runner.settings.graph_buckets == ()
        expected = eager.generate(batch, params, use_tqdm=False).trajectories
    used: list[int] = []
    original = graphs.CanvasGraph.run

    def run(self, forward):
        used.append(self.bucket)
        return original(self, forward)

    monkeypatch.setattr(graphs.CanvasGraph, "run", run)
    with engine(folder) as llm:
        runner = llm.runner
        runner.settings = replace(runner.settings, graph_buckets=BUCKETS)
        got = llm.generate(batch, params, use_tqdm=False).trajectories
        captured = [g.graph is not None for g in runner.graphs.values()]
    assert [t.token_ids for t in got] == [t.token_ids for t in expected]
    assert [t.nfe for t in got] == [t.nfe for t in expected]
    assert set(used) == {8, 4, 2, 1}
    assert all(captured) == runner.capture_graphs

"""The expert-use recorder: it counts exactly the experts a (forced) router selects, per layer and forward, costs
the layers nothing once closed, and the eager re-run it serves puts the runner's graphs back afterwards."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from diffulex.bench.expert_use import ExpertUseRecorder, without_graphs
from diffulex.layers.moe import SparseMoE
from diffulex.models.loader import build_model
from diffulex.testing import write_tiny_checkpoint


def forced_router(choices: list[tuple[int, int]]):
    """A route that gives row ``r`` the experts ``choices[r % len(choices)]``, each weighted 0.5."""

    def route(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = x.shape[0]
        experts = torch.tensor([choices[r % len(choices)] for r in range(rows)], dtype=torch.int64)
        return torch.full((rows, 2), 0.5), experts

    return route


@pytest.fixture(scope="module")
def moe_layers(tmp_path_factory: pytest.TempPathFactory) -> list[SparseMoE]:
    """The two MoE layers (4 experts, top 2) of the tiny SDAR-MoE checkpoint."""
    ckpt = write_tiny_checkpoint(Path(tmp_path_factory.mktemp("moe")) / "ckpt", family="sdar_moe")
    model = build_model("sdar_moe", ckpt, torch.float32, "cpu")
    return [m for m in model.modules() if isinstance(m, SparseMoE)]


def test_the_recorder_counts_the_experts_a_forced_router_selects(moe_layers):
    first, second = moe_layers
    first.gate.route = forced_router([(1, 3)])  # every row: experts 1 and 3
    second.gate.route = forced_router([(0, 1), (0, 2)])  # alternating rows: 0, 1 and 2 between them
    try:
        model = torch.nn.ModuleList(moe_layers)
        x = torch.randn(6, 64)
        with ExpertUseRecorder(model) as recorder:
            for rows in (6, 1):  # two forwards: six rows, then one (only its own choice counts)
                for layer in moe_layers:
                    layer(x[:rows])
        assert recorder.forwards == 2 and recorder.rows == [6, 1]
        assert recorder.counts() == [[2, 3], [2, 2]]
    finally:
        del first.gate.route, second.gate.route


def test_a_closed_recorder_leaves_no_hook_and_the_layer_output_unchanged(moe_layers):
    layer = moe_layers[0]
    x = torch.randn(5, 64)
    expected = layer(x)
    with ExpertUseRecorder(torch.nn.ModuleList([layer])) as recorder:
        assert len(layer._forward_pre_hooks) == 1
        assert torch.equal(layer(x), expected)  # recording routes again beside the layer, it changes nothing
    assert not layer._forward_pre_hooks
    layer(x)  # run after closing: not recorded
    assert recorder.forwards == 1
    assert 1 <= recorder.counts()[0][0] <= 4


def test_a_model_without_moe_layers_records_nothing():
    with ExpertUseRecorder(torch.nn.Linear(4, 4)) as recorder:
        pass
    assert recorder.forwards == 0 and recorder.counts() == []


def test_steps_run_eagerly_while_open_and_the_graphs_come_back_after():
    forgotten = []
    runner = SimpleNamespace(graphs="decode", short_graphs=None, prefill_graphs="prefill",
                             forget_launches=lambda: forgotten.append(True))  # fmt: skip
    with without_graphs(runner):
        assert (runner.graphs, runner.short_graphs, runner.prefill_graphs) == (None, None, None)
        assert forgotten == [True]  # no continuation may replay a graph after a step launched before
    assert (runner.graphs, runner.short_graphs, runner.prefill_graphs) == ("decode", None, "prefill")
    with pytest.raises(RuntimeError), without_graphs(runner):
        raise RuntimeError("a failed re-run")
    assert runner.graphs == "decode" and runner.prefill_graphs == "prefill"

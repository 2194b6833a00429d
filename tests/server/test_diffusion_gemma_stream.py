"""A DiffusionGemma engine behind the server: the ``denoise`` stream of ``/generate`` shows each canvas's argmax
while it is denoised, at the canvas's own position (canvases start right after the prompt, off the block grid)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from diffulex.testing.checkpoints import write_tiny_diffusion_gemma_checkpoint

from .conftest import RunningServer, start_server
from .test_streaming_and_batching import sse_payloads

CANVAS = 16


@pytest.fixture(scope="module")
def dgemma_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    folder = write_tiny_diffusion_gemma_checkpoint(tmp_path_factory.mktemp("dgemma") / "tiny", layer_output_scale=0.5)
    server = start_server(
        Path(folder), block_size=CANVAS, page_size=CANVAS, buffer_size=1, max_model_len=256,
        strategy_options={"diffusion_gemma_max_denoising_steps": 6},
    )  # fmt: skip
    yield server
    server.stop()


def test_denoise_stream_shows_each_canvas_at_its_place_and_ends_with_the_answer(dgemma_server) -> None:
    """Two canvases (24 tokens): snapshots of the first canvas start at offset 0, of the second at 16; the first
    canvas's last snapshot (the step that commits it) holds exactly the answer's first 16 tokens, and every step
    but the last (it reports the final answer) sends one snapshot."""
    body = {"prompt": [11, 12, 13, 14, 15], "max_tokens": 24, "temperature": 0, "stream": True, "seed": 3,
            "ignore_eos": True, "stream_mode": "denoise"}  # fmt: skip
    with dgemma_server.client() as http, http.stream("POST", "/generate", json=body) as response:
        assert response.status_code == 200
        events = sse_payloads(response.iter_lines())
    snapshots, final = events[:-1], events[-1]
    assert final["event"] == "final" and len(final["token_ids"]) == 24
    assert final["nfe"] == len(snapshots) + 1
    offsets = [s["token_offset"] for s in snapshots]
    assert offsets == sorted(offsets) and set(offsets) == {0, CANVAS}
    first_canvas = [s for s in snapshots if s["token_offset"] == 0]
    cells = [cell for block in first_canvas[-1]["blocks"] for cell in block["cells"]]
    assert [cell["id"] for cell in cells] == final["token_ids"][:CANVAS]
    assert all(len(cell_list["cells"]) <= CANVAS for s in snapshots for cell_list in s["blocks"])
    assert dgemma_server.wait_idle()["kv_pages_used"] == 0

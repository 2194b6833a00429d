"""The server streams ``fast_dllm_v2`` requests: concurrent OpenAI streams each equal the request generated alone,
and the native denoise stream shows the Fast-dLLM v2 block (all its sub-blocks) as one buffer."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from diffulex import Diffulex, SamplingParams
from diffulex.testing.checkpoints import write_tiny_checkpoint

from .conftest import ENGINE_FIELDS, RunningServer, start_server
from .test_streaming_and_batching import _stream_one, sse_payloads

# sub-blocks of 4 in blocks of 8 (the shared fields' block_size=4, buffer_size=2), threshold low enough to take
# several tokens per forward
FDV2_FIELDS: dict[str, Any] = dict(decoding_strategy="fast_dllm_v2", accept_threshold=0.7)


@pytest.fixture(scope="module")
def fdv2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "fdv2", family="fast_dllm_v2", seed=1, init_std=1.0)


@pytest.fixture(scope="module")
def fdv2_server(fdv2_dir: Path) -> Iterator[RunningServer]:
    with pytest.warns(UserWarning, match="trained with 32-token blocks"):
        running = start_server(fdv2_dir, **FDV2_FIELDS)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def fdv2_engine(fdv2_dir: Path) -> Iterator[Any]:
    with pytest.warns(UserWarning, match="trained with 32-token blocks"):
        engine = Diffulex(str(fdv2_dir), **{**ENGINE_FIELDS, **FDV2_FIELDS})
    yield engine
    engine.exit()


def alone(engine, prompt: str, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return engine.generate([prompt], params, use_tqdm=False, apply_chat_template=False).trajectories[0]


def test_concurrent_streams_each_equal_generate_alone(fdv2_server: RunningServer, fdv2_engine) -> None:
    prompts = ["the old lighthouse", "keeper wrote ships names", "in a thick book every evening", "the"]
    lengths = [9, 17, 24, 30]

    async def run_all():
        async with httpx.AsyncClient(base_url=fdv2_server.base_url, timeout=60) as http:
            return await asyncio.gather(*(_stream_one(http, p, n) for p, n in zip(prompts, lengths, strict=True)))

    results = asyncio.run(run_all())
    for prompt, n, (text, payloads) in zip(prompts, lengths, results, strict=True):
        assert text == alone(fdv2_engine, prompt, n).text, prompt
        assert len(payloads) >= 2, "the answer should arrive in several chunks"
    assert fdv2_server.wait_idle()["kv_pages_used"] == 0


def test_the_denoise_stream_shows_the_whole_block_and_ends_with_the_answer(fdv2_server: RunningServer, fdv2_engine):
    body = {"prompt": "A good question", "max_tokens": 20, "temperature": 0, "stream": True, "stream_mode": "denoise"}
    with fdv2_server.client() as http, http.stream("POST", "/generate", json=body) as response:
        events = sse_payloads(response.iter_lines())
    snapshots, final = events[:-1], events[-1]
    expected = alone(fdv2_engine, "A good question", 20)
    assert final["event"] == "final" and final["token_ids"] == expected.token_ids
    assert final["nfe"] == expected.nfe == len(snapshots) + 1
    assert fdv2_server.loop.block_size == 8  # block ids count blocks of 2 sub-blocks of 4
    widths = {len(block["cells"]) for snap in snapshots for block in snap["blocks"]}
    assert max(widths) == 8
    assert expected.text.startswith("".join(s["stable_delta"] for s in snapshots))

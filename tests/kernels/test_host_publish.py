"""`publish_to_host`: a kernel's stores land in host memory exactly as ``copy_`` would put them there."""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.host_publish import publish_to_host

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _host(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, -7, dtype=torch.int64, pin_memory=DEVICE == "cuda")


@pytest.mark.parametrize("n", [1, 9, 1024, 2500])
def test_publish_writes_every_element_and_nothing_else(n: int) -> None:
    src = torch.randint(-(2**40), 2**40, (2, n), dtype=torch.int64, device=DEVICE)
    home = _host((2, n + 3))
    dst = home.view(-1)[: 2 * n].view(2, n)
    publish_to_host(src, dst)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(dst, src.cpu())
    assert (home.view(-1)[2 * n :] == -7).all()


def test_publish_rejects_mismatched_tensors() -> None:
    src = torch.zeros(2, 4, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="one shape and dtype"):
        publish_to_host(src, _host((2, 5)))
    with pytest.raises(ValueError, match="one shape and dtype"):
        publish_to_host(src, torch.zeros(2, 4, dtype=torch.int32))


@pytest.mark.skipif(DEVICE != "cuda", reason="pinned memory and device tensors need CUDA")
def test_publish_needs_pinned_host_memory_and_runs_inside_a_graph() -> None:
    src = torch.arange(8, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError, match="pinned host memory"):
        publish_to_host(src, torch.zeros(8, dtype=torch.int64))
    dst = _host((8,))
    publish_to_host(src, dst)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        publish_to_host(src, dst)
    src.add_(100)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst, torch.arange(100, 108))

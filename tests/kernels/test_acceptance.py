"""The one-launch Triton acceptance equals the per-block rule (`accept_confident`) on every block of a step."""

from __future__ import annotations

import random

import pytest
import torch

from diffulex.kernels.acceptance import triton_accept_segments
from diffulex.sampler.acceptance import accept_confident, accept_confident_segments

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def run_kernel(conf: list[float], sizes: list[int], force: list[bool], threshold: float) -> list[int]:
    starts = [0]
    for size in sizes:
        starts.append(starts[-1] + size)
    got = triton_accept_segments(
        torch.tensor(conf, dtype=torch.float32, device=DEVICE),
        torch.tensor(starts, dtype=torch.int64, device=DEVICE),
        torch.tensor([int(f) for f in force], dtype=torch.int64, device=DEVICE),
        threshold,
        max(sizes),
    )
    return torch.nonzero(got).flatten().tolist()


def per_block_rule(conf: list[float], sizes: list[int], force: list[bool], threshold: float) -> list[int]:
    expected, row = [], 0
    for size, f in zip(sizes, force, strict=True):
        expected.extend(row + i for i in accept_confident(conf[row : row + size], threshold, f))
        row += size
    return expected


@pytest.mark.parametrize("seed", range(12))
def test_kernel_acceptance_equals_the_per_block_rule(seed):
    rng = random.Random(seed)
    sizes = [rng.choice([1, 2, 3, 4, 8, 17]) for _ in range(rng.randint(1, 9))]
    levels = [0.05, 0.3, 0.5, 0.5, 0.9, 0.9, 0.95, 1.0]  # ties and exact-threshold values
    raw = [rng.choice(levels) if rng.random() < 0.6 else rng.random() for _ in range(sum(sizes))]
    conf = torch.tensor(raw, dtype=torch.float32).tolist()  # the float32 values the kernel sees
    force = [rng.random() < 0.6 for _ in sizes]
    threshold = rng.choice([0.0, 0.3, 0.5, 0.9, 0.95, 1.0, rng.random(), -1.0])
    assert run_kernel(conf, sizes, force, threshold) == per_block_rule(conf, sizes, force, threshold)


@pytest.mark.parametrize("threshold", [0.1, 0.9, 0.7, 1 / 3])
def test_kernel_threshold_compares_like_python_floats(threshold):
    """float32(t) may lie above or below t: either way a confidence passes exactly when ``conf > t`` in Python."""
    t32 = torch.tensor(threshold, dtype=torch.float32)
    neighbours = [torch.nextafter(t32, torch.tensor(-1.0)), t32, torch.nextafter(t32, torch.tensor(2.0))]
    conf = [float(x) for x in neighbours]
    got = run_kernel(conf, [1, 1, 1], [False, False, False], threshold)
    assert got == [i for i, c in enumerate(conf) if c > threshold]


def test_empty_trailing_blocks_and_rows_outside_every_block_are_left_unaccepted():
    """A captured graph launches over a fixed number of blocks and rows: the padding blocks are empty (their start
    equals the row count) and the padding rows past it belong to none; neither may change or gain an acceptance."""
    conf = torch.tensor([0.95, 0.2, 0.3, 0.99, 0.99, 0.99], dtype=torch.float32, device=DEVICE)
    starts = torch.tensor([0, 2, 3, 3, 3], dtype=torch.int64, device=DEVICE)  # two real blocks, then two empty ones
    force = torch.tensor([1, 1, 1, 1], dtype=torch.int64, device=DEVICE)
    got = triton_accept_segments(conf, starts, force, 0.9, 4)
    assert got.cpu().tolist() == [True, False, True, False, False, False]


@pytest.mark.parametrize("impl", ["kernel", "torch"])
def test_rows_at_minus_infinity_are_never_forced(impl):
    """Rows at -inf are no candidates (positions decoded after the step's layout was made): a forcing block takes
    its best finite row, and a block with no finite row takes nothing."""
    inf = float("-inf")
    conf = torch.tensor([inf, 0.3, 0.2, inf, inf, 0.95], dtype=torch.float32, device=DEVICE)
    starts = torch.tensor([0, 3, 5, 6], dtype=torch.int64, device=DEVICE)
    segment = torch.tensor([0, 0, 0, 1, 1, 2], dtype=torch.int64, device=DEVICE)
    force = torch.tensor([1, 1, 1], dtype=torch.int64, device=DEVICE)
    if impl == "kernel":
        got = triton_accept_segments(conf, starts, force, 0.9, 4)
    else:
        got = accept_confident_segments(conf, segment, force.bool(), 0.9)
    assert got.cpu().tolist() == [False, True, False, False, False, True]
    assert accept_confident([inf, inf], 0.9, True) == []


@pytest.mark.parametrize("impl", ["kernel", "dispatch"])
def test_flags_written_into_a_result_row_equal_the_returned_flags(impl):
    """A decode step's result is ``[2, N]`` int64: the acceptance may write its 0/1 flags into row 0 directly; the
    kernel then leaves the rows of no block as they were (their entries are undefined to readers)."""
    from diffulex.sampler.acceptance import accept_segments

    conf = torch.tensor([0.95, 0.2, 0.3, 0.99, 0.5, 0.5], dtype=torch.float32, device=DEVICE)
    starts = torch.tensor([0, 2, 3, 4], dtype=torch.int64, device=DEVICE)  # rows 4 and 5 belong to no block
    segment = torch.tensor([0, 0, 1, 2, 3, 3], dtype=torch.int64, device=DEVICE)
    force = torch.tensor([1, 1, 0], dtype=torch.int64, device=DEVICE)
    result = torch.full((2, 6), 7, dtype=torch.int64, device=DEVICE)
    if impl == "kernel":
        got = triton_accept_segments(conf, starts, force, 0.9, 4, out=result[0])
        assert result[0].cpu().tolist() == [1, 0, 1, 1, 7, 7]
    else:
        got = accept_segments(conf, segment, torch.tensor([1, 1, 0, 0], device=DEVICE), starts, 0.9, 4, result[0])
        assert result[0, :4].cpu().tolist() == [1, 0, 1, 1]
    assert got.data_ptr() == result[0].data_ptr()
    assert result[1].cpu().tolist() == [7] * 6
    with pytest.raises(ValueError, match="contiguous int64"):
        triton_accept_segments(conf, starts, force, 0.9, 4, out=torch.zeros(6, dtype=torch.int32, device=DEVICE))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles native kernels")
def test_after_warm_up_no_step_size_compiles_an_acceptance_kernel():
    """Decode-sized launches chain by programmatic dependent launch and larger ones do not: `warm_up` compiles
    both variants, so no step of up to 64 rows in blocks of up to 16 pays a compile."""
    import triton

    from diffulex.kernels.acceptance import warm_up

    device = torch.device("cuda")
    warm_up(device, 0.9, max_rows=64)
    misses = []
    triton.knobs.runtime.jit_cache_hook = lambda *a, **k: misses.append(k.get("fn")) or False
    try:
        for rows in (1, 3, 4, 16, 17, 33, 64):
            result = torch.zeros(2, rows, dtype=torch.int64, device=device)
            starts = torch.tensor(list(range(0, rows, 4)) + [rows], dtype=torch.int64, device=device)
            force = torch.ones(starts.shape[0] - 1, dtype=torch.int64, device=device)
            conf = torch.rand(rows, device=device)
            triton_accept_segments(conf, starts, force, 0.9, 4, out=result[0])
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert misses == []

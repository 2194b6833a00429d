"""The one-launch Triton edit acceptance equals the PyTorch edit rule (`edit_acceptance`) on every block of a step."""

from __future__ import annotations

import random

import pytest
import torch

from diffulex.kernels.edit_acceptance import triton_edit_acceptance
from diffulex.strategy.edit.acceptance import EditPhase, block_state, edit_acceptance, phase_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MASK = 9
UNTOUCHED = 7  # what the result holds before the kernel: rows of no block keep it


def random_step(rng: random.Random, padding: int):
    """Blocks of random sizes and phases (staged as a step stages them, with counts above the phase,
    `block_state`); rows mixing masks and tokens, repeated confidences (ties, values at the thresholds) and rows at
    -inf (not sampled); then ``padding`` rows of no block."""
    sizes = [rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randint(1, 7))]
    rows = sum(sizes)
    levels = [0.3, 0.5, 0.5, 0.7, 0.9, 0.95, float("-inf")]
    conf = [rng.choice(levels) if rng.random() < 0.7 else rng.random() for _ in range(rows + padding)]
    tokens = [rng.randrange(6) for _ in range(rows + padding)]
    current = [MASK if rng.random() < 0.5 else rng.randrange(6) for _ in range(rows + padding)]
    starts, segment = [0], []
    for index, size in enumerate(sizes):
        starts.append(starts[-1] + size)
        segment.extend([index] * size)
    segment.extend([len(sizes)] * padding)
    phase = [block_state(rng.choice(list(EditPhase)), rng.randint(1, 40), rng.randint(0, 16)) for _ in sizes]
    phase.append(int(EditPhase.EDITING))

    def tensor(values, dtype=torch.int64):
        return torch.tensor(values, dtype=dtype, device=DEVICE)

    return (
        tensor(tokens), tensor(conf, torch.float32), tensor(current), tensor(segment), tensor(starts), tensor(phase),
        max(sizes), rows,
    )


@pytest.mark.parametrize("seed", range(10))
def test_the_kernel_equals_the_torch_rule_and_leaves_padding_rows_alone(seed: int) -> None:
    rng = random.Random(seed)
    padding = rng.choice([0, 3])
    tokens, conf, current, segment, starts, phase, max_rows, rows = random_step(rng, padding)
    accept_t, edit_t = rng.choice([0.3, 0.5, 0.7, 0.9]), rng.choice([0.0, 0.5, 0.7, 1 / 3])
    out = torch.full((2, rows + padding), UNTOUCHED, dtype=torch.int64, device=DEVICE)[0]
    triton_edit_acceptance(tokens, conf, current, starts, phase, MASK, accept_t, edit_t, max_rows, out)
    expected = edit_acceptance(tokens, conf, current, segment, phase, MASK, accept_t, edit_t)
    assert out[:rows].tolist() == expected[:rows].tolist()
    assert out[rows:].tolist() == [UNTOUCHED] * padding
    plain = edit_acceptance(tokens, conf, current, segment, phase_of(phase), MASK, accept_t, edit_t)
    assert plain.tolist() == expected.tolist(), "the counts above a block's phase do not change its flags"


@pytest.mark.parametrize("threshold", [0.1, 0.3, 0.7, 1 / 3])
def test_the_kernel_thresholds_compare_like_python_floats(threshold: float) -> None:
    """float32(t) may lie above or below t: a mask is filled, and a token edited, exactly when ``conf > t``. The
    first block also holds a sure mask, so that no fallback fill hides the comparison; the second holds edits."""
    t32 = torch.tensor(threshold, dtype=torch.float32)
    below, above = torch.nextafter(t32, torch.tensor(-1.0)), torch.nextafter(t32, torch.tensor(2.0))
    around = [float(below), float(t32), float(above)]
    conf = torch.tensor([0.999] + around + around, dtype=torch.float32, device=DEVICE)
    current = torch.tensor([MASK] * 4 + [1] * 3, device=DEVICE)
    tokens = torch.full((7,), 2, device=DEVICE)
    starts = torch.tensor([0, 4, 7], device=DEVICE)
    phase = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    out = torch.zeros(7, dtype=torch.int64, device=DEVICE)
    triton_edit_acceptance(tokens, conf, current, starts, phase, MASK, threshold, threshold, 4, out)
    passes = [int(c > threshold) for c in around]
    assert 0 in passes and 1 in passes
    assert out.tolist() == [1] + passes + passes

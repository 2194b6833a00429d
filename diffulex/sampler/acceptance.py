"""Acceptance rules: which sampled positions of a block are written this step.

A rule sees one block's candidate confidences and decides which positions to keep; positions not kept stay
masked and are predicted again next step. Model families register the sampler class that carries their rule.
`accept_confident` states the rule for one block (readable, the reference of the tests);
`accept_confident_segments` applies it to every block of a step at once on the device, and `accept_segments`
runs that, or on CUDA the one-launch Triton kernel `diffulex.kernels.acceptance`, which is what the sampler calls.
"""

from __future__ import annotations

import torch

from diffulex.layers.dispatch import triton_available


def accept_confident(confidences: list[float], threshold: float, force_allowed: bool) -> list[int]:
    """Indices whose confidence exceeds ``threshold``; if none does and forcing is allowed, the best one.

    Forcing is what guarantees progress: the oldest active block always has a committed predecessor, so it
    fills at least one position per step, while younger blocks only take what they are sure of. A confidence of
    ``-inf`` marks a row that is not a candidate at all (a position decoded since the step's layout was made,
    `diffulex.kernels.step_advance`): it is never forced; a real confidence is a probability, never ``-inf``.
    """
    chosen = [i for i, c in enumerate(confidences) if c > threshold]
    if not chosen and force_allowed and confidences:
        best = max(range(len(confidences)), key=lambda i: (confidences[i], -i))
        chosen = [best] if confidences[best] > float("-inf") else []
    return chosen


def accept_confident_segments(
    conf: torch.Tensor, segment: torch.Tensor, force: torch.Tensor, threshold: float
) -> torch.Tensor:
    """`accept_confident` for every block of a step at once, on the device that holds the confidences.

    ``conf [N]`` holds the candidates' confidences, ``segment [N]`` (int64) the block each row belongs to (a
    block's rows are contiguous and in position order), ``force [S]`` whether block ``s`` may force. Returns
    the bool mask ``[N]`` of accepted rows, equal to running `accept_confident` block by block: the batch then
    costs a few kernels and no host sync instead of a Python loop over requests and blocks.

    The threshold test is done in float64, so a float32 confidence compares with the Python ``threshold``
    exactly as its ``.tolist()`` value does in `accept_confident`. A forced row is the first row holding its
    block's maximum, which is the ``(conf, -i)`` tie rule.
    """
    num_rows, num_segments = conf.shape[0], force.shape[0]
    rows = torch.arange(num_rows, device=conf.device)
    accept = conf.double() > threshold
    hits = torch.zeros(num_segments, dtype=torch.int64, device=conf.device).scatter_add_(0, segment, accept.long())
    best = torch.full((num_segments,), float("-inf"), dtype=conf.dtype, device=conf.device)
    best = best.scatter_reduce(0, segment, conf, reduce="amax")
    at_best = torch.where(conf == best[segment], rows, num_rows)
    first_best = torch.full((num_segments,), num_rows, dtype=torch.int64, device=conf.device)
    first_best = first_best.scatter_reduce(0, segment, at_best, reduce="amin")
    forced = force & (hits == 0) & (best > float("-inf"))
    return accept | (forced[segment] & (rows == first_best[segment]))


def accept_segments(
    conf: torch.Tensor, segment: torch.Tensor, force: torch.Tensor, starts: torch.Tensor, threshold: float,
    max_block_rows: int, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`accept_confident_segments` (``force`` as 0/1 ints) in one Triton launch on CUDA, the PyTorch version
    elsewhere. ``starts [S + 1]`` are the blocks' first rows followed by ``N``; ``max_block_rows`` bounds a block.
    With ``out`` (contiguous int64 ``[N]``) the flags go there as 0/1 and ``out`` is returned; rows of no block
    are then undefined."""
    if conf.is_cuda and triton_available():
        from diffulex.kernels.acceptance import triton_accept_segments

        return triton_accept_segments(conf, starts, force, threshold, max_block_rows, out)
    accept = accept_confident_segments(conf, segment, force.bool(), threshold)
    return accept if out is None else out.copy_(accept)


"""DiffusionGemma's entropy-bound acceptance for every sampled canvas of a step in one launch.

Why: the rule (`diffulex.strategy.diffusion_gemma.canvas.entropy_bound_acceptance`) sorts a canvas's entropies,
sums them in that order and keeps a position's draw while the entropies before it sum to at most the bound; the
canvas's mean entropy decides whether it is confident. In PyTorch that is about eight launches per canvas (the mean,
the sort, the running sum, the comparison, the scatter back, the choice between draw and noise), each over a few
hundred numbers: at 32 canvases a step some 250 launches whose work is nothing.

Here one program takes one canvas: its mean entropy (a tree sum), and for every position the sum of the entropies
that come before it in the stable order (lower entropy, or equal entropy at a lower position), formed directly
rather than by sorting: the canvas's entropies are compared with each position's in tiles of ``KEYS`` positions, so
a canvas of ``C`` positions costs ``C^2`` comparisons, nothing at the canvas lengths the model has (16 to 256). A
position is accepted where that sum is at most the bound (the lowest entropy always is) and takes its draw, else its
noise. The sums run in another order than the sorted running sum, so they are within float32 rounding of it; a
canvas gets the same numbers in any launch (one program a canvas, its order fixed by its length alone). A canvas
with a NaN entropy is one whose logits gave no distribution (its request fails when the step is read): its tokens
are unspecified.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Positions compared with a canvas's in one iteration: a [C, KEYS] tile of comparisons.
KEYS = 32


@triton.jit
def _canvas_acceptance_kernel(
    entropy_ptr,  # [n, C] float32 each position's entropy
    drawn_ptr,  # [n, C] int64 each position's draw
    noise_ptr,  # [n, C] int64 each position's fresh noise token
    tokens_ptr,  # [n, C] int64 out: the draw where accepted, else the noise
    mean_ptr,  # [n] float32 out: each canvas's mean entropy
    length,
    bound,
    BLOCK: tl.constexpr,  # a power of two >= length
    KEYS: tl.constexpr,
):
    base = tl.program_id(0).to(tl.int64) * length
    pos = tl.arange(0, BLOCK)
    inside = pos < length
    h = tl.load(entropy_ptr + base + pos, mask=inside, other=0.0)
    tl.store(mean_ptr + tl.program_id(0), tl.sum(h, axis=0) / length)
    before = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, length, KEYS):
        other = start + tl.arange(0, KEYS)
        h_other = tl.load(entropy_ptr + base + other, mask=other < length, other=0.0)
        lower = h_other[None, :] < h[:, None]
        tie_before = (h_other[None, :] == h[:, None]) & (other[None, :] < pos[:, None])
        earlier = (lower | tie_before) & (other[None, :] < length)
        before += tl.sum(tl.where(earlier, h_other[None, :], 0.0), axis=1)
    drawn = tl.load(drawn_ptr + base + pos, mask=inside, other=0)
    noise = tl.load(noise_ptr + base + pos, mask=inside, other=0)
    tl.store(tokens_ptr + base + pos, tl.where(before <= bound, drawn, noise), mask=inside)


def accept_canvases(
    entropy: torch.Tensor, drawn: torch.Tensor, noise: torch.Tensor, bound: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[n, C]`` tokens (each position's draw where the entropies before it in the stable order sum to at most
    ``bound``, else its noise) and ``[n]`` mean entropies, of ``n`` canvases' float32 ``entropy``, int64 ``drawn`` and
    ``noise`` (each ``[n, C]``, contiguous)."""
    if entropy.dim() != 2 or entropy.dtype != torch.float32 or not entropy.is_contiguous():
        raise ValueError(f"entropy must be a contiguous [n, C] float32 tensor, got {tuple(entropy.shape)} "
                         f"{entropy.dtype}")  # fmt: skip
    for name, tensor in (("drawn", drawn), ("noise", noise)):
        if tensor.shape != entropy.shape or tensor.dtype != torch.int64 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int64 tensor of entropy's shape {tuple(entropy.shape)}, "
                             f"got {tuple(tensor.shape)} {tensor.dtype}")  # fmt: skip
    n, length = entropy.shape
    tokens = torch.empty_like(drawn)
    means = torch.empty(n, dtype=torch.float32, device=entropy.device)
    if n == 0 or length == 0:
        return tokens, means.zero_()
    block = triton.next_power_of_2(length)
    _canvas_acceptance_kernel[(n,)](entropy, drawn, noise, tokens, means, length, float(bound),
                                    BLOCK=block, KEYS=min(KEYS, block))  # fmt: skip
    return tokens, means

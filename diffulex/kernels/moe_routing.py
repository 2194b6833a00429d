"""A mixture-of-experts router's softmax and top-k in one launch.

`diffulex.layers.moe.route` is five PyTorch kernels per MoE layer (the float32 cast, the softmax, the top-k, the sum
of the chosen weights and the division), none of which takes part in programmatic dependent launch: at decode
sizes each costs its launch latency and stalls the chain of the kernels around it (SDAR-30B-A3B at batch 1 runs
823 kernels a step on an H100, the softmax and top-k kernels of its 48 routers and its sampler 0.6 ms of a 4.5 ms
step). Here one program holds a few rows of
router logits in registers, takes the softmax in float32, picks the ``top_k`` largest probabilities one after the
other (the lowest expert index among equal ones) and renormalizes them.

Against the torch code (the CPU path and the reference): the same probabilities up to the order of the softmax's
sum and the exponential's rounding (an ulp or so in float32), hence the same choice of experts except where two
probabilities lie within those ulps of each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.parallel_compile import in_dry_pass
from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

# Most experts one program holds per row (a row of logits in registers); more take the torch path.
MAX_ROUTED_EXPERTS = 1024
_ROWS_PER_PROGRAM_ELEMS = 2048  # a program's rows x experts


@triton.jit(do_not_specialize=["n_rows"])
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    n_rows,
    n_experts,
    stride_l,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_experts)[None, :]
    wait_for_inputs(USE_PDL)
    x = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=mask, other=float("-inf"))
    x = x.to(tl.float32)
    peak = tl.max(x, axis=1)
    e = tl.where(mask, tl.exp(x - peak[:, None]), 0.0)
    probs = e / tl.sum(e, axis=1)[:, None]
    remaining = tl.where(mask, probs, -1.0)  # probabilities are >= 0: -1 marks a taken or absent expert
    slots = tl.arange(0, TOP_K_PAD)
    chosen_w = tl.zeros([BLOCK_R, TOP_K_PAD], dtype=tl.float32)
    chosen_e = tl.zeros([BLOCK_R, TOP_K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=1)
        index = tl.min(tl.where(remaining == best[:, None], cols[None, :], BLOCK_E), axis=1)
        chosen_w = tl.where(slots[None, :] == j, best[:, None], chosen_w)
        chosen_e = tl.where(slots[None, :] == j, index.to(tl.int64)[:, None], chosen_e)
        remaining = tl.where(cols[None, :] == index[:, None], -1.0, remaining)
    if NORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=1)[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    out_mask = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, chosen_w, mask=out_mask)
    tl.store(experts_ptr + out, chosen_e, mask=out_mask)


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`diffulex.layers.moe.route` in one launch: ``(weights [T, top_k] float32, experts [T, top_k] int64)`` of
    router logits ``[T, E]`` (rows may be strided), the chosen experts in decreasing probability."""
    n_rows, n_experts = logits.shape
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {n_experts}] (the router's experts)")
    weights = torch.empty(n_rows, top_k, dtype=torch.float32, device=logits.device)
    # a build's dry pass only records the launch (`diffulex.kernels.parallel_compile`), and the PyTorch code after
    # a router indexes with its experts: valid indices then, not whatever the memory held
    experts = (torch.zeros if in_dry_pass() else torch.empty)(n_rows, top_k, dtype=torch.int64, device=logits.device)
    if n_rows == 0:
        return weights, experts
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_e = _next_pow2(n_experts)
    block_r = max(1, min(_ROWS_PER_PROGRAM_ELEMS // block_e, _next_pow2(n_rows)))
    use_pdl = pdl_enabled(logits.device, n_rows)
    _softmax_topk_kernel[(triton.cdiv(n_rows, block_r),)](
        logits,
        weights,
        experts,
        n_rows,
        n_experts,
        logits.stride(0),
        TOP_K=top_k,
        TOP_K_PAD=_next_pow2(top_k),
        NORMALIZE=normalize,
        BLOCK_R=block_r,
        BLOCK_E=block_e,
        USE_PDL=use_pdl,
        num_warps=4,
        **launch_kwargs(use_pdl),
    )
    return weights, experts

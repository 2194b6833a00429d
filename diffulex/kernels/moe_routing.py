"""A mixture-of-experts router's selection in one launch: softmax and top-k (`softmax_topk`), or LLaDA2's sigmoid
scores chosen within the best expert groups (`group_limited_topk`).

`diffulex.layers.moe.route` is five PyTorch kernels per MoE layer (the float32 cast, the softmax, the top-k, the sum
of the chosen weights and the division), none of which takes part in programmatic dependent launch: at decode
sizes each costs its launch latency and stalls the chain of the kernels around it (SDAR-30B-A3B at batch 1 runs
823 kernels a step on an H100, the softmax and top-k kernels of its 48 routers and its sampler 0.6 ms of a 4.5 ms
step). Here one program holds a few rows of
router logits in registers, takes the softmax in float32, picks the ``top_k`` largest probabilities one after the
other (the lowest expert index among equal ones) and renormalizes them.

LLaDA2's router (`diffulex.layers.moe.GroupLimitedRouter`) was about fifteen PyTorch kernels a layer after its
projection (sigmoid, bias, the groups' two best scores, the best groups, their mask, the top-k, the gather and the
renormalization); `group_limited_topk` is all of it in one launch, each row's experts held as ``[groups, experts
per group]`` in registers.

Against the torch code (the CPU path and the reference): the same probabilities up to the order of the softmax's
sum and the exponential's rounding (an ulp or so in float32), hence the same choice of experts except where two
probabilities (or two groups' scores) lie within those ulps of each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from diffulex.kernels.parallel_compile import in_dry_pass
from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

# a program's rows x experts: 4 rows of a 128-expert router, 2 of a 256-expert one. Fewer rows a program shorten
# each program's serial top-k rounds; one row a program was slower again (`bench/moe_routing_bench.py`, H100:
# docs/benchmarks.md "MoE routers' selection")
_ROWS_PER_PROGRAM_ELEMS = 512


@triton.jit
def _take_top_k(keys, weights, cols, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr):
    """The ``TOP_K`` largest ``keys [R, E]`` of each row one after the other (the lowest column among equal keys),
    as ``[R, TOP_K_PAD]`` slots: each one's entry of ``weights [R, E]`` and its column. A NaN key counts as the
    largest, as in ``torch.topk``: no key equals a NaN maximum, which would leave the column past the last, and the
    layers index weights and expert tables by these columns (a NaN hidden state must not become an access out of
    bounds, which would end the process's CUDA context for every request)."""
    keys = tl.where(keys != keys, float("inf"), keys)
    slots = tl.arange(0, TOP_K_PAD)
    chosen_w = tl.zeros([keys.shape[0], TOP_K_PAD], dtype=tl.float32)
    chosen_e = tl.zeros([keys.shape[0], TOP_K_PAD], dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(keys, axis=1)
        index = tl.min(tl.where(keys == best[:, None], cols[None, :], keys.shape[1]), axis=1)
        picked = cols[None, :] == index[:, None]
        weight = tl.sum(tl.where(picked, weights, 0.0), axis=1)
        chosen_w = tl.where(slots[None, :] == j, weight[:, None], chosen_w)
        chosen_e = tl.where(slots[None, :] == j, index.to(tl.int64)[:, None], chosen_e)
        keys = tl.where(picked, float("-inf"), keys)
    return chosen_w, chosen_e


@triton.jit
def _store_top_k(weights_ptr, experts_ptr, rows, row_ok, chosen_w, chosen_e, TOP_K: tl.constexpr,
                 TOP_K_PAD: tl.constexpr):  # fmt: skip
    """Each row's ``TOP_K`` slots of ``chosen_w`` and ``chosen_e`` into the ``[T, TOP_K]`` outputs."""
    slots = tl.arange(0, TOP_K_PAD)
    out = rows[:, None] * TOP_K + slots[None, :]
    out_mask = row_ok[:, None] & (slots < TOP_K)[None, :]
    tl.store(weights_ptr + out, chosen_w, mask=out_mask)
    tl.store(experts_ptr + out, chosen_e, mask=out_mask)


@triton.jit(do_not_specialize=["n_rows"])
def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    experts_ptr,
    expert_scale_ptr,
    n_rows,
    n_experts,
    stride_l,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    NORMALIZE: tl.constexpr,
    EXPERT_SCALE: tl.constexpr,  # each chosen weight times its expert's scale (after the renormalization)
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
    peak = tl.where(row_ok, tl.max(x, axis=1), 0.0)  # rows past the last hold no logits: no -inf - -inf
    e = tl.where(mask, tl.exp(x - peak[:, None]), 0.0)
    probs = e / tl.where(row_ok, tl.sum(e, axis=1), 1.0)[:, None]
    keys = tl.where(mask, probs, -1.0)  # probabilities are >= 0: -1 marks an absent expert
    chosen_w, chosen_e = _take_top_k(keys, probs, cols, TOP_K, TOP_K_PAD)
    if NORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, axis=1)[:, None]
    if EXPERT_SCALE:
        chosen_ok = row_ok[:, None] & (chosen_e >= 0) & (chosen_e < n_experts)
        chosen_w = chosen_w * tl.load(expert_scale_ptr + chosen_e, mask=chosen_ok, other=1.0).to(tl.float32)
    _store_top_k(weights_ptr, experts_ptr, rows, row_ok, chosen_w, chosen_e, TOP_K, TOP_K_PAD)


def _selection(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's outputs for ``logits [T, E]``: float32 weights and int64 experts ``[T, top_k]``. A build's dry
    pass only records the launch (`diffulex.kernels.parallel_compile`), and the PyTorch code after a router indexes
    with its experts: zeros then (valid indices), not whatever the memory held."""
    n_rows = logits.shape[0]
    weights = torch.empty(n_rows, top_k, dtype=torch.float32, device=logits.device)
    experts = (torch.zeros if in_dry_pass() else torch.empty)(n_rows, top_k, dtype=torch.int64, device=logits.device)
    return weights, experts


def _rows_per_program(rows_per_program: int | None, experts: int, n_rows: int) -> int:
    """The rows one program selects for: ``rows_per_program`` where given (`bench/moe_routing_bench.py` times the
    choices), else as many as fit `_ROWS_PER_PROGRAM_ELEMS` router scores, at most the rows there are."""
    if rows_per_program is None:
        return max(1, min(_ROWS_PER_PROGRAM_ELEMS // experts, triton.next_power_of_2(n_rows)))
    if rows_per_program < 1 or rows_per_program & (rows_per_program - 1):
        raise ValueError(f"rows_per_program={rows_per_program!r} is invalid: must be a power of two >= 1")
    return rows_per_program


def softmax_topk(
    logits: torch.Tensor,
    top_k: int,
    normalize: bool,
    rows_per_program: int | None = None,
    expert_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`diffulex.layers.moe.route` in one launch: ``(weights [T, top_k] float32, experts [T, top_k] int64)`` of
    router logits ``[T, E]`` (rows may be strided), the chosen experts in decreasing probability; with
    ``expert_scale [E]`` each weight times its expert's entry (in float32, as the torch code's product)."""
    n_rows, n_experts = logits.shape
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {n_experts}] (the router's experts)")
    if expert_scale is not None and (expert_scale.shape != (n_experts,) or not expert_scale.is_contiguous()):
        raise ValueError(f"expert_scale has shape {tuple(expert_scale.shape)}; it must be contiguous [{n_experts}]")
    weights, experts = _selection(logits, top_k)
    if n_rows == 0:
        return weights, experts
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_e = triton.next_power_of_2(n_experts)
    block_r = _rows_per_program(rows_per_program, block_e, n_rows)
    use_pdl = pdl_enabled(logits.device, n_rows)
    _softmax_topk_kernel[(triton.cdiv(n_rows, block_r),)](
        logits,
        weights,
        experts,
        logits if expert_scale is None else expert_scale,
        n_rows,
        n_experts,
        logits.stride(0),
        TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k),
        NORMALIZE=normalize,
        EXPERT_SCALE=expert_scale is not None,
        BLOCK_R=block_r,
        BLOCK_E=block_e,
        USE_PDL=use_pdl,
        num_warps=4,
        **launch_kwargs(use_pdl),
    )
    return weights, experts


@triton.jit(do_not_specialize=["n_rows"])
def _group_limited_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    experts_ptr,
    n_rows,
    stride_l,
    scaling,
    weight_sum_floor,
    N_GROUP: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    TOP_K_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    N_EXPERTS: tl.constexpr = N_GROUP * GROUP_SIZE
    release_dependents(USE_PDL)
    rows = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = tl.arange(0, N_EXPERTS)
    row_ok = rows < n_rows
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols).to(tl.float32)
    wait_for_inputs(USE_PDL)
    x = tl.load(logits_ptr + rows[:, None] * stride_l + cols[None, :], mask=row_ok[:, None], other=0.0)
    scores = tl.sigmoid(x.to(tl.float32))
    biased = scores
    if HAS_BIAS:
        biased = scores + bias[None, :]
    # each group's two best biased scores, summed
    grouped = tl.reshape(biased, (BLOCK_R, N_GROUP, GROUP_SIZE))
    within = tl.arange(0, GROUP_SIZE)
    first = tl.max(grouped, axis=2)
    if GROUP_SIZE > 1:
        first_at = tl.min(tl.where(grouped == first[:, :, None], within[None, None, :], GROUP_SIZE), axis=2)
        second = tl.max(tl.where(within[None, None, :] == first_at[:, :, None], float("-inf"), grouped), axis=2)
        group_scores = first + second
    else:
        group_scores = first
    # the TOPK_GROUP best groups (the lowest group first among equal scores)
    groups = tl.arange(0, N_GROUP)
    open_groups = tl.zeros([BLOCK_R, N_GROUP], dtype=tl.int1)
    remaining_groups = group_scores
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(remaining_groups, axis=1)
        at = tl.min(tl.where(remaining_groups == best[:, None], groups[None, :], N_GROUP), axis=1)
        taken = groups[None, :] == at[:, None]
        open_groups = open_groups | taken
        remaining_groups = tl.where(taken, float("-inf"), remaining_groups)
    allowed = tl.reshape(tl.broadcast_to(open_groups[:, :, None], (BLOCK_R, N_GROUP, GROUP_SIZE)), (BLOCK_R, N_EXPERTS))
    # the TOP_K best biased scores of the open groups; their unbiased scores are the weights
    keys = tl.where(allowed, biased, float("-inf"))
    chosen_w, chosen_e = _take_top_k(keys, scores, cols, TOP_K, TOP_K_PAD)
    if TOP_K > 1:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=1)[:, None] + weight_sum_floor)
    chosen_w = chosen_w * scaling
    _store_top_k(weights_ptr, experts_ptr, rows, row_ok, chosen_w, chosen_e, TOP_K, TOP_K_PAD)


def group_limited_topk(
    logits: torch.Tensor,
    expert_bias: torch.Tensor | None,
    n_group: int,
    topk_group: int,
    top_k: int,
    scaling: float,
    weight_sum_floor: float,
    rows_per_program: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`diffulex.layers.moe.GroupLimitedRouter`'s selection after its projection, in one launch: ``(weights [T,
    top_k] float32, experts [T, top_k] int64)`` of router logits ``[T, E]`` (float32; the sigmoid is taken here).
    ``E / n_group`` must be a power of two, as must ``n_group`` (LLaDA2: 256 experts in 8 groups)."""
    n_rows, n_experts = logits.shape
    group_size = n_experts // n_group
    if n_group * group_size != n_experts or not _pow2(n_group) or not _pow2(group_size):
        raise ValueError(f"n_group={n_group} and num_experts={n_experts} must be powers of two, n_group dividing it")
    weights, experts = _selection(logits, top_k)
    if n_rows == 0:
        return weights, experts
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block_r = _rows_per_program(rows_per_program, n_experts, n_rows)
    use_pdl = pdl_enabled(logits.device, n_rows)
    _group_limited_topk_kernel[(triton.cdiv(n_rows, block_r),)](
        logits,
        logits if expert_bias is None else expert_bias,
        weights,
        experts,
        n_rows,
        logits.stride(0),
        float(scaling),
        float(weight_sum_floor),
        N_GROUP=n_group,
        GROUP_SIZE=group_size,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        TOP_K_PAD=triton.next_power_of_2(top_k),
        HAS_BIAS=expert_bias is not None,
        BLOCK_R=block_r,
        USE_PDL=use_pdl,
        num_warps=4,
        **launch_kwargs(use_pdl),
    )
    return weights, experts


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0

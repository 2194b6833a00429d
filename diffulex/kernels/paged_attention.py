"""Triton paged attention for one engine step: one launch per layer over a ragged batch of requests.

Semantics are exactly those of `diffulex.attention.torch_paged.paged_attention`: request ``r`` owns query rows
``[cu_seqlens_q[r], cu_seqlens_q[r + 1])`` at absolute positions ``[ctx, ctx + q_len)``; its keys are the cached
positions ``[0, ctx)`` (read through its page table from ``[num_pages, page_size, kv_heads, head_dim]`` caches)
followed by its own new rows; visibility is `diffulex.attention.mask.visibility_mask` on absolute positions,
applied to cached and new keys alike.

Design:

* grid ``(query tiles, requests, kv heads)`` in grouped mode (``grouped=True``, the default): one program owns
  ``BLOCK_Q`` query positions of one request for all ``GROUP`` query heads that share a KV head, packed into the
  ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows of its tile, so each K/V tile is read once per group. In ungrouped mode
  the grid is ``(query tiles, requests, heads)`` with one head per program (``GROUP_PAD = 1``).
* two key loops: cached keys in ``BLOCK_N`` tiles gathered row by row through the page table (any page size,
  tiles may straddle pages), then the request's new keys read from ``k``/``v``. The new-key loop stops at the
  furthest key any row of the tile may see (the end of the last row's diffusion block, or the prompt end for
  prompt rows under prefix-full), so later blocks are never read.
* online softmax in fp32 (``exp2`` with the scale folded into ``log2(e)``); ``q @ k^T`` accumulates in fp32,
  probabilities are cast to the value dtype for ``p @ v`` (fp32 accumulation). Rows whose running maximum is
  still ``-inf`` are guarded so that fully masked tiles contribute zeros and never NaN; every valid query sees
  at least itself, so its final denominator is positive.
* split-KV inside the same launch when the grid alone cannot fill the GPU (few requests, long prefixes): the grid's
  first axis becomes ``query tiles * split_slots``; each split folds a ``BLOCK_N``-aligned chunk of either the
  tile's cached keys or its new keys (never both) and publishes its partial (max, denominator, accumulator) in fp32
  to a scratch buffer, then bumps a per-tile counter (acq_rel atomic); the last split to arrive combines the
  partials, writes the output and resets the counter to zero, so the counters need no memset between launches.
* no host syncs: lengths, offsets and page tables are read on the device; only the grid size and the tile shapes
  use host integers (``max_query_len``, ``max_kv_len`` and the request count of the metadata). Requests with
  ``q_len = 0`` return at once, so a CUDA graph captured for a bucket of requests replays for fewer requests.
* sliding-window layers (``window > 0``, off by default): a row additionally sees only keys at positions above
  ``anchor - window``, where the anchor is the row's own position (a causal sliding window: DiffusionGemma's
  encoder) or, with ``window_from_context``, its request's context length (DiffusionGemma's decoder: a canvas
  sees the last ``window - 1`` cached positions and all of its own rows). Key tiles below every row's window are
  never read, so a sliding layer's cost stays bounded by the window however long the context.
* a long-query class for prompts and DiffusionGemma's canvases (``FULL_TILES``, `_long_query_tiles`): a launch whose
  longest query has `_LONG_QUERY_MIN` positions or more takes 128-row query tiles in 8 warps with a deeper pipeline, as
  a FlashAttention-2 forward does (wider heads than 128: tiles of their own, `long_query_tiles_for`). Each row sees a
  prefix of key positions (its block's end, the prompt's end for prompt rows under prefix-full) above its window's
  floor, so the key tiles between the highest floor and the lowest row limit of the tile are seen whole by every row and
  fold without the mask; only the window's edge, the diagonal band and the padded last tile are masked. The latest query
  tiles (the most keys) are started first: unsplit, those of every head and request before any earlier one. Its keys are
  split like the other classes' where its grid cannot fill the GPU (a short prompt tail after a long cached context).
  The decode-sized classes compile exactly as without it.
* key tails (``KEY_TAIL``, a launch with the metadata's device ``key_lens``): a request may attend past its rows,
  to cached keys ``[ctx + q_len, key_len)`` of its own block (Fast-dLLM v2 refining one sub-block against the
  block's kept K/V). A program's key range ``[lo, hi)`` is then folded in three loops: cached keys below ``ctx``,
  the rows' own keys from ``k``/``v``, cached keys from ``ctx + q_len`` on; split-KV chunks the keys past ``ctx``
  as before, a chunk may span the own rows and the tail. Off (the default), the third loop is not compiled.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from diffulex.attention.metadata import PagedAttentionMetadata
from diffulex.kernels import tma
from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, prefetch_l2, release_dependents, wait_for_inputs
from diffulex.kernels.split_counters import sm_count, split_counters

_LOG2E = 1.4426950408889634


@triton.jit
def _scores(q, k_t, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(q, tl.trans(k_t), input_precision="ieee")
    return tl.dot(q, tl.trans(k_t))


@triton.jit
def _weighted(p, v_t, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(p.to(v_t.dtype), v_t, input_precision="ieee")
    return tl.dot(p.to(v_t.dtype), v_t)


@triton.jit
def _online_softmax_step(
    q,
    k_t,
    v_t,
    k_pos,
    k_ok,
    q_blk,
    q_in_prompt,
    prompt_len,
    m_i,
    l_i,
    acc,
    qk_scale,
    BLOCK_SIZE: tl.constexpr,
    PREFIX_FULL: tl.constexpr,
    IEEE: tl.constexpr,
    k_floor=None,  # [BLOCK_M] lowest key position each row sees (with a WINDOW)
    WINDOW: tl.constexpr = 0,
    MASK: tl.constexpr = True,  # False: every row of the tile sees every key of it (an interior tile)
):
    """Fold one tile of keys (absolute positions ``k_pos``) into the running (max, denominator, accumulator);
    with a ``WINDOW``, keys below each row's ``k_floor`` are hidden. Without ``MASK`` the visibility rule is not
    evaluated at all: the caller has proved that each valid row sees the whole tile, so every score is finite (no
    fully masked row to guard) and the scale rides in the exponent's fused multiply-add."""
    s = _scores(q, k_t, IEEE)
    if MASK:
        s = s * qk_scale
        visible = (k_pos[None, :] // BLOCK_SIZE) <= q_blk[:, None]
        if PREFIX_FULL:
            visible = tl.where(q_in_prompt[:, None], k_pos[None, :] < prompt_len, visible)
        visible = visible & k_ok[None, :]
        if WINDOW > 0:
            visible = visible & (k_pos[None, :] >= k_floor[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked so far: contribute exact zeros
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
    else:
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # the scale is positive: the same maximum
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _weighted(p, v_t, IEEE)
    return m_new, l_i, acc


@triton.jit
def _cache_rows(
    pt_row,
    k_pos,
    k_ok,
    kv_head,
    stride_kc_p,
    stride_kc_s,
    stride_kc_h,
    stride_vc_p,
    stride_vc_s,
    stride_vc_h,
    PAGE_SIZE: tl.constexpr,
):
    """Offsets of the K and V cache rows of positions ``k_pos`` of one KV head, through the request's page table
    (0 where not ``k_ok``: no page is read for those)."""
    page = tl.load(pt_row + k_pos // PAGE_SIZE, mask=k_ok, other=0).to(tl.int64)
    in_page = k_pos % PAGE_SIZE
    kc_rows = tl.where(k_ok, page * stride_kc_p + in_page * stride_kc_s + kv_head * stride_kc_h, 0)
    vc_rows = tl.where(k_ok, page * stride_vc_p + in_page * stride_vc_s + kv_head * stride_vc_h, 0)
    return kc_rows, vc_rows


@triton.jit
def _cached_tile(
    k_cache_ptr,
    v_cache_ptr,
    pt_row,
    start,
    cache_end,
    kv_head,
    offs_n,
    offs_d,
    stride_kc_p,
    stride_kc_s,
    stride_kc_h,
    stride_vc_p,
    stride_vc_s,
    stride_vc_h,
    PAGE_SIZE: tl.constexpr,
):
    """Keys and values at positions ``start + offs_n`` below ``cache_end``, gathered through the page table (rows
    past the end are masked, and none is read when ``start >= cache_end``); with their positions and validity."""
    k_pos = start + offs_n
    k_ok = k_pos < cache_end
    kc_rows, vc_rows = _cache_rows(
        pt_row, k_pos, k_ok, kv_head, stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h,
        PAGE_SIZE,
    )
    k_t = tl.load(k_cache_ptr + kc_rows[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    v_t = tl.load(v_cache_ptr + vc_rows[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
    return k_t, v_t, k_pos, k_ok


@triton.jit
def _fold_cached(
    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row, start, stop, cache_end, kv_head, offs_n, offs_d,
    stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h, q_blk, q_in_prompt, prompt_len,
    qk_scale, k_floor, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PREFIX_FULL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, MASK: tl.constexpr,
):  # fmt: skip
    """Fold the cached key tiles starting at ``start, start + BLOCK_N, ...`` below ``stop`` (keys valid below
    ``cache_end``). Each tile's cache rows come from the page table one iteration ahead, so that a tile's loads
    depend on no load of their own iteration and the loop's pipeline can issue them early."""
    k_pos = start + offs_n
    kc_rows, vc_rows = _cache_rows(
        pt_row, k_pos, k_pos < cache_end, kv_head, stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s,
        stride_vc_h, PAGE_SIZE,
    )
    for n_start in range(start, stop, BLOCK_N):
        k_pos = n_start + offs_n
        k_ok = k_pos < cache_end
        k_t = tl.load(k_cache_ptr + kc_rows[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        v_t = tl.load(v_cache_ptr + vc_rows[:, None] + offs_d[None, :], mask=k_ok[:, None], other=0.0)
        ahead = k_pos + BLOCK_N
        kc_rows, vc_rows = _cache_rows(
            pt_row, ahead, ahead < cache_end, kv_head, stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p,
            stride_vc_s, stride_vc_h, PAGE_SIZE,
        )
        m_i, l_i, acc = _online_softmax_step(
            q, k_t.to(q.dtype), v_t.to(q.dtype), k_pos, k_ok, q_blk, q_in_prompt, prompt_len, m_i, l_i, acc,
            qk_scale, BLOCK_SIZE, PREFIX_FULL, IEEE, k_floor, WINDOW, MASK,
        )
    return m_i, l_i, acc


@triton.jit
def _fold_cached_boxes(
    q, m_i, l_i, acc, kc_desc, vc_desc, pt_row, start, stop, kv_head, qk_scale, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    """Fold the cached key tiles at ``start, start + BLOCK_N, ...`` below ``stop`` that every row sees whole (the
    caller's interior: every key valid, no mask; tiles on the ``BLOCK_N`` grid from a page boundary) through TMA:
    a tile is one box of its page where a page holds it, else the boxes of its two pages (pages of ``BLOCK_N / 2``
    keys), each multiplied on its own and folded into one softmax update. The page ids come one tile ahead."""
    col = kv_head * HEAD_DIM
    page = tl.load(pt_row + start // PAGE_SIZE, mask=start < stop, other=0)
    if PAGE_SIZE < BLOCK_N:
        page_b = tl.load(pt_row + start // PAGE_SIZE + 1, mask=start < stop, other=0)
    for n_start in range(start, stop, BLOCK_N):
        if PAGE_SIZE >= BLOCK_N:
            row = page * PAGE_SIZE + n_start % PAGE_SIZE
            page = tl.load(pt_row + (n_start + BLOCK_N) // PAGE_SIZE, mask=n_start + BLOCK_N < stop, other=0)
            k_t = kc_desc.load([row, col]).to(q.dtype)
            v_t = vc_desc.load([row, col]).to(q.dtype)
            # an interior tile: no key position or visibility rule is read
            m_i, l_i, acc = _online_softmax_step(
                q, k_t, v_t, None, None, None, None, None, m_i, l_i, acc, qk_scale, 1, False, IEEE, MASK=False
            )
        else:
            row_a, row_b = page * PAGE_SIZE, page_b * PAGE_SIZE
            ahead = (n_start + BLOCK_N) // PAGE_SIZE
            page = tl.load(pt_row + ahead, mask=n_start + BLOCK_N < stop, other=0)
            page_b = tl.load(pt_row + ahead + 1, mask=n_start + BLOCK_N < stop, other=0)
            k_a = kc_desc.load([row_a, col]).to(q.dtype)
            k_b = kc_desc.load([row_b, col]).to(q.dtype)
            v_a = vc_desc.load([row_a, col]).to(q.dtype)
            v_b = vc_desc.load([row_b, col]).to(q.dtype)
            s_a = _scores(q, k_a, IEEE)
            s_b = _scores(q, k_b, IEEE)
            m_new = tl.maximum(m_i, tl.maximum(tl.max(s_a, axis=1), tl.max(s_b, axis=1)) * qk_scale)
            p_a = tl.exp2(s_a * qk_scale - m_new[:, None])
            p_b = tl.exp2(s_b * qk_scale - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p_a, axis=1) + tl.sum(p_b, axis=1)
            acc = acc * alpha[:, None] + _weighted(p_a, v_a, IEEE) + _weighted(p_b, v_b, IEEE)
            m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _fold_new(
    q, m_i, l_i, acc, k_ptr, v_ptr, row_start, ctx, start, stop, new_hi, kv_head, offs_n, offs_d, stride_k_t,
    stride_k_h, stride_v_t, stride_v_h, q_blk, q_in_prompt, prompt_len, qk_scale, k_floor, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, PREFIX_FULL: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
    MASK: tl.constexpr, k_desc=None, v_desc=None, HEAD_DIM: tl.constexpr = 0,
):  # fmt: skip
    """Fold the request's new key tiles at row indices ``start, start + BLOCK_N, ...`` below ``stop`` (keys
    valid below ``new_hi``), read from ``k``/``v``; through the tensor memory accelerator where descriptors of
    them are given (``k_desc``/``v_desc``, tiles whose every key is valid: the caller's interior)."""
    for n_start in range(start, stop, BLOCK_N):
        k_idx = n_start + offs_n
        k_ok = k_idx < new_hi
        if k_desc is not None:
            k_t = k_desc.load([row_start + n_start, kv_head * HEAD_DIM]).to(q.dtype)
            v_t = v_desc.load([row_start + n_start, kv_head * HEAD_DIM]).to(q.dtype)
        else:
            k_rows = (row_start + k_idx).to(tl.int64)
            k_t = tl.load(k_ptr + k_rows[:, None] * stride_k_t + kv_head * stride_k_h + offs_d[None, :],
                          mask=k_ok[:, None], other=0.0).to(q.dtype)
            v_t = tl.load(v_ptr + k_rows[:, None] * stride_v_t + kv_head * stride_v_h + offs_d[None, :],
                          mask=k_ok[:, None], other=0.0).to(q.dtype)
        m_i, l_i, acc = _online_softmax_step(
            q, k_t, v_t, ctx + k_idx, k_ok, q_blk, q_in_prompt, prompt_len, m_i, l_i, acc, qk_scale, BLOCK_SIZE,
            PREFIX_FULL, IEEE, k_floor, WINDOW, MASK,
        )
    return m_i, l_i, acc


@triton.jit
def _interior(start, stop, seen_from, seen_to, BLOCK_N: tl.constexpr):
    """The key tiles of ``[start, stop)`` (tiled from ``start``) that every valid row of the program sees whole:
    ``[u_lo, u_hi)``, both on the tile grid, ``u_lo`` the first tile at or above ``seen_from`` (the highest
    window floor), ``u_hi`` the end of the last whole tile below ``min(seen_to, stop)`` (``seen_to``: the
    lowest row limit). Tiles before ``u_lo`` and from ``u_hi`` on are the edges, folded with the mask."""
    whole = tl.cdiv(stop - start, BLOCK_N) * BLOCK_N
    u_lo = start + tl.minimum(tl.cdiv(tl.maximum(seen_from - start, 0), BLOCK_N) * BLOCK_N, tl.maximum(whole, 0))
    u_hi = u_lo + tl.maximum(tl.minimum(seen_to, stop) - u_lo, 0) // BLOCK_N * BLOCK_N
    return u_lo, u_hi


# An eager step's page tables are as wide as its longest request, so their row stride changes all the time;
# specialized (ints equal to 1 or divisible by 16), it would be a variant per class, compiled while serving.
@triton.jit(do_not_specialize=["stride_pt_r", "split_slots"])
def _paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    prefix_lens_ptr,
    page_tables_ptr,
    part_ml_ptr,  # [programs, split_slots, 2, BLOCK_M] fp32 split partials (max, denominator); unused if 1 split
    part_acc_ptr,  # [programs, split_slots, BLOCK_M, HEAD_DIM] fp32 split partial accumulators
    counters_ptr,  # [programs] int32, zero between launches: splits of a tile that have finished
    qk_scale,  # softmax scale * log2(e)
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_o_t,
    stride_o_h,
    stride_kc_p,
    stride_kc_s,
    stride_kc_h,
    stride_vc_p,
    stride_vc_s,
    stride_vc_h,
    stride_pt_r,
    split_slots,  # programs sharing one tile's keys (split-KV, combined by the last to finish); 1 if not SPLIT
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # query heads handled by one program (GROUP rounded up to a power of two, or 1)
    BLOCK_Q: tl.constexpr,  # query positions per program
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # diffusion block size (mask granularity)
    PREFIX_FULL: tl.constexpr,
    IEEE: tl.constexpr,  # exact fp32 dots (fp32 inputs); otherwise the inputs' native precision
    SPLIT: tl.constexpr,  # whether split_slots > 1 (a runtime count, so every split count is one variant)
    MIN_SPLIT_KEYS: tl.constexpr,  # fewest keys a split takes: below it, fewer splits do the work
    USE_PDL: tl.constexpr,  # programmatic dependent launch: metadata is read before q/k/v are ready
    PREFETCH_KEYS: tl.constexpr,  # cached keys (from the program's first) to prefetch into L2 before waiting
    LINE_ELEMS: tl.constexpr,  # cache elements per 128-byte line (at most HEAD_DIM)
    PRELOAD_TILE: tl.constexpr = False,  # load the first cached tile into registers before waiting (split launches)
    WINDOW: tl.constexpr = 0,  # sliding window: keys at or below `anchor - WINDOW` are hidden; 0 = no window
    WINDOW_FROM_CONTEXT: tl.constexpr = False,  # the window's anchor is the request's context length, not the row
    key_lens_ptr=None,  # [R] int32 end of each request's keys (with KEY_TAIL): cached keys after its rows up to it
    KEY_TAIL: tl.constexpr = False,  # some request attends to cached keys after its rows (`key_lens_ptr`)
    FULL_TILES: tl.constexpr = False,  # long-query class: interior key tiles unmasked, longest query tiles first
    k_desc=None,  # FULL_TILES: TMA descriptors of k and v as [T, kv_heads * HEAD_DIM] with [BLOCK_N, HEAD_DIM]
    v_desc=None,  # boxes, for the interior tiles of new keys; None: plain loads
    kc_desc=None,  # FULL_TILES: TMA descriptors of the caches as [pages * PAGE_SIZE, kv_heads * HEAD_DIM] with boxes
    vc_desc=None,  # of min(BLOCK_N, PAGE_SIZE) rows, for the interior tiles of cached keys; None: gathered loads
):
    release_dependents(USE_PDL)
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    tile_split = tl.program_id(0)
    req = tl.program_id(1)
    head_slot = tl.program_id(2)  # kv head (grouped) or query head (ungrouped)
    if FULL_TILES and not SPLIT:
        # A cold prompt's later query tiles see more keys. The GPU starts programs in the order of their linear index
        # (axis 0 fastest), so that order is read as (tile, request, head slot) with the tile slowest: every head's
        # and request's latest tile starts first, and the short ones fill the tail. Ordered within each head only, a
        # 2,048-token prompt's last heads would start their longest tiles when the others are nearly done.
        slots = tl.num_programs(2)
        per_tile = slots * tl.num_programs(1)
        linear = tl.program_id(0) + tl.num_programs(0) * (req + tl.num_programs(1) * head_slot)
        head_slot = linear % slots
        req = (linear // slots) % tl.num_programs(1)
        tile_split = tl.num_programs(0) - 1 - linear // per_tile
    if SPLIT:
        tile = tile_split // split_slots
        split = tile_split % split_slots
        if FULL_TILES:
            # A split launch's rows follow a long cached context, so its tiles see nearly as many keys; a head's
            # tiles stay next to each other in the launch order (the latest first), so that those reading the same
            # split's keys run at the same time.
            tile = tl.cdiv(tl.num_programs(0), split_slots) - 1 - tile
    else:
        tile = tile_split
        split = 0

    row_start = tl.load(cu_seqlens_q_ptr + req)
    q_len = tl.load(cu_seqlens_q_ptr + req + 1) - row_start
    q_begin = tile * BLOCK_Q
    if q_begin >= q_len:
        wait_for_inputs(USE_PDL)  # every program waits, so the launch never completes before its predecessor
        return
    ctx = tl.load(context_lens_ptr + req)
    prompt_len = tl.load(prefix_lens_ptr + req)

    if GROUP_PAD == 1:
        kv_head = head_slot // GROUP
    else:
        kv_head = head_slot

    offs_m = tl.arange(0, BLOCK_M)
    q_idx = q_begin + offs_m // GROUP_PAD  # query index inside the request
    if GROUP_PAD == 1:
        heads = head_slot + offs_m * 0
        row_ok = q_idx < q_len
    else:
        sub = offs_m % GROUP_PAD
        heads = kv_head * GROUP + sub
        row_ok = (q_idx < q_len) & (sub < GROUP)
    offs_d = tl.arange(0, HEAD_DIM)

    q_rows = (row_start + q_idx).to(tl.int64)

    q_pos = ctx + q_idx  # absolute positions of the rows
    q_blk = q_pos // BLOCK_SIZE
    q_in_prompt = q_pos < prompt_len
    # furthest key (exclusive) any valid row of the tile may see
    row_limit = (q_blk + 1) * BLOCK_SIZE
    if PREFIX_FULL:
        row_limit = tl.where(q_in_prompt, prompt_len, row_limit)
    row_limit = tl.where(row_ok, row_limit, 0)
    rows_end = ctx + q_len  # keys past the rows come from the cache (KEY_TAIL) or do not exist
    if KEY_TAIL:
        key_end = tl.maximum(tl.load(key_lens_ptr + req), rows_end)
    else:
        key_end = rows_end
    key_limit = tl.minimum(tl.max(row_limit, axis=0), key_end)
    # lowest key position each row may see, and the lowest any valid row of the tile may see
    if WINDOW > 0:
        if WINDOW_FROM_CONTEXT:
            k_floor = ctx - WINDOW + 1 + q_idx * 0
        else:
            k_floor = q_pos - WINDOW + 1
        key_start = tl.maximum(tl.min(tl.where(row_ok, k_floor, key_limit), axis=0), 0)
    else:
        k_floor = q_idx * 0
        key_start = 0
    if FULL_TILES:
        # every valid row sees keys [seen_from, seen_to) (and more): visibility is a prefix of positions per row
        seen_to = tl.min(tl.where(row_ok, row_limit, key_limit), axis=0)
        if WINDOW > 0:
            seen_from = tl.max(tl.where(row_ok, k_floor, key_start), axis=0)
        else:
            seen_from = key_start
    # this program's share of the key positions [key_start, key_limit)
    if not SPLIT:
        lo = key_start
        hi = key_limit
        active_splits = 1
    else:
        # Cached keys [0, ctx) and the step's new keys [ctx, key_limit) are chunked separately, so no split mixes
        # both: the new keys (written by the kernel just before) are then the whole work of their own split rather
        # than a serial tail of a cached one (measured on an H100 at batch 1: SDAR-1.7B replays 0.4 us per layer
        # faster). Chunks of `key_limit / (split_slots - 1)` keep both segments within split_slots splits (the
        # launch's split count plus one slot for the chunk the boundary cuts in two); keys that fit one chunk stay
        # in one split. Splits are sized for the launch bound, not this tile's keys: only the first `active_splits`
        # have keys; the others leave at once, so neither their partials nor their share of the combine cost
        # anything.
        span = key_limit - key_start
        new_from = tl.maximum(key_start, ctx)
        chunk = tl.maximum(tl.cdiv(tl.cdiv(span, split_slots - 1), BLOCK_N) * BLOCK_N, MIN_SPLIT_KEYS)
        cached_splits = tl.cdiv(tl.maximum(ctx - key_start, 0), chunk)
        active_splits = cached_splits + tl.cdiv(key_limit - new_from, chunk)
        if span <= chunk:
            active_splits = 1
        if split >= active_splits:
            wait_for_inputs(USE_PDL)
            return
        if active_splits == 1:
            lo = key_start
            hi = key_limit
        elif split < cached_splits:
            lo = key_start + split * chunk
            hi = tl.minimum(lo + chunk, ctx)
        else:
            lo = new_from + (split - cached_splits) * chunk
            hi = tl.minimum(lo + chunk, key_limit)

    pt_row = page_tables_ptr + req.to(tl.int64) * stride_pt_r
    cache_end = tl.minimum(ctx, hi)
    offs_n = tl.arange(0, BLOCK_N)
    if PREFETCH_KEYS > 0:
        # cached keys were written by earlier steps: start pulling this program's first ones into L2 while the
        # kernels producing q, k and v finish
        pk = lo + tl.arange(0, PREFETCH_KEYS)
        kc_rows, vc_rows = _cache_rows(
            pt_row, pk, pk < cache_end, kv_head, stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s,
            stride_vc_h, PAGE_SIZE,
        )
        lines = tl.arange(0, HEAD_DIM // LINE_ELEMS) * LINE_ELEMS
        prefetch_l2(k_cache_ptr + kc_rows[:, None] + lines[None, :])
        prefetch_l2(v_cache_ptr + vc_rows[:, None] + lines[None, :])
    if PRELOAD_TILE:
        # a split's cached share is mostly one tile: have its keys and values in registers by the time q is ready,
        # so that after the wait only q's load precedes the fold
        k_pre, v_pre, kpos_pre, kok_pre = _cached_tile(
            k_cache_ptr, v_cache_ptr, pt_row, lo, cache_end, kv_head, offs_n, offs_d, stride_kc_p, stride_kc_s,
            stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h, PAGE_SIZE,
        )
    # everything above is step metadata and earlier steps' cache; q, k and v come from the kernels just before
    wait_for_inputs(USE_PDL)
    q_ptrs = q_ptr + q_rows[:, None] * stride_q_t + heads[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # ---- cached keys [lo, min(ctx, hi)) gathered through the page table ----
    cached_lo = lo
    if PRELOAD_TILE:
        if lo < cache_end:
            m_i, l_i, acc = _online_softmax_step(
                q, k_pre.to(q.dtype), v_pre.to(q.dtype), kpos_pre, kok_pre, q_blk, q_in_prompt, prompt_len, m_i, l_i,
                acc, qk_scale, BLOCK_SIZE, PREFIX_FULL, IEEE, k_floor, WINDOW,
            )
        cached_lo = lo + BLOCK_N
    if FULL_TILES:
        # window edge tiles, the tiles every row sees whole (no mask), then the partial last tile
        u_lo, u_hi = _interior(cached_lo, cache_end, seen_from, seen_to, BLOCK_N)
        m_i, l_i, acc = _fold_cached(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row, cached_lo, u_lo, cache_end, kv_head, offs_n, offs_d,
            stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h, q_blk, q_in_prompt,
            prompt_len, qk_scale, k_floor, BLOCK_N, PAGE_SIZE, BLOCK_SIZE, PREFIX_FULL, IEEE, WINDOW, True,
        )
        if kc_desc is not None and WINDOW == 0:  # without a window the tiles start on page boundaries
            m_i, l_i, acc = _fold_cached_boxes(
                q, m_i, l_i, acc, kc_desc, vc_desc, pt_row, u_lo, u_hi, kv_head, qk_scale, BLOCK_N, PAGE_SIZE,
                HEAD_DIM, IEEE,
            )
        else:
            m_i, l_i, acc = _fold_cached(
                q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row, u_lo, u_hi, cache_end, kv_head, offs_n, offs_d,
                stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h, q_blk, q_in_prompt,
                prompt_len, qk_scale, k_floor, BLOCK_N, PAGE_SIZE, BLOCK_SIZE, PREFIX_FULL, IEEE, WINDOW, False,
            )
        m_i, l_i, acc = _fold_cached(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row, u_hi, cache_end, cache_end, kv_head, offs_n, offs_d,
            stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h, q_blk, q_in_prompt,
            prompt_len, qk_scale, k_floor, BLOCK_N, PAGE_SIZE, BLOCK_SIZE, PREFIX_FULL, IEEE, WINDOW, True,
        )
    else:
        m_i, l_i, acc = _fold_cached(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, pt_row, cached_lo, cache_end, cache_end, kv_head, offs_n,
            offs_d, stride_kc_p, stride_kc_s, stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h, q_blk, q_in_prompt,
            prompt_len, qk_scale, k_floor, BLOCK_N, PAGE_SIZE, BLOCK_SIZE, PREFIX_FULL, IEEE, WINDOW, True,
        )

    # ---- the request's own new keys: absolute positions [max(lo, ctx), min(hi, ctx + q_len)) ----
    new_lo = tl.maximum(lo, ctx) - ctx
    if KEY_TAIL:
        new_hi = tl.minimum(hi, rows_end) - ctx
    else:
        new_hi = hi - ctx  # hi <= key_limit <= ctx + q_len
    if FULL_TILES:
        # in row indices: the window's edge, the interior (no mask), the diagonal band of block-causal rows
        u_lo, u_hi = _interior(new_lo, new_hi, seen_from - ctx, seen_to - ctx, BLOCK_N)
        m_i, l_i, acc = _fold_new(
            q, m_i, l_i, acc, k_ptr, v_ptr, row_start, ctx, new_lo, u_lo, new_hi, kv_head, offs_n, offs_d,
            stride_k_t, stride_k_h, stride_v_t, stride_v_h, q_blk, q_in_prompt, prompt_len, qk_scale, k_floor,
            BLOCK_N, BLOCK_SIZE, PREFIX_FULL, IEEE, WINDOW, True,
        )
        m_i, l_i, acc = _fold_new(
            q, m_i, l_i, acc, k_ptr, v_ptr, row_start, ctx, u_lo, u_hi, new_hi, kv_head, offs_n, offs_d,
            stride_k_t, stride_k_h, stride_v_t, stride_v_h, q_blk, q_in_prompt, prompt_len, qk_scale, k_floor,
            BLOCK_N, BLOCK_SIZE, PREFIX_FULL, IEEE, WINDOW, False, k_desc, v_desc, HEAD_DIM,
        )
        m_i, l_i, acc = _fold_new(
            q, m_i, l_i, acc, k_ptr, v_ptr, row_start, ctx, u_hi, new_hi, new_hi, kv_head, offs_n, offs_d,
            stride_k_t, stride_k_h, stride_v_t, stride_v_h, q_blk, q_in_prompt, prompt_len, qk_scale, k_floor,
            BLOCK_N, BLOCK_SIZE, PREFIX_FULL, IEEE, WINDOW, True,
        )
    else:
        for n_start in range(new_lo, new_hi, BLOCK_N):
            k_idx = n_start + offs_n
            k_ok = k_idx < new_hi
            k_rows = (row_start + k_idx).to(tl.int64)
            k_ptrs = k_ptr + k_rows[:, None] * stride_k_t + kv_head * stride_k_h + offs_d[None, :]
            v_ptrs = v_ptr + k_rows[:, None] * stride_v_t + kv_head * stride_v_h + offs_d[None, :]
            k_t = tl.load(k_ptrs, mask=k_ok[:, None], other=0.0).to(q.dtype)
            v_t = tl.load(v_ptrs, mask=k_ok[:, None], other=0.0).to(q.dtype)
            m_i, l_i, acc = _online_softmax_step(
                q,
                k_t,
                v_t,
                ctx + k_idx,
                k_ok,
                q_blk,
                q_in_prompt,
                prompt_len,
                m_i,
                l_i,
                acc,
                qk_scale,
                BLOCK_SIZE,
                PREFIX_FULL,
                IEEE,
                k_floor,
                WINDOW,
            )

    # ---- cached keys after the rows: absolute positions [max(lo, ctx + q_len), hi) ----
    if KEY_TAIL:
        for n_start in range(tl.maximum(lo, rows_end), hi, BLOCK_N):
            k_t, v_t, k_pos, k_ok = _cached_tile(
                k_cache_ptr, v_cache_ptr, pt_row, n_start, hi, kv_head, offs_n, offs_d, stride_kc_p, stride_kc_s,
                stride_kc_h, stride_vc_p, stride_vc_s, stride_vc_h, PAGE_SIZE,
            )
            m_i, l_i, acc = _online_softmax_step(
                q, k_t.to(q.dtype), v_t.to(q.dtype), k_pos, k_ok, q_blk, q_in_prompt, prompt_len, m_i, l_i, acc,
                qk_scale, BLOCK_SIZE, PREFIX_FULL, IEEE, k_floor, WINDOW,
            )

    if not SPLIT:
        _store_output(out_ptr, acc, l_i, q_rows, heads, offs_d, row_ok, stride_o_t, stride_o_h)
    elif active_splits == 1:  # keys too few to split: write as an unsplit launch would
        _store_output(out_ptr, acc, l_i, q_rows, heads, offs_d, row_ok, stride_o_t, stride_o_h)
    else:
        # publish this split's partial state; the last active split of the tile to finish combines them all
        tile_id = (req * tl.num_programs(2) + head_slot) * tl.cdiv(tl.num_programs(0), split_slots) + tile
        tile_id = tile_id.to(tl.int64)
        ml_base = part_ml_ptr + (tile_id * split_slots + split) * (2 * BLOCK_M)
        tl.store(ml_base + offs_m, m_i)
        tl.store(ml_base + BLOCK_M + offs_m, l_i)
        acc_base = part_acc_ptr + (tile_id * split_slots + split) * (BLOCK_M * HEAD_DIM)
        tl.store(acc_base + offs_m[:, None] * HEAD_DIM + offs_d[None, :], acc)
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + tile_id, 1, sem="acq_rel", scope="gpu")
        if done == active_splits - 1:
            tl.atomic_xchg(counters_ptr + tile_id, 0, sem="relaxed", scope="gpu")  # ready for the next launch
            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
            for s in range(0, active_splits):
                m_s, l_s, acc_s = _load_partial(
                    part_ml_ptr, part_acc_ptr, tile_id * split_slots + s, offs_m, offs_d, BLOCK_M, HEAD_DIM
                )
                m_i, l_i, acc = _merge_partial(m_i, l_i, acc, m_s, l_s, acc_s)
            _store_output(out_ptr, acc, l_i, q_rows, heads, offs_d, row_ok, stride_o_t, stride_o_h)


@triton.jit
def _load_partial(part_ml_ptr, part_acc_ptr, part, offs_m, offs_d, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Split partial ``part``'s (max, denominator, accumulator), written by another program of this launch."""
    part = part.to(tl.int64)
    ml = part_ml_ptr + part * (2 * BLOCK_M) + offs_m
    m = tl.load(ml, cache_modifier=".cg")
    l_s = tl.load(ml + BLOCK_M, cache_modifier=".cg")
    acc_ptrs = part_acc_ptr + part * (BLOCK_M * HEAD_DIM) + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
    acc = tl.load(acc_ptrs, cache_modifier=".cg")
    return m, l_s, acc


@triton.jit
def _merge_partial(m_i, l_i, acc, m_s, l_s, acc_s):
    """Fold one split's partial softmax state into the running one."""
    m_new = tl.maximum(m_i, m_s)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    beta = tl.exp2(m_s - m_safe)
    return m_new, l_i * alpha + l_s * beta, acc * alpha[:, None] + acc_s * beta[:, None]


@triton.jit
def _store_output(out_ptr, acc, l_i, q_rows, heads, offs_d, row_ok, stride_o_t, stride_o_h):
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_ptrs = out_ptr + q_rows[:, None] * stride_o_t + heads[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def _tile_shapes(
    max_query_len: int, group_pad: int, head_dim: int, elem_size: int = 2, large_grid_fills: bool = True
) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_N) of the decode-sized classes: 16 rows per tile (the minimum ``tl.dot`` shape) where a
    request's queries fit them (a decode step), otherwise 64. Two tile classes rather than every power of two
    between (and a third for prompts, `_long_query_tiles`) keep the kernel's variants few enough for `warm_up` to
    compile them all before serving.

    A group's packed rows decide the class where the 64-row class's grid fills the GPU (``large_grid_fills``): each
    K/V tile is then read once per group. Where it would not (a few requests of several blocks each: batch 1 at
    buffer 4, whose keys are split anyway), queries that fit 16 rows one head at a time take the 16-row class over
    several query tiles: twice the programs of unpadded tiles rather than half-padded 64-row ones. On an H100
    (`bench/step_anatomy.py`, graph replay) SDAR-1.7B batch 1 at buffer 4 went 1.625 -> 1.482 ms a step and
    SDAR-8B at buffer 2 5.475 -> 5.299; at batch 32 the same tiles cost 1-2% (each K/V tile read twice), hence
    only where the grid does not fill.

    Wide heads (``head_dim >= _WIDE_HEAD_DIM``, DiffusionGemma's global layers) always take 16-row tiles: a
    64 x 512 float32 accumulator alone would fill the registers of 8 warps; their key tiles shrink to 16 rows in
    4-byte inputs so that two pipeline stages of K and V fit shared memory."""
    rows_per_query = group_pad if large_grid_fills else 1
    fits_small = _next_pow2(max_query_len) * rows_per_query <= _SMALL_TILE_ROWS
    block_m = _SMALL_TILE_ROWS if fits_small or head_dim >= _WIDE_HEAD_DIM else _LARGE_TILE_ROWS
    block_q = max(1, block_m // group_pad)
    block_n = 64 if head_dim <= 128 else 32
    if head_dim >= _WIDE_HEAD_DIM and elem_size > 2:
        block_n = 16
    return block_q, block_n


def _fills_gpu(device: torch.device, programs: int) -> bool:
    """Whether a grid of ``programs`` occupies every SM; off CUDA, taken as yes."""
    return device.type != "cuda" or programs >= sm_count(device)


def _large_grid_programs(max_query_len: int, group_pad: int, num_requests: int, head_slots: int) -> int:
    """Programs of a launch in the 64-row class (its query tiles, requests and head slots), unsplit."""
    return triton.cdiv(max_query_len, max(1, _LARGE_TILE_ROWS // group_pad)) * num_requests * head_slots


_SMALL_TILE_ROWS = 16
_LARGE_TILE_ROWS = 64
_WIDE_HEAD_DIM = 512


@dataclass(frozen=True)
class LongQueryTiles:
    """The launch shape of the long-query class (a prompt's prefill): ``rows`` query rows per program (positions
    times the packed heads of one KV head), ``block_n`` keys per inner iteration, and the launch's warps and
    software-pipeline stages (at most two with 4-byte inputs, whose K/V tiles are twice the size). ``split_keys``:
    whether the class also takes launches whose grid cannot fill the GPU, with their keys split (otherwise the
    decode-sized classes take those)."""

    rows: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3
    split_keys: bool = True

    def __post_init__(self) -> None:
        for name in ("rows", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name}={value} must be a power of two >= 16")
        if self.num_warps not in (4, 8, 16):
            raise ValueError(f"num_warps={self.num_warps} must be 4, 8 or 16")
        if self.num_stages < 1:
            raise ValueError(f"num_stages={self.num_stages} must be >= 1")


# The long-query class: a launch whose longest query has at least `_LONG_QUERY_MIN` positions (so more rows than
# PDL chains: the class never waits on PDL) folds larger query tiles and skips the mask on interior key tiles. Where
# its grid cannot fill the GPU its keys are split as the other classes' are; where the grid fills it but the longest
# request's tiles alone do not (a chunk beside many decoders, unsplit), the 64-row class (more programs for the long
# request) runs instead. Heads of at most 128 take `_LONG_QUERY_TILES`; wider heads (DiffusionGemma's 256 and 512:
# a canvas of 256 rows over its context, an encoder's prompt) the tiles of `_WIDE_LONG_QUERY_TILES`, whose fp32
# accumulator (rows x head_dim) must still fit the registers of its warps; heads wider than every entry never take
# the class.
_LONG_QUERY_MIN = 128
_LONG_QUERY_TILES = LongQueryTiles()
# Measured on an H200 (`bench/wide_head_attention_bench.py`, DiffusionGemma-26B-A4B's layers, bf16): 8 canvases of
# 256 rows after 512 cached positions, sliding layers 0.222 -> 0.087 ms, full layers 0.674 -> 0.358; a 2,048-token
# encoder prompt 0.185 -> 0.097 and 0.903 -> 0.418. One canvas (its grid too small: keys split) ran faster in the
# decode-sized tiles (0.061 against 0.082, 0.086 against 0.113), so these never take split launches. 64 x 32 tiles
# in 3 stages exceed an H200's shared memory at heads of 512.
_WIDE_LONG_QUERY_TILES = {
    256: LongQueryTiles(rows=128, block_n=32, num_warps=8, num_stages=3, split_keys=False),
    512: LongQueryTiles(rows=64, block_n=32, num_warps=8, num_stages=2, split_keys=False),
}
# Keys one split takes at least (a multiple of every BLOCK_N). Measured at batch 1 on an H100
# (`bench/attention_splits.py`): 64 is fastest up to 1k-token contexts, 256 by 1-2 us from 2k; decode contexts are
# mostly short, so 64.
_MIN_KEYS_PER_SPLIT = 64
_MAX_SPLITS = 32
# Software-pipeline depth of the key loops. A split program sized for short contexts folds only a few tiles, where
# the pipeline's prologue costs more than it hides: one stage replayed the SDAR-1.7B batch-1 graph 0.012 ms faster on
# an H100 (1.478 against 1.490 ms). A launch sized for long contexts (its key bound gives a split
# `_PIPELINED_SPLIT_KEYS` keys or more) takes two: on an H100, 4 decode rows at batch 1, graph-replayed
# (`bench/attention_splits.py --bound 40960 --split-stages 1 2 3`), a 32k context 73 -> 63 us a layer, 8k 25.7 ->
# 24.3, while a 2k context under the same bound pays 12.2 -> 12.9. Unsplit launches (large grids, long key loops)
# keep two.
_STAGES_UNSPLIT = 2
_STAGES_SPLIT = 1
_STAGES_SPLIT_LONG = 2
_PIPELINED_SPLIT_KEYS = 256
# With programmatic dependent launch, the cached keys each program prefetches into L2 before its inputs are ready
# (a split's first 64-key share at batch 1, and then some).
_PREFETCH_KEYS = 128


def long_query_tiles_for(head_dim: int, elem_size: int = 2) -> LongQueryTiles | None:
    """The long-query class's tiles for heads of ``head_dim`` in inputs of ``elem_size`` bytes: those of the
    narrowest entry that holds them, None where no entry does (the decode-sized classes then take every query).
    Wide heads in 4-byte inputs have none: heads of `_WIDE_HEAD_DIM` would need 128 KB of shared memory for
    their 64-row query tile alone (an H200 has 227), and heads of 256 compile for minutes (150 s for one variant
    on an H200's host, where bf16 takes seconds); float32 is the GPU's reference dtype, not its fast path."""
    if head_dim <= 128:
        return _LONG_QUERY_TILES
    if elem_size > 2:
        return None
    fitting = [width for width in _WIDE_LONG_QUERY_TILES if head_dim <= width]
    return _WIDE_LONG_QUERY_TILES[min(fitting)] if fitting else None


def _long_query_tiles(
    device: torch.device, max_query_len: int, group_pad: int, head_dim: int, slots: int, num_requests: int,
    max_kv_len: int, num_splits: int | None, min_split_keys: int, long_requests: int = 1, elem_size: int = 2,
) -> LongQueryTiles | None:
    """The long-query class's tiles if this launch takes it (a query of `_LONG_QUERY_MIN` positions or more, heads that
    `long_query_tiles_for` has tiles for); None: the decode-sized classes of `_tile_shapes`. A split count asked for is
    taken as is. Otherwise the class runs where the programs of its ``long_requests`` long requests alone (each taken as
    long as the longest: its query tiles times ``slots``, the head slots) fill the GPU, or where the whole grid does not
    and its keys are split anyway (a prefix hit's tail, a prompt chunk's prefill graph: one request over a long
    context). It gives way where the grid fills the GPU but the long requests' programs do not (a chunk beside many
    decoders in one launch): no split then, and a chunk in fewer, larger tiles than SMs would leave SMs idle while it
    folds its long context. Several canvases of DiffusionGemma's decoder are all long. Tiles that do not take split keys
    (`LongQueryTiles.split_keys`) give way wherever the grid would be split or a split is asked for."""
    tiles = long_query_tiles_for(head_dim, elem_size)
    if max_query_len < _LONG_QUERY_MIN or tiles is None:
        return None
    if num_splits is not None and num_splits > 1 and not tiles.split_keys:
        return None
    if num_splits is None:
        longest = triton.cdiv(max_query_len, max(1, tiles.rows // group_pad)) * slots
        grid_splits = _auto_num_splits(device, longest * num_requests, max_kv_len, min_split_keys)
        long_splits = _auto_num_splits(device, longest * max(1, long_requests), max_kv_len, min_split_keys)
        if (long_splits > 1 and grid_splits == 1) or (grid_splits > 1 and not tiles.split_keys):
            return None
    return tiles


def _new_key_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[object, object]:
    """TMA descriptors of the step's new keys and values for the long-query class's interior tiles, or
    ``(None, None)`` where TMA cannot read both (`diffulex.kernels.tma.descriptor`: before Hopper, misaligned
    strides, 4-byte inputs whose rows of 128 exceed a box). Each views ``[T, kv_heads, head_dim]`` as ``[T, kv_heads
    * head_dim]`` with ``[block_n, head_dim]`` boxes: a tile of one KV head is one copy that the hardware issues
    while the previous tiles' products run, instead of per-thread loads."""
    head_dim = k.shape[2]
    descriptors = []
    for x in (k, v):
        if x.stride(1) != head_dim:
            return None, None
        flat = x.as_strided((x.shape[0], x.shape[1] * head_dim), (x.stride(0), 1))
        descriptors.append(tma.descriptor(flat, [block_n, head_dim]))
    return (None, None) if None in descriptors else tuple(descriptors)


def _cache_descriptors(k_cache: torch.Tensor, v_cache: torch.Tensor, block_n: int) -> tuple[object, object]:
    """TMA descriptors of the K and V caches for the long-query class's interior tiles of cached keys, or
    ``(None, None)``: each cache ``[pages, page_size, kv_heads, head_dim]`` (contiguous) viewed as ``[pages *
    page_size, kv_heads * head_dim]``, a box one KV head's rows of one page, all of a tile's keys where a page holds
    the tile, half of them where a page holds half (`_fold_cached_boxes`); other page sizes, other layouts and what
    `diffulex.kernels.tma.descriptor` refuses gather their rows as before."""
    page_size = k_cache.shape[1]
    if page_size < block_n and 2 * page_size != block_n:
        return None, None
    descriptors = []
    for cache in (k_cache, v_cache):
        if cache.dim() != 4 or not cache.is_contiguous():
            return None, None
        pages, _, heads, head_dim = cache.shape
        box = [min(block_n, page_size), head_dim]
        descriptors.append(tma.descriptor(cache.view(pages * page_size, heads * head_dim), box))
    return (None, None) if None in descriptors else tuple(descriptors)


def _split_stages(max_kv_len: int, num_splits: int) -> int:
    """Pipeline stages of a split launch: two where its key bound gives each split `_PIPELINED_SPLIT_KEYS` keys or
    more (long contexts: enough tiles per program for the prologue to pay), else one."""
    return _STAGES_SPLIT_LONG if max_kv_len >= _PIPELINED_SPLIT_KEYS * num_splits else _STAGES_SPLIT


def _auto_num_splits(device: torch.device, programs: int, max_keys: int, min_split_keys: int) -> int:
    """Split the keys of each tile when the grid alone cannot fill the GPU (few requests, long prefixes): about
    two programs per SM, no split with fewer than `min_split_keys` keys. The count is a runtime argument of the
    kernel, so any count reuses the one compiled split variant."""
    if device.type != "cuda" or _fills_gpu(device, programs):
        return 1
    return max(1, min(triton.cdiv(2 * sm_count(device), programs), max_keys // min_split_keys, _MAX_SPLITS))


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    grouped: bool = True,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    min_split_keys: int | None = None,
    window: int = 0,
    window_from_context: bool = False,
) -> torch.Tensor:
    """Drop-in for `paged_attention`: q ``[T, H, D]``, k/v ``[T, Hkv, D]``, caches ``[P, page_size, Hkv, D]``.

    ``grouped=True`` (``attn_impl="triton_grouped"``) packs the query heads of one KV head into one program;
    ``grouped=False`` (``attn_impl="triton"``) runs one program per query head. ``out`` (``[T, H, D]``, q's dtype)
    may be given to write into; every row of a request with ``q_len > 0`` is written. ``num_splits`` forces the
    split-KV factor (default: chosen from the grid size and the longest context, 1 off CUDA; one more program per
    tile takes the chunk that the boundary of cached and new keys cuts in two); ``min_split_keys`` (a
    multiple of 64) is the fewest keys one split takes, so short contexts use fewer splits than the launch has
    (default `_MIN_KEYS_PER_SPLIT`); either left None takes the metadata's (`PagedAttentionMetadata.num_splits`,
    ``min_split_keys``), where a step's shape fixes them.
    ``window > 0`` is a sliding window (`torch_paged.paged_attention`'s ``window`` and ``window_from_context``).
    With the metadata's device ``key_lens`` a request also attends to the cached keys after its rows, up to its
    key length (`PagedAttentionMetadata.key_lens`).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16")
    if k_cache.shape[1] != meta.page_size:
        raise ValueError(f"cache page size {k_cache.shape[1]} != metadata page_size {meta.page_size}")
    if window < 0:
        raise ValueError(f"window={window} must be >= 0 (0: no sliding window)")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must have q's shape and dtype and be contiguous in head_dim")
    if num_splits is None:
        num_splits = meta.num_splits
    if min_split_keys is None:
        min_split_keys = meta.min_split_keys or _MIN_KEYS_PER_SPLIT
    num_requests = meta.page_tables.shape[0]
    if num_tokens == 0 or num_requests == 0 or meta.max_query_len == 0:
        return out
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache must be contiguous in head_dim")
    if meta.key_lens is not None and (meta.key_lens.dtype != torch.int32 or meta.key_lens.shape[0] < num_requests):
        raise ValueError(
            f"key_lens must be int32 with one entry per request ({num_requests}), got {meta.key_lens.dtype} "
            f"of shape {tuple(meta.key_lens.shape)}"
        )
    page_tables = meta.page_tables
    if page_tables.dtype != torch.int32:
        page_tables = page_tables.to(torch.int32)

    group = num_heads // num_kv_heads
    group_pad = _next_pow2(group) if grouped else 1
    max_query_len = meta.max_query_len
    head_slots = num_kv_heads if grouped else num_heads
    long_requests = sum(n >= _LONG_QUERY_MIN for n in meta.query_lens_cpu)
    long_tiles = _long_query_tiles(q.device, max_query_len, group_pad, head_dim, head_slots, num_requests,
                                   meta.max_kv_len, num_splits, min_split_keys, long_requests, q.element_size())
    if long_tiles is not None:
        block_q, block_n = max(1, long_tiles.rows // group_pad), long_tiles.block_n
    else:
        large_grid = _large_grid_programs(max_query_len, group_pad, num_requests, head_slots)
        block_q, block_n = _tile_shapes(
            max_query_len, group_pad, head_dim, q.element_size(), large_grid_fills=_fills_gpu(q.device, large_grid)
        )
    q_tiles = triton.cdiv(max_query_len, block_q)
    programs = q_tiles * num_requests * head_slots
    if num_splits is None:
        num_splits = _auto_num_splits(q.device, programs, meta.max_kv_len, min_split_keys)
    # one slot more than splits: the chunk that the cached/new boundary cuts becomes two splits
    split_slots = num_splits + 1 if num_splits > 1 else 1
    if split_slots > 1:
        block_m = block_q * group_pad
        part_ml = torch.empty(programs * split_slots * 2 * block_m, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(programs * split_slots * block_m * head_dim, dtype=torch.float32, device=q.device)
        counters = split_counters(q.device, programs)
    else:
        part_ml = part_acc = counters = out  # never read
    grid = (q_tiles * split_slots, num_requests, head_slots)
    use_pdl = long_tiles is None and pdl_enabled(q.device, num_tokens)
    k_desc = v_desc = kc_desc = vc_desc = None
    if long_tiles is not None:
        k_desc, v_desc = _new_key_descriptors(k, v, block_n)
        kc_desc, vc_desc = _cache_descriptors(k_cache, v_cache, block_n)
        num_warps = long_tiles.num_warps
        num_stages = long_tiles.num_stages if q.element_size() <= 2 else min(long_tiles.num_stages, 2)
    else:
        num_warps = 4 if head_dim <= 128 else 8
        num_stages = _split_stages(meta.max_kv_len, num_splits) if split_slots > 1 else _STAGES_UNSPLIT
    _paged_attention_kernel[grid](
        q,
        k,
        v,
        k_cache,
        v_cache,
        out,
        meta.cu_seqlens_q,
        meta.context_lens,
        meta.prefix_lens,
        page_tables,
        part_ml,
        part_acc,
        counters,
        float(scale) * _LOG2E,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_tables.stride(0),
        split_slots,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        PAGE_SIZE=meta.page_size,
        BLOCK_SIZE=meta.block_size,
        PREFIX_FULL=bool(meta.prefix_full),
        IEEE=q.dtype == torch.float32,
        SPLIT=split_slots > 1,
        MIN_SPLIT_KEYS=min_split_keys,
        USE_PDL=use_pdl,
        PREFETCH_KEYS=_PREFETCH_KEYS if use_pdl else 0,
        LINE_ELEMS=min(head_dim, 128 // k_cache.element_size()),
        # a split program of the decode-sized classes loads its first cached tile before its PDL wait
        PRELOAD_TILE=split_slots > 1 and long_tiles is None,
        WINDOW=window,
        WINDOW_FROM_CONTEXT=window_from_context and window > 0,
        key_lens_ptr=meta.key_lens,
        KEY_TAIL=meta.key_lens is not None,
        FULL_TILES=long_tiles is not None,
        k_desc=k_desc,
        v_desc=v_desc,
        kc_desc=kc_desc,
        vc_desc=vc_desc,
        num_warps=num_warps,
        num_stages=num_stages,
        **launch_kwargs(use_pdl),
    )
    return out


def warm_up(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    block_size: int,
    prefix_full: bool,
    grouped: bool,
    *,
    window: int = 0,
    window_from_context: bool = False,
    key_tails: bool = False,
) -> None:
    """Compile now every variant of the kernel a step of this layer geometry can launch, so that none compiles
    while serving (a compile stalls its step for a second or more; the first short prompt would pay it).

    A launch's variant is fixed by its tile class (`_tile_shapes`: a decode-sized query or a longer one;
    `_long_query_tiles`: a prompt's, never chained), whether it splits keys (not how many: the split
    count is a runtime argument) and whether it chains by PDL (at most `PDL_MAX_ROWS` rows). Each case here is a
    tiny launch (one or a few requests, no cached keys) that lands in one of those variants; on a device without
    PDL the PDL cases fall into variants already compiled. The caches are only read through a request's page table,
    which here has no pages in use, and nothing is stored. With ``key_tails`` (a strategy whose requests attend
    past their rows) every case is launched once more with key ends.
    """
    if k_cache.device.type == "cuda":
        for tails in (False, True) if key_tails else (False,):
            _launch_every_variant(
                k_cache, v_cache, num_heads, block_size, prefix_full, grouped, window=window,
                window_from_context=window_from_context, key_tails=tails,
            )


def _launch_every_variant(
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, block_size: int, prefix_full: bool, grouped: bool,
    *, window: int = 0, window_from_context: bool = False, key_tails: bool = False,
) -> None:  # fmt: skip
    from diffulex.kernels.pdl import PDL_MAX_ROWS

    device = k_cache.device
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    group_pad = _next_pow2(num_heads // num_kv_heads) if grouped else 1
    head_slots = num_kv_heads if grouped else num_heads
    first_large = max(1, _SMALL_TILE_ROWS // group_pad + 1)  # fewest queries of one request in the large class
    # each case the query lengths of its requests: the small class chained by PDL and not; the large class chained,
    # in one request of more queries than 16 rows hold one head at a time (the large class whatever the grid) and in
    # the fewest requests whose large-class grid fills the GPU (`_tile_shapes`: where it does not, fewer queries take
    # the small class), the others of one query; unchained, in several requests (one request of that many queries
    # may be a long one)
    fill = next(n for n in itertools.count(1) if _fills_gpu(device, _large_grid_programs(1, group_pad, n, head_slots)))
    cases = [
        [1],
        [1] * (PDL_MAX_ROWS + 1),
        [first_large],
        [_SMALL_TILE_ROWS + 1],
        [first_large] + [1] * (fill - 1),
        [first_large] * max(fill, PDL_MAX_ROWS // first_large + 1),
    ]
    if long_query_tiles_for(head_dim, k_cache.element_size()) is not None:
        cases.append([_LONG_QUERY_MIN])  # the long-query class, split or not
    for q_lens in cases:
        num_requests, rows = len(q_lens), sum(q_lens)
        cu_seqlens = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        q = torch.zeros(rows, num_heads, head_dim, dtype=k_cache.dtype, device=device)
        kv = torch.zeros(rows, num_kv_heads, head_dim, dtype=k_cache.dtype, device=device)
        meta = PagedAttentionMetadata(
            cu_seqlens_q=cu_seqlens,
            context_lens=torch.zeros(num_requests, dtype=torch.int32, device=device),
            prefix_lens=cu_seqlens.diff(),
            page_tables=torch.full((num_requests, 1), -1, dtype=torch.int32, device=device),
            slot_mapping=torch.full((rows,), -1, dtype=torch.int64, device=device),
            block_size=block_size,
            page_size=k_cache.shape[1],
            prefix_full=prefix_full,
            query_lens_cpu=q_lens,
            context_lens_cpu=[0] * num_requests,
            prefix_lens_cpu=q_lens,
            key_lens=torch.zeros(num_requests, dtype=torch.int32, device=device) if key_tails else None,
        )
        # unsplit; split under a short key bound (one stage); split under a long one (`_split_stages`: two)
        long_bound = replace(meta, max_kv_len=2 * _PIPELINED_SPLIT_KEYS)
        for num_splits, launch_meta in ((1, meta), (2, meta), (2, long_bound)):
            triton_paged_attention(
                q, kv, kv, k_cache, v_cache, launch_meta, 1.0, grouped=grouped, num_splits=num_splits,
                window=window, window_from_context=window_from_context,
            )

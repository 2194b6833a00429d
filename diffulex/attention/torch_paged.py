"""Plain PyTorch attention over the paged KV cache: the reference every faster backend is checked against.

It loops over the requests of the batch (on the host, using the CPU copies of the ragged layout), gathers each
request's cached K/V through its page table, appends the K/V of the step's new rows, and runs masked softmax
attention. Slow but obviously right, and the engine's CPU path.
"""

from __future__ import annotations

import torch

from diffulex.attention.mask import visibility_mask
from diffulex.attention.metadata import DenseAttentionMetadata, PagedAttentionMetadata


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write the K/V rows whose slot is >= 0 into the cache (``[num_pages, page_size, kv_heads, head_dim]``)."""
    keep = slot_mapping >= 0
    if not bool(keep.any()):
        return
    slots = slot_mapping[keep]
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    k_flat.index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_flat.index_copy_(0, slots, v[keep].to(v_cache.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention with grouped KV heads. q ``[Tq, H, D]``, k/v ``[Tk, Hkv, D]`` -> ``[Tq, H, D]``."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float())
    return out.to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedAttentionMetadata,
    scale: float,
    window: int = 0,
    window_from_context: bool = False,
) -> torch.Tensor:
    """Attention of each request's new rows over its cached prefix, its own new rows and, where the metadata says
    so, the cached keys after them (mask: `mask.py`).

    ``window > 0`` (sliding-window layers) also hides the keys at or below ``anchor - window``: the anchor is the
    row's own position (a causal sliding window), or with ``window_from_context`` its request's context length
    (every row then sees the last ``window - 1`` cached positions and all of the step's rows)."""
    out = torch.empty_like(q)
    page_size = meta.page_size
    row = 0
    for r in range(meta.num_requests):
        q_len, ctx = meta.query_lens_cpu[r], meta.context_lens_cpu[r]
        if q_len == 0:
            continue
        q_r, k_new, v_new = q[row : row + q_len], k[row : row + q_len], v[row : row + q_len]
        key_len = ctx + q_len if meta.key_lens_cpu is None else max(ctx + q_len, meta.key_lens_cpu[r])
        cached_len = ctx if key_len == ctx + q_len else key_len  # a tail of cached keys reads the pages past the rows
        if cached_len > 0:
            num_pages = (cached_len + page_size - 1) // page_size
            pages = meta.page_tables[r, :num_pages].long()
            k_old = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:cached_len].to(k_new.dtype)
            v_old = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:cached_len].to(v_new.dtype)
            # this step's rows take their place among the cached keys (theirs are the fresh ones)
            k_r = torch.cat([k_old[:ctx], k_new, k_old[ctx + q_len :]])
            v_r = torch.cat([v_old[:ctx], v_new, v_old[ctx + q_len :]])
        else:
            k_r, v_r = k_new, v_new
        q_pos = torch.arange(ctx, ctx + q_len, device=q.device)
        k_pos = torch.arange(0, key_len, device=q.device)
        allowed = visibility_mask(q_pos, k_pos, meta.block_size, meta.prefix_full, meta.prefix_lens_cpu[r])
        if window > 0:
            anchor = torch.full_like(q_pos, ctx) if window_from_context else q_pos
            allowed &= k_pos[None, :] > anchor[:, None] - window
        out[row : row + q_len] = _attend(q_r, k_r, v_r, allowed, scale)
        row += q_len
    return out


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DenseAttentionMetadata, scale: float
) -> torch.Tensor:
    """Attention over one whole sequence with an explicit mask; no cache (the reference decoder's path)."""
    k, v = meta.exchange_kv(k, v)
    return _attend(q, k, v, meta.allowed.to(q.device), scale)

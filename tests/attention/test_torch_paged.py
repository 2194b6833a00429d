"""The PyTorch paged attention path with cached keys after a request's rows (`PagedAttentionMetadata.key_lens_cpu`):
rows in the middle of a cached block attend to the cache before them, to themselves (fresh, not the cached entries
at their positions) and to the cache after them, under the block-causal rule."""

from __future__ import annotations

import torch

from diffulex.attention import PagedAttentionMetadata
from diffulex.attention.mask import visibility_mask
from diffulex.attention.torch_paged import paged_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK = 4, 2, 8, 4, 8
SCALE = HEAD_DIM**-0.5


def dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * SCALE
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def metadata(ctx: int, q_len: int, key_len: int | None, pages: list[int]) -> PagedAttentionMetadata:
    return PagedAttentionMetadata(
        cu_seqlens_q=torch.tensor([0, q_len], dtype=torch.int32), context_lens=torch.tensor([ctx], dtype=torch.int32),
        prefix_lens=torch.tensor([3], dtype=torch.int32), page_tables=torch.tensor([pages], dtype=torch.int32),
        slot_mapping=torch.full((q_len,), -1, dtype=torch.long), block_size=BLOCK, page_size=PAGE_SIZE,
        prefix_full=False, query_lens_cpu=[q_len], context_lens_cpu=[ctx], prefix_lens_cpu=[3],
        key_lens_cpu=None if key_len is None else [key_len],
    )  # fmt: skip


def test_rows_inside_a_cached_block_attend_to_the_cache_around_them_and_to_themselves() -> None:
    g = torch.Generator().manual_seed(0)
    length, lo, hi = 16, 10, 12  # positions [0, 16) cached; rows [10, 12) of the block [8, 16) recomputed
    cached_k, cached_v = (
        torch.randn(length, KV_HEADS, HEAD_DIM, generator=g),
        torch.randn(length, KV_HEADS, HEAD_DIM, generator=g),
    )
    pages = [3, 0, 2, 1]  # logical page i lives in physical page pages[i]
    k_cache = torch.zeros(4, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    for i, page in enumerate(pages):
        k_cache[page], v_cache[page] = (
            cached_k[i * PAGE_SIZE : (i + 1) * PAGE_SIZE],
            cached_v[i * PAGE_SIZE : (i + 1) * PAGE_SIZE],
        )
    q = torch.randn(hi - lo, HEADS, HEAD_DIM, generator=g)
    fresh_k, fresh_v = (
        torch.randn(hi - lo, KV_HEADS, HEAD_DIM, generator=g),
        torch.randn(hi - lo, KV_HEADS, HEAD_DIM, generator=g),
    )

    out = paged_attention(q, fresh_k, fresh_v, k_cache, v_cache, metadata(lo, hi - lo, length, pages), SCALE)

    keys = torch.cat([cached_k[:lo], fresh_k, cached_k[hi:]])
    values = torch.cat([cached_v[:lo], fresh_v, cached_v[hi:]])
    allowed = visibility_mask(torch.arange(lo, hi), torch.arange(length), BLOCK, False, 3)
    assert allowed.all()  # every key is in the rows' block or before it
    torch.testing.assert_close(out, dense(q, keys, values, allowed))
    # without the tail the rows see only what precedes them and themselves
    short = paged_attention(q, fresh_k, fresh_v, k_cache, v_cache, metadata(lo, hi - lo, None, pages), SCALE)
    torch.testing.assert_close(short, dense(q, keys[:hi], values[:hi], allowed[:, :hi]))
    assert not torch.allclose(short, out)

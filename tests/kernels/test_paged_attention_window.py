"""Sliding-window paged attention (DiffusionGemma's sliding layers) and wide heads (its global layers): the Triton
kernel against the PyTorch path, and the PyTorch path against the window's definition.

Two window anchors: the row's own position (the causal encoder: a row at ``p`` sees keys ``(p - window, p]``) and
the request's context length (the canvas decoder: every canvas row sees the last ``window - 1`` cached positions
and the whole canvas, bidirectionally; the canvas is a prefix-full "prompt" that ends where the canvas ends).
"""

from __future__ import annotations

import pytest
import torch

from diffulex.attention.torch_paged import paged_attention
from diffulex.kernels.paged_attention import triton_paged_attention
from tests.kernels.test_paged_attention import DEVICE, DTYPES, TOL, make_batch

# (context_len, query_len, prompt_len): causal encoder pieces, a prompt longer than the window, a piece after a
# long cached context, an empty request.
ENCODER_PIECES = [(0, 13, 0), (24, 9, 0), (40, 30, 0), (5, 0, 0), (150, 3, 0), (0, 1, 0)]


def canvases(contexts: list[int], canvas: int) -> list[tuple[int, int, int]]:
    """Decoder requests: a canvas of ``canvas`` rows after each context, bidirectional over context and canvas."""
    return [(ctx, canvas, ctx + canvas) for ctx in contexts]


def check_window(requests, num_heads, num_kv_heads, head_dim, window, from_context, dtype, block_size, prefix_full,
                 splits=None, grouped=True, page_size=8):  # fmt: skip
    q, k, v, k_cache, v_cache, meta = make_batch(
        requests, num_heads, num_kv_heads, head_dim, page_size, block_size, prefix_full, dtype, DEVICE
    )
    expected = paged_attention(q, k, v, k_cache, v_cache, meta, 1.0, window=window, window_from_context=from_context)
    out = torch.full_like(q, float("nan"))
    triton_paged_attention(
        q, k, v, k_cache, v_cache, meta, 1.0, grouped=grouped, out=out, num_splits=splits, window=window,
        window_from_context=from_context,
    )
    assert not torch.isnan(out).any(), "rows left unwritten or NaN produced"
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return expected


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("window", "splits", "grouped"), [(0, None, True), (6, None, True), (17, 3, True),
                                                            (4, None, False), (64, 2, True)])  # fmt: skip
def test_causal_sliding_window_matches_reference(window, splits, grouped, dtype):
    """Encoder pieces (block size 1: causal) with a window anchored at each row, GQA 4:2, with and without
    split keys; window 0 is plain causal attention."""
    check_window(ENCODER_PIECES, 4, 2, 16, window, False, dtype, 1, False, splits=splits, grouped=grouped)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("window", "splits", "num_heads", "num_kv_heads"),
    [(0, None, 4, 2), (5, None, 4, 2), (5, 3, 8, 1), (33, 2, 4, 4), (200, None, 6, 2)],
)
def test_canvas_rows_window_from_context_matches_reference(window, splits, num_heads, num_kv_heads, dtype):
    """Canvas rows: bidirectional over context and canvas, sliding layers limited to the last ``window - 1``
    cached positions (GQA up to 8:1, a group of 3 padded, split keys)."""
    check_window(canvases([0, 3, 40, 150, 17], 12), num_heads, num_kv_heads, 16, window, True, dtype, 12, True,
                 splits=splits)  # fmt: skip


def test_reference_window_is_the_documented_rule():
    """The PyTorch path with a window equals plain attention over exactly the keys the rule allows: for a canvas
    row, the last ``window - 1`` cached keys and every canvas key; for a causal row at ``p``, keys
    ``(p - window, p]``."""
    window, ctx, canvas = 5, 11, 4
    requests = [(ctx, canvas, ctx + canvas)]
    q, k, v, k_cache, v_cache, meta = make_batch(requests, 2, 1, 16, 4, canvas, True, torch.float32, "cpu")
    got = paged_attention(q, k, v, k_cache, v_cache, meta, 1.0, window=window, window_from_context=True)
    pages = meta.page_tables[0, : (ctx + 3) // 4].long()
    cached_k = k_cache[pages].reshape(-1, 1, 16)[:ctx]
    cached_v = v_cache[pages].reshape(-1, 1, 16)[:ctx]
    keys = torch.cat([cached_k[ctx - (window - 1) :], k])[:, 0]
    values = torch.cat([cached_v[ctx - (window - 1) :], v])[:, 0]
    expected = torch.softmax(q.transpose(0, 1) @ keys.T, dim=-1) @ values
    torch.testing.assert_close(got, expected.transpose(0, 1))

    requests = [(ctx, canvas, 0)]
    q, k, v, k_cache, v_cache, meta = make_batch(requests, 1, 1, 16, 4, 1, False, torch.float32, "cpu")
    got = paged_attention(q, k, v, k_cache, v_cache, meta, 1.0, window=window)
    pages = meta.page_tables[0, : (ctx + 3) // 4].long()
    all_k = torch.cat([k_cache[pages].reshape(-1, 1, 16)[:ctx], k])[:, 0]
    all_v = torch.cat([v_cache[pages].reshape(-1, 1, 16)[:ctx], v])[:, 0]
    for row in range(canvas):
        p = ctx + row
        scores = q[row, 0] @ all_k[p - window + 1 : p + 1].T
        torch.testing.assert_close(got[row, 0], torch.softmax(scores, dim=-1) @ all_v[p - window + 1 : p + 1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_wide_heads_match_reference(dtype):
    """Head dims 256 and 512 (DiffusionGemma's sliding and global layers), canvas rows with and without a window:
    512 takes smaller tiles, chosen by the launcher."""
    check_window(canvases([9, 30], 4), 4, 2, 256, 7, True, dtype, 4, True)
    check_window(canvases([9, 30], 4), 8, 1, 512, 0, True, dtype, 4, True)
    check_window(canvases([70], 4), 8, 1, 512, 0, True, dtype, 4, True, splits=2)


@pytest.mark.skipif(DEVICE != "cuda", reason="realistic canvases are too slow for the interpreter")
@pytest.mark.parametrize("splits", [None, 1, 4])  # one test per split choice: each compiles its own variants
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_diffusion_gemma_geometry_gpu(dtype, splits):
    """The 26B-A4B shapes: 16 heads, 8 KV heads of 256 with a 1024 window; 2 KV heads of 512, no window; canvas
    of 256 rows after contexts around and beyond the window; encoder pieces of a long prompt. In bf16, the dtype the
    model is served in: float32 at heads of 512 is checked on a smaller canvas above, and at these shapes its
    compile alone took over 2 minutes of the GPU suite's 5 on an H100."""
    contexts = [0, 100, 1023, 1024, 3000]
    check_window(canvases(contexts, 256), 16, 8, 256, 1024, True, dtype, 256, True, splits=splits, page_size=256)
    check_window(canvases(contexts, 256), 16, 2, 512, 0, True, dtype, 256, True, splits=splits, page_size=256)
    pieces = [(0, 2000, 0), (1500, 256, 0), (256, 256, 0)]
    check_window(pieces, 16, 8, 256, 1024, False, dtype, 1, False, splits=splits, page_size=256)
    check_window(pieces, 16, 2, 512, 0, False, dtype, 1, False, splits=splits, page_size=256)


def test_negative_window_is_refused():
    q, k, v, k_cache, v_cache, meta = make_batch([(0, 2, 0)], 2, 1, 16, 4, 1, False, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="window=-1"):
        triton_paged_attention(q, k, v, k_cache, v_cache, meta, 1.0, window=-1)

"""Attention that norms and rotates q/k itself and writes the step's K/V to the cache (`FusedRotary`): bit for bit
the two launches it replaces (`qk_norm_rope_store`, then attention of the rotated q/k), outputs and caches alike.

Decode-shaped batches (every request's rows fit one query tile), with and without the per-head norms, grouped and
ungrouped, unsplit and with split-KV (the new keys in their own split), rows that are not committed (slot -1) left
out of the cache; and the layouts it does not take (a prefill tile) go the two-launch way with the same results.
"""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.attention_op import rope_store_and_attend
from diffulex.kernels.fused_norm import qk_norm_rope_store
from diffulex.kernels.paged_attention import FusedRotary, rotary_fits, triton_paged_attention
from tests.kernels.test_fused_norm import make_norm, rope
from tests.kernels.test_paged_attention import DEVICE, DTYPES, make_batch

# (context_len, query_len, prompt_len): decode blocks of 4 behind short and long prefixes, a request with no rows,
# a first block (no cache), a partial block, a rebuild inside the prompt
DECODE = [(24, 4, 20), (17, 4, 9), (5, 0, 5), (150, 4, 150), (0, 4, 4), (40, 2, 3), (6, 4, 14)]


def decode_step(requests, heads, kv_heads, head_dim, dtype, with_norm, prefix_full=False, seed=0):
    """make_batch's step with q/k/v as views of one fused qkv output, angles, norms and some uncommitted rows."""
    q, k, v, k_cache, v_cache, meta = make_batch(
        requests, heads, kv_heads, head_dim, 8, 4, prefix_full, dtype, DEVICE, seed=seed
    )
    qkv = torch.cat([x.flatten(1) for x in (q, k, v)], dim=1)
    q = qkv[:, : heads * head_dim].view_as(q)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view_as(k)
    v = qkv[:, (heads + kv_heads) * head_dim :].view_as(v)
    meta.slot_mapping[1::3] = -1  # not committed this step: attended to, never stored
    cos, sin = (t.to(DEVICE) for t in rope(q.shape[0], head_dim))
    weights = (None, None)
    if with_norm:
        weights = (make_norm(head_dim, dtype, 1).weight.to(DEVICE), make_norm(head_dim, dtype, 2).weight.to(DEVICE))
    rotary = FusedRotary(cos, sin, *weights, 1e-6, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta, rotary


def two_launches(q, k, v, k_cache, v_cache, meta, rotary, scale, grouped, splits):
    kc, vc = k_cache.clone(), v_cache.clone()
    rq, rk = qk_norm_rope_store(
        q, k, v, rotary.cos, rotary.sin, rotary.q_weight, rotary.k_weight, rotary.eps, kc, vc, meta.slot_mapping
    )
    out = triton_paged_attention(rq, rk, v, kc, vc, meta, scale, grouped=grouped, num_splits=splits)
    return out, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize(("grouped", "splits"), [(True, 1), (True, 3), (False, 1), (False, 4)])
def test_one_launch_equals_rotary_store_then_attention(dtype, with_norm, grouped, splits):
    q, k, v, k_cache, v_cache, meta, rotary = decode_step(DECODE, 4, 2, 16, dtype, with_norm)
    assert rotary_fits(q, k, meta, rotary, grouped)
    expected, ref_kc, ref_vc = two_launches(q, k, v, k_cache, v_cache, meta, rotary, 0.25, grouped, splits)
    out = torch.full_like(q, float("nan"))
    got = triton_paged_attention(
        q, k, v, k_cache, v_cache, meta, 0.25, grouped=grouped, out=out, num_splits=splits, rotary=rotary
    )
    assert not torch.isnan(got).any(), "rows left unwritten"
    assert torch.equal(got, expected)
    assert torch.equal(k_cache, ref_kc) and torch.equal(v_cache, ref_vc)


@pytest.mark.parametrize("dtype", DTYPES)
def test_uncommitted_rows_are_attended_but_not_stored(dtype):
    q, k, v, k_cache, v_cache, meta, rotary = decode_step(DECODE, 4, 2, 32, dtype, True, prefix_full=True, seed=5)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.2, rotary=rotary)
    changed = (k_cache != before_k).flatten(0, 1).any(-1).any(-1) | (v_cache != before_v).flatten(0, 1).any(-1).any(-1)
    written = torch.nonzero(changed).flatten().tolist()
    committed = sorted(s for s in meta.slot_mapping.tolist() if s >= 0)
    assert set(written) <= set(committed)  # nothing outside the committed slots moves
    assert len(written) >= len(committed) - 1  # and (random values aside) every committed slot is written


def test_prefill_tiles_take_the_two_launch_path_with_the_same_bits():
    requests = [(0, 13, 10), (24, 4, 20), (40, 45, 3)]  # 45 query rows: beyond one 32-row tile
    q, k, v, k_cache, v_cache, meta, rotary = decode_step(requests, 4, 2, 16, torch.float32, True, seed=2)
    assert not rotary_fits(q, k, meta, rotary, True)
    with pytest.raises(ValueError, match="fused rotary"):
        triton_paged_attention(q, k, v, k_cache.clone(), v_cache.clone(), meta, 0.25, rotary=rotary)
    expected, ref_kc, ref_vc = two_launches(q, k, v, k_cache, v_cache, meta, rotary, 0.25, True, None)
    got = rope_store_and_attend(
        q, k, v, rotary.cos, rotary.sin, rotary.q_weight, rotary.k_weight, rotary.eps, k_cache, v_cache, meta, 0.25,
        True,
    )
    assert torch.equal(got, expected)
    assert torch.equal(k_cache, ref_kc) and torch.equal(v_cache, ref_vc)


def test_norm_weights_of_another_dtype_do_not_fit():
    q, k, v, k_cache, v_cache, meta, rotary = decode_step(DECODE, 4, 2, 16, torch.float32, True)
    mixed = rotary._replace(q_weight=rotary.q_weight.to(torch.float16))
    assert rotary_fits(q, k, meta, rotary, True) and not rotary_fits(q, k, meta, mixed, True)

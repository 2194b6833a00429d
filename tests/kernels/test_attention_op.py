"""The compile-facing custom op stores and attends exactly like the direct kernel calls, and declares its cache
writes, so ``torch.compile`` can keep attention inside one traced graph."""

from __future__ import annotations

import torch

from diffulex.attention.torch_paged import paged_attention, store_kv
from diffulex.kernels import attention_op  # noqa: F401  (registers torch.ops.diffulex.paged_attention_step)
from tests.kernels.test_paged_attention import DEVICE, REQUESTS, make_batch


def test_custom_op_stores_committed_rows_and_attends_like_the_reference() -> None:
    q, k, v, k_cache, v_cache, meta = make_batch(REQUESTS, 4, 2, 16, 8, 4, False, torch.float32, DEVICE, seed=3)
    meta.slot_mapping[::3] = -1  # some rows are not committed: they must not be stored
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    expected = paged_attention(q, k, v, ref_k, ref_v, meta, 0.25)
    got = torch.ops.diffulex.paged_attention_step(
        q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.prefix_lens, meta.page_tables,
        meta.slot_mapping, 0.25, meta.block_size, meta.page_size, meta.prefix_full, meta.max_query_len,
        meta.max_kv_len, True,
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_custom_op_declares_its_cache_mutation_and_a_fake_kernel() -> None:
    schema = torch.ops.diffulex.paged_attention_step.default._schema
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache"]
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, k, v, k_cache, v_cache, meta = make_batch(REQUESTS[:2], 4, 2, 16, 8, 4, False, torch.float32, DEVICE)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq = mode.from_tensor(q)
        out = torch.ops.diffulex.paged_attention_step(
            fq, mode.from_tensor(k), mode.from_tensor(v), mode.from_tensor(k_cache), mode.from_tensor(v_cache),
            meta.cu_seqlens_q, meta.context_lens, meta.prefix_lens, meta.page_tables, meta.slot_mapping, 0.25,
            meta.block_size, meta.page_size, meta.prefix_full, meta.max_query_len, meta.max_kv_len, True,
        )
    assert out.shape == q.shape and out.dtype == q.dtype

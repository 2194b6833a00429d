"""The SDAR model computes the Qwen3 network exactly, under whatever mask the attention metadata carries. That it
equals the network written out by hand and transformers' Qwen3 is checked in test_families.py, with every family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from family_harness import reference_forward

from diffulex.attention import Attention, DenseAttentionMetadata, PagedAttentionMetadata, visibility_mask
from diffulex.models.family import FAMILIES
from diffulex.models.hf_config import SDARConfig
from diffulex.models.loader import build_model
from diffulex.models.sdar import SDARForDiffusionLM
from diffulex.testing import write_tiny_checkpoint

FAMILY = "sdar"
BLOCK = 4


@pytest.fixture
def model(ckpt: Path) -> SDARForDiffusionLM:
    return build_model("sdar", ckpt, torch.float32, "cpu")


def block_causal(n: int, block_size: int = BLOCK) -> DenseAttentionMetadata:
    pos = torch.arange(n)
    return DenseAttentionMetadata(visibility_mask(pos, pos, block_size, False, 0))


@torch.inference_mode()
def test_a_token_in_a_later_block_does_not_change_earlier_blocks(model):
    ids = torch.randint(0, 380, (12,), generator=torch.Generator().manual_seed(2))
    changed = ids.clone()
    changed[9] = (ids[9] + 1) % 380  # block 2
    meta = block_causal(12)
    a, b = model(ids, torch.arange(12), meta), model(changed, torch.arange(12), meta)
    torch.testing.assert_close(a[:8], b[:8], atol=0, rtol=0)
    assert not torch.allclose(a[8:], b[8:])  # ...but changes its whole own block (bidirectional inside)
    assert not torch.allclose(a[8], b[8])


@torch.inference_mode()
def test_a_flat_paged_batch_of_two_requests_matches_each_request_alone(model):
    """Two requests in one flat stream over the paged cache: a prefill step, then one block each on top of the
    cache, equal the dense block-causal forward of each whole sequence."""
    gen = torch.Generator().manual_seed(3)
    seq_a, seq_b = torch.randint(0, 380, (12,), generator=gen), torch.randint(0, 380, (8,), generator=gen)
    page = 4
    for attn in [m for m in model.modules() if isinstance(m, Attention)]:
        attn.k_cache = torch.zeros(6, page, attn.num_kv_heads, attn.head_dim)
        attn.v_cache = torch.zeros(6, page, attn.num_kv_heads, attn.head_dim)
    page_tables = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)

    def meta(q_lens, ctx_lens, slots):
        return PagedAttentionMetadata(
            cu_seqlens_q=torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32),
            prefix_lens=torch.tensor(ctx_lens, dtype=torch.int32),
            page_tables=page_tables,
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_size=BLOCK,
            page_size=page,
            prefix_full=False,
            query_lens_cpu=list(q_lens),
            context_lens_cpu=list(ctx_lens),
            prefix_lens_cpu=list(ctx_lens),
        )

    try:
        # Step 1: A's first 8 tokens and B's first 5; only whole blocks are cached (B's token 4 is not).
        step1 = meta([8, 5], [0, 0], list(range(8)) + [12, 13, 14, 15, -1])
        model(torch.cat([seq_a[:8], seq_b[:5]]), torch.cat([torch.arange(8), torch.arange(5)]), step1)
        # Step 2: A's block 2 (positions 8..11) and B's block 1 (positions 4..7), over the cached context.
        step2 = meta([4, 4], [8, 4], [8, 9, 10, 11, 16, 17, 18, 19])
        positions = torch.cat([torch.arange(8, 12), torch.arange(4, 8)])
        out = model(torch.cat([seq_a[8:], seq_b[4:]]), positions, step2)
    finally:
        for attn in [m for m in model.modules() if isinstance(m, Attention)]:
            attn.k_cache = attn.v_cache = None
    full_a = model(seq_a, torch.arange(12), block_causal(12))
    full_b = model(seq_b, torch.arange(8), block_causal(8))
    torch.testing.assert_close(out[:4], full_a[8:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[4:], full_b[4:], atol=1e-5, rtol=1e-5)


def test_each_decoder_layer_owns_exactly_one_attention_module(model):
    attns = [m for m in model.modules() if isinstance(m, Attention)]
    assert attns == [layer.self_attn.attn for layer in model.model.layers]
    assert attns[0].num_heads == 4 and attns[0].num_kv_heads == 2 and attns[0].head_dim == 16
    assert attns[0].scale == pytest.approx(16**-0.5)


def test_tied_embeddings_share_one_tensor(tmp_path):
    m = build_model("sdar", write_tiny_checkpoint(tmp_path, tie_word_embeddings=True), torch.float32, "cpu")
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in dict(m.named_parameters())


@torch.inference_mode()
def test_attention_bias_is_applied_when_the_config_asks(tmp_path):
    ckpt = write_tiny_checkpoint(tmp_path, attention_bias=True, init_std=0.1)
    m = build_model("sdar", ckpt, torch.float32, "cpu")
    assert m.model.layers[0].self_attn.o_proj.bias is not None
    ids = torch.arange(8)
    meta = block_causal(8)
    expected = reference_forward(ckpt, ids, meta.allowed)
    torch.testing.assert_close(m(ids, torch.arange(8), meta).double(), expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_model_gives_bfloat16_logits(ckpt):
    m = build_model("sdar", ckpt, torch.bfloat16, "cpu")
    with torch.inference_mode():
        logits = m.compute_logits(m(torch.arange(4), torch.arange(4), block_causal(4)))
    assert logits.dtype == torch.bfloat16 and logits.shape == (4, 384)


def test_sdar_is_registered_with_its_family_defaults():
    family = FAMILIES.get("sdar")
    assert family.model is SDARForDiffusionLM
    assert (family.mask_token_id, family.default_strategy) == (151669, "multi_bd")
    assert family.logits_shift is False


@pytest.mark.parametrize("scaling", [None, {"rope_type": "default"}, {"type": "default"}])
def test_default_rope_is_accepted(scaling):
    config = _small_config(rope_scaling=scaling)
    SDARForDiffusionLM(config)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0}, {"type": "linear", "factor": 2.0}])
def test_scaled_rope_variants_are_refused_by_name(scaling):
    kind = scaling.get("rope_type", scaling.get("type"))
    with pytest.raises(NotImplementedError, match=kind):
        SDARForDiffusionLM(_small_config(rope_scaling=scaling))


def _small_config(**overrides) -> SDARConfig:
    d = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    d.update(overrides)
    return SDARConfig.from_dict(d)


@torch.inference_mode()
def test_the_rows_anyone_reads_reach_the_last_layer_only(model):
    """``readers`` (the rows of the result anyone reads) goes to the last layer, whose projections after attention
    may skip their weight streams when it names no row (on CUDA); every other layer computes what the next reads.
    On the CPU nothing is skipped, so the result is the same with readers or without."""
    seen: list[tuple[int, object]] = []
    for index, layer in enumerate(model.model.layers):
        original = layer.forward

        def recorded(*args, _index=index, _original=original, **kwargs):
            seen.append((_index, kwargs.get("readers")))
            return _original(*args, **kwargs)

        layer.forward = recorded
    ids, meta = torch.randint(0, 380, (8,), generator=torch.Generator().manual_seed(4)), block_causal(8)
    readers = torch.tensor([-1, -1, -1, -1, -1, -1, -1, -1])
    with_readers = model(ids, torch.arange(8), meta, readers)
    last = len(model.model.layers) - 1
    assert [(i, r is readers) for i, r in seen] == [(i, i == last) for i in range(last + 1)]
    seen.clear()
    torch.testing.assert_close(with_readers, model(ids, torch.arange(8), meta), atol=0, rtol=0)
    assert all(r is None for _, r in seen)

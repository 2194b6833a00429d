"""The attention layer owns rotary and the cache write: ``forward(q, k, v, meta, rope, q_norm, k_norm)`` with
un-rotated q/k gives the same bits, output and cache, as the models' old sequence ``rotate_qk`` then
``forward(q, k, v, meta)``, on every path.

On the CPU the layer always takes that old sequence. The fused path (one launch for q/k norm + rotary + KV store,
then attention) needs the Triton backend on CUDA; the `triton_on_cpu` fixture lets it run here, under the Triton
interpreter, by pretending the tensors qualify, and counts which launches happen.
"""

from __future__ import annotations

import os

import pytest
import torch

from diffulex.attention import Attention, DenseAttentionMetadata
from diffulex.attention import layer as layer_module
from diffulex.kernels import attention_op
from diffulex.layers import RMSNorm, RotaryEmbedding, rotary
from diffulex.layers.rotary import rotate_qk
from tests.kernels.test_paged_attention import make_batch

HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_SIZE = 4, 2, 16, 4, 4
# (context_len, query_len, prompt_len): a decode block over a cached prefix, a fresh prompt, an idle request
REQUESTS = [(9, 4, 6), (0, 5, 5), (3, 0, 3)]


def make_norm(dtype: torch.dtype, seed: int) -> RMSNorm:
    norm = RMSNorm(HEAD_DIM, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(HEAD_DIM, generator=torch.Generator().manual_seed(seed)))
    return norm.to(dtype)


def make_inputs(dtype: torch.dtype, seed: int = 0):
    """A paged batch whose q, k and v are views of one fused projection output, as the models produce them."""
    _, _, _, k_cache, v_cache, meta = make_batch(
        REQUESTS, HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, BLOCK_SIZE, False, dtype, "cpu", seed=seed
    )
    meta.slot_mapping[1::3] = -1  # rows that are not committed are not stored
    rows = meta.slot_mapping.shape[0]
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(rows, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k, v = q.view(rows, HEADS, HEAD_DIM), k.view(rows, KV_HEADS, HEAD_DIM), v.view(rows, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 200, (rows,), generator=gen)
    rope = RotaryEmbedding(HEAD_DIM, 256, 10_000.0)(positions)
    return q, k, v, k_cache, v_cache, meta, rope


def make_layer(k_cache: torch.Tensor, v_cache: torch.Tensor, attn_impl: str) -> Attention:
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    layer.k_cache, layer.v_cache, layer.attn_impl = k_cache.clone(), v_cache.clone(), attn_impl
    return layer


def old_and_new(attn_impl, q, k, v, k_cache, v_cache, meta, rope, norms):
    """``(output, k_cache, v_cache)`` of the models' old sequence and of the layer's rope-owning forward."""
    old = make_layer(k_cache, v_cache, attn_impl)
    with torch.no_grad():
        rq, rk = rotate_qk(q, k, rope[0], rope[1], *norms)
        old_out = old(rq, rk, v, meta)
    new = make_layer(k_cache, v_cache, attn_impl)
    with torch.no_grad():
        new_out = new(q, k, v, meta, rope, *norms)
    return (old_out, old.k_cache, old.v_cache), (new_out, new.k_cache, new.v_cache)


def assert_identical(old, new) -> None:
    for a, b in zip(old, new, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Make the CPU tensors qualify for the Triton paths (kernels under the interpreter); count the launches that
    tell the fused path from the unfused one. Needs the interpreter, which is only set where CUDA is absent (a GPU
    machine runs the CUDA test below instead)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels on CPU tensors need the interpreter (TRITON_INTERPRET=1)")
    monkeypatch.setattr(layer_module, "kernels_run_on", lambda q: True)
    monkeypatch.setattr(rotary, "use_fused_kernels", lambda *tensors: not torch.compiler.is_compiling())
    calls = {"fused": 0, "store": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(attention_op, "rope_store_and_attend", counted("fused", attention_op.rope_store_and_attend))
    monkeypatch.setattr(attention_op, "triton_store_kv", counted("store", attention_op.triton_store_kv))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("attn_impl", ["naive", "triton_grouped"])
def test_on_the_cpu_rope_forward_is_rotate_then_forward(dtype, with_norm, attn_impl):
    q, k, v, k_cache, v_cache, meta, rope = make_inputs(dtype)
    norms = (make_norm(dtype, 1), make_norm(dtype, 2)) if with_norm else (None, None)
    old, new = old_and_new(attn_impl, q, k, v, k_cache, v_cache, meta, rope, norms)
    assert_identical(old, new)
    assert not torch.equal(new[1], k_cache)  # the committed rows were stored


def test_dense_metadata_rope_forward_is_rotate_then_forward():
    q, k, v, _, _, _, rope = make_inputs(torch.float32)
    allowed = torch.rand(q.shape[0], q.shape[0], generator=torch.Generator().manual_seed(0)) < 0.7
    allowed |= torch.eye(q.shape[0], dtype=torch.bool)
    meta = DenseAttentionMetadata(allowed=allowed)
    layer = Attention(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5)
    norms = (make_norm(torch.float32, 1), make_norm(torch.float32, 2))
    with torch.no_grad():
        expected = layer(*rotate_qk(q, k, rope[0], rope[1], *norms), v, meta)
        assert torch.equal(layer(q, k, v, meta, rope, *norms), expected)


@pytest.mark.parametrize("with_norm", [True, False])
@pytest.mark.parametrize("attn_impl", ["triton", "triton_grouped"])
def test_fused_rope_store_path_is_rotate_then_store_and_attend(triton_on_cpu, with_norm, attn_impl):
    """The layer's one-launch rotary + store then attention leaves exactly what the three launches did."""
    q, k, v, k_cache, v_cache, meta, rope = make_inputs(torch.bfloat16, seed=4)
    norms = (make_norm(torch.bfloat16, 1), make_norm(torch.bfloat16, 2)) if with_norm else (None, None)
    old, new = old_and_new(attn_impl, q, k, v, k_cache, v_cache, meta, rope, norms)
    assert triton_on_cpu == {"fused": 1, "store": 1}  # the new forward stored inside its rotary launch
    assert_identical(old, new)


def test_hooks_on_the_norms_force_the_torch_path(triton_on_cpu):
    """Activation capture must see the norm modules run, so a hooked norm keeps rotary (and the store) separate."""
    q, k, v, k_cache, v_cache, meta, rope = make_inputs(torch.bfloat16, seed=2)
    q_norm, k_norm = make_norm(torch.bfloat16, 1), make_norm(torch.bfloat16, 2)
    seen: list[torch.Tensor] = []
    q_norm.register_forward_hook(lambda module, inputs, output: seen.append(output))
    layer = make_layer(k_cache, v_cache, "triton_grouped")
    with torch.no_grad():
        got = layer(q, k, v, meta, rope, q_norm, k_norm)
    assert len(seen) == 1 and triton_on_cpu == {"fused": 0, "store": 1}
    old, new = old_and_new("triton_grouped", q, k, v, k_cache, v_cache, meta, rope, (q_norm, k_norm))
    assert triton_on_cpu["fused"] == 0
    assert_identical(old, new)
    assert torch.equal(got, new[0])


def test_under_torch_compile_the_layer_rotates_in_the_graph_and_calls_the_custom_op(triton_on_cpu):
    """While dynamo traces, rotary is torch code (for inductor) and attention the opaque op that stores and attends."""
    q, k, v, k_cache, v_cache, meta, rope = make_inputs(torch.float32, seed=5)
    norms = (make_norm(torch.float32, 1), make_norm(torch.float32, 2))
    eager = make_layer(k_cache, v_cache, "triton_grouped")
    with torch.no_grad():
        expected = eager(q, k, v, meta, rope, *norms)
    triton_on_cpu.update(fused=0, store=0)
    compiled_layer = make_layer(k_cache, v_cache, "triton_grouped")
    compiled = torch.compile(compiled_layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got = compiled(q, k, v, meta, rope, *norms)
    assert triton_on_cpu == {"fused": 0, "store": 1}  # the store ran inside the custom op
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compiled_layer.k_cache, eager.k_cache, atol=1e-5, rtol=1e-5)
    assert torch.equal(compiled_layer.v_cache, eager.v_cache)


def test_norms_need_the_rotary_embedding():
    q, k, v, k_cache, v_cache, meta, _ = make_inputs(torch.float32)
    layer = make_layer(k_cache, v_cache, "naive")
    with pytest.raises(ValueError, match="rope"):
        layer(q, k, v, meta, None, make_norm(torch.float32, 1), make_norm(torch.float32, 2))
    with pytest.raises(ValueError, match="together"):
        layer(q, k, v, meta, (torch.zeros(1, 8), torch.zeros(1, 8)), make_norm(torch.float32, 1), None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path runs natively on CUDA only")
@pytest.mark.parametrize("with_norm", [True, False])
def test_on_cuda_the_layer_takes_the_fused_path_and_matches(monkeypatch, with_norm):
    calls = []
    real = attention_op.rope_store_and_attend
    monkeypatch.setattr(attention_op, "rope_store_and_attend", lambda *a: calls.append(1) or real(*a))
    inputs = [t.cuda() if isinstance(t, torch.Tensor) else t for t in make_inputs(torch.bfloat16, seed=7)]
    q, k, v, k_cache, v_cache, meta, rope = inputs
    for name in ("cu_seqlens_q", "context_lens", "prefix_lens", "page_tables", "slot_mapping"):
        setattr(meta, name, getattr(meta, name).cuda())
    rope = tuple(t.cuda() for t in rope)
    norms = (make_norm(torch.bfloat16, 1).cuda(), make_norm(torch.bfloat16, 2).cuda()) if with_norm else (None, None)
    old, new = old_and_new("triton_grouped", q, k, v, k_cache, v_cache, meta, rope, norms)
    assert calls == [1]
    assert_identical(old, new)


@pytest.mark.parametrize("attn_impl", ["triton", "triton_grouped"])
def test_key_tails_reach_the_kernels_with_their_device_copy_only(triton_on_cpu, attn_impl):
    """A refinement step (keys after the rows, read from the cache) takes the fused Triton path when the metadata
    carries the device key ends, giving the PyTorch path's output; with the host copy alone it stays on PyTorch."""
    from tests.kernels.test_paged_attention_key_tails import make_tail_batch

    _, _, _, k_cache, v_cache, meta = make_tail_batch(
        [(16, 2, 10, 24), (4, 4, 4, 8), (0, 3, 3, 3)], HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, torch.float32, seed=5
    )
    rows = meta.slot_mapping.shape[0]
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(rows, h, HEAD_DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS))
    rope = RotaryEmbedding(HEAD_DIM, 256, 10_000.0)(torch.randint(0, 200, (rows,), generator=gen))
    with torch.no_grad():
        expected = make_layer(k_cache, v_cache, "naive")(q, k, v, meta, rope)
        got = make_layer(k_cache, v_cache, attn_impl)(q, k, v, meta, rope)
    assert triton_on_cpu["fused"] == 1
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    meta.key_lens = None
    with torch.no_grad():
        make_layer(k_cache, v_cache, attn_impl)(q, k, v, meta, rope)
    assert triton_on_cpu["fused"] == 1, "without the device key ends the kernels would miss the tails"

"""The Triton paged attention with key tails (a request attends to cached keys after its rows, Fast-dLLM v2's
sub-block refinement against its block's kept K/V) equals the PyTorch reference: split-KV or not, grouped or one
head per program, GQA, pages smaller and larger than the block. CPU: under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from diffulex.attention.metadata import PagedAttentionMetadata
from diffulex.attention.torch_paged import paged_attention, store_kv
from diffulex.kernels import attention_op  # noqa: F401  (registers torch.ops.diffulex.paged_attention_step)
from diffulex.kernels.paged_attention import triton_paged_attention
from diffulex.testing.checkpoints import write_tiny_checkpoint
from tests.kernels.test_paged_attention import DEVICE, DTYPES, TOL, _variant_of

BLOCK = 8  # attention block (Fast-dLLM v2's block of sub-blocks)

# (context_len, query_len, prompt_len, key_len): a first sub-block refined with three more after it, a middle one,
# the last one (no tail), a whole-block row range and a commit-like row (key_len at the rows' end), a request with
# no rows, a refinement past a long cached prefix (several key tiles), a tail shorter than a tile.
REQUESTS = [
    (16, 2, 10, 24),
    (18, 2, 12, 24),
    (22, 2, 5, 24),
    (8, 8, 8, 16),
    (7, 1, 8, 8),
    (40, 0, 40, 48),
    (136, 4, 100, 144),
    (3, 1, 3, 8),
]


def make_tail_batch(
    requests: list[tuple[int, int, int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    prefix_full: bool = False,
):
    """Random q/k/v and a random cache pool whose page tables cover each request's keys up to its key length
    (shuffled, non-contiguous pages); the refined rows store nothing, as a refinement step's rows do."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pages_per_req = [-(-max(c + q, key) // page_size) for c, q, _, key in requests]
    num_pages = sum(pages_per_req) + 5
    pool = list(range(num_pages))
    rng.shuffle(pool)
    tables = torch.full((len(requests), max(pages_per_req) + 1), -1, dtype=torch.int32)
    for r, n in enumerate(pages_per_req):
        tables[r, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
    query_lens = [q for _, q, _, _ in requests]
    total = sum(query_lens)
    cu = torch.zeros(len(requests) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(query_lens), 0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    q, k, v = rand(total, num_heads, head_dim), rand(total, num_kv_heads, head_dim), rand(total, num_kv_heads, head_dim)
    k_cache = rand(num_pages, page_size, num_kv_heads, head_dim)
    v_cache = rand(num_pages, page_size, num_kv_heads, head_dim)
    key_lens = [key for _, _, _, key in requests]
    meta = PagedAttentionMetadata(
        cu_seqlens_q=cu.to(DEVICE),
        context_lens=ints([c for c, _, _, _ in requests]),
        prefix_lens=ints([p for _, _, p, _ in requests]),
        page_tables=tables.to(DEVICE),
        slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=DEVICE),
        block_size=BLOCK,
        page_size=page_size,
        prefix_full=prefix_full,
        query_lens_cpu=query_lens,
        context_lens_cpu=[c for c, _, _, _ in requests],
        prefix_lens_cpu=[p for _, _, p, _ in requests],
        key_lens_cpu=key_lens,
        key_lens=ints(key_lens),
    )
    return q, k, v, k_cache, v_cache, meta


def check(num_heads, num_kv_heads, page_size, dtype, grouped=True, splits=None, requests=REQUESTS, prefix_full=False):
    q, k, v, k_cache, v_cache, meta = make_tail_batch(
        requests, num_heads, num_kv_heads, 16, page_size, dtype, prefix_full=prefix_full
    )
    expected = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    out = torch.full_like(q, float("nan"))
    triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, grouped=grouped, out=out, num_splits=splits)
    assert not torch.isnan(out).any(), "rows left unwritten or NaN produced"
    torch.testing.assert_close(out.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "page_size", "grouped"),
    [(2, 2, 4, True), (4, 2, 8, True), (6, 2, 16, True), (4, 1, 32, False), (4, 2, 4, False)],
)
def test_cached_keys_after_the_rows_are_read_from_the_cache(num_heads, num_kv_heads, page_size, grouped, dtype):
    check(num_heads, num_kv_heads, page_size, dtype, grouped=grouped)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("splits", "grouped"), [(2, True), (3, False), (5, True), (16, True)])
def test_split_kv_chunks_may_span_the_rows_and_the_tail(splits, grouped, dtype):
    for _ in range(2):  # the split counters are left at zero for the next launch
        check(4, 2, 8, dtype, grouped=grouped, splits=splits)


def test_the_tail_is_really_read() -> None:
    """Changing a tail key's cache entry changes the rows that see it, and nothing else."""
    requests = [(16, 2, 10, 24), (0, 4, 4, 4)]
    q, k, v, k_cache, v_cache, meta = make_tail_batch(requests, 4, 2, 16, 8, torch.float32)
    before = triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    page = int(meta.page_tables[0, 22 // 8])
    v_cache[page, 22 % 8] += 5.0
    after = triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    assert not torch.allclose(before[:2], after[:2])
    torch.testing.assert_close(before[2:], after[2:])


def test_prefix_full_rows_with_tails_match_the_reference() -> None:
    check(4, 2, 8, torch.float32, prefix_full=True, requests=[(16, 2, 10, 24), (4, 4, 12, 8), (24, 2, 30, 32)])


def test_key_lens_must_be_int32_per_request() -> None:
    q, k, v, k_cache, v_cache, meta = make_tail_batch(REQUESTS[:2], 4, 2, 16, 8, torch.float32)
    meta.key_lens = meta.key_lens.long()
    with pytest.raises(ValueError, match="key_lens must be int32"):
        triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)


def test_the_custom_op_passes_key_tails_to_the_kernel() -> None:
    q, k, v, k_cache, v_cache, meta = make_tail_batch(REQUESTS, 4, 2, 16, 8, torch.float32, seed=2)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    expected = paged_attention(q, k, v, ref_k, ref_v, meta, 0.25)
    got = torch.ops.diffulex.paged_attention_step(
        q, k, v, k_cache, v_cache, meta.cu_seqlens_q, meta.context_lens, meta.prefix_lens, meta.page_tables,
        meta.slot_mapping, 0.25, meta.block_size, meta.page_size, meta.prefix_full, meta.max_query_len,
        meta.max_kv_len, True, meta.key_lens,
    )
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_warm_up_with_key_tails_compiles_the_variants_a_refinement_step_launches(monkeypatch):
    """A strategy whose requests attend past their rows warms the tail variants up too, so that no eager step
    (a prefill beside refinements) compiles one while serving."""
    from diffulex.kernels import paged_attention as pa
    from diffulex.kernels.pdl import PDL_MAX_ROWS

    variants: list[tuple] = []

    class Recorder:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):  # the variant: every launch option but the key-lens pointer
                variants.append(
                    tuple(sorted((k, _variant_of(v)) for k, v in kwargs.items() if k != "key_lens_ptr"))
                )

            return launch

    monkeypatch.setattr(pa, "_paged_attention_kernel", Recorder())
    monkeypatch.setattr(pa, "pdl_enabled", lambda device, rows: rows <= PDL_MAX_ROWS)
    k_cache = torch.zeros(8, 8, 2, 16, device=DEVICE)
    pa._launch_every_variant(k_cache, k_cache, 4, BLOCK, False, True)
    plain = set(variants)
    variants.clear()
    pa._launch_every_variant(k_cache, k_cache, 4, BLOCK, False, True, key_tails=True)
    warmed = set(variants)
    assert warmed and not warmed & plain, "tail launches are variants of their own"
    for requests in (REQUESTS, REQUESTS[:3], [(16, 2, 10, 24)] * 12, [(0, 40, 40, 40), (16, 2, 10, 24)]):
        q, k, v, k_cache_r, v_cache_r, meta = make_tail_batch(requests, 4, 2, 16, 8, torch.float32)
        for splits in (None, 1, 3):
            variants.clear()
            triton_paged_attention(q, k, v, k_cache_r, v_cache_r, meta, 0.25, num_splits=splits)
            assert set(variants) <= warmed, (requests, splits)


def test_the_decode_graphs_staged_key_ends_are_what_the_kernel_reads(tmp_path) -> None:
    """The decode graphs' device metadata carries each request's key end (0 for padded requests) beside its layout, and
    the Triton attention (interpreted on the CPU) reading that staged metadata and the engine's cache equals the
    PyTorch path reading the host lists: the part of a replay the CPU path alone would not exercise."""
    from tests.engine.test_fast_dllm_v2_engine import assert_matches_reference, make_engine, random_prompts

    fdv2_dir = write_tiny_checkpoint(tmp_path / "fdv2", family="fast_dllm_v2", seed=1, init_std=1.0)
    checked = []
    with make_engine(fdv2_dir, 4, 2, accept_threshold=0.9, max_num_reqs=4) as llm:
        llm.enable_static_decode(capture=False)
        layer = llm.runner.attention_layers[0]

        def run_uncaptured(bucket, sample, graphs, original):
            meta = graphs._metas[bucket]
            r = meta.num_requests
            staged = meta.key_lens.tolist()
            assert staged == meta.key_lens_cpu, "the device key ends are the host lists"
            live = sum(q > 0 for q in meta.query_lens_cpu)
            assert staged[live:] == [0] * (r - live)
            if any(k > c + q for k, c, q in zip(staged, meta.context_lens_cpu, meta.query_lens_cpu, strict=True)):
                if len(checked) < 2:
                    rows = graphs.shape.max_query_len * bucket
                    gen = torch.Generator().manual_seed(len(checked))
                    heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
                    q, k, v = (
                        torch.randn(rows, h, dim, generator=gen).to(layer.k_cache) for h in (heads, kv_heads, kv_heads)
                    )
                    expected = paged_attention(q, k, v, layer.k_cache, layer.v_cache, meta, 0.25)
                    got = triton_paged_attention(q, k, v, layer.k_cache, layer.v_cache, meta, 0.25)
                    n = sum(meta.query_lens_cpu)
                    torch.testing.assert_close(got[:n], expected[:n], atol=1e-4, rtol=1e-4)
                    checked.append(bucket)
            return original(bucket, sample)

        for graphs in (llm.runner.graphs, llm.runner.short_graphs):
            graphs._run_uncaptured = functools.partial(run_uncaptured, graphs=graphs, original=graphs._run_uncaptured)
        assert_matches_reference(llm, random_prompts(llm, [5, 9, 14], seed=33))
    assert len(checked) == 2, "refinement steps should have been checked"

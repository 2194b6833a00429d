"""Triton paged attention against the PyTorch reference on random ragged batches.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (see ``conftest.py``) with small float32 shapes; on a GPU
the same cases run natively, in float32 and bfloat16. Outputs are poisoned with NaN first so unwritten rows show.
"""

from __future__ import annotations

import random

import pytest
import torch

from diffulex.attention.metadata import PagedAttentionMetadata
from diffulex.attention.torch_paged import paged_attention
from diffulex.kernels.paged_attention import triton_paged_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32]
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# (context_len, query_len, prompt_len) per request: prefill-like, decode-like, non-block-aligned (shifted) context,
# zero-length, a rebuild whose query starts inside the prompt, a long cached prefix spanning several key tiles.
REQUESTS = [
    (0, 13, 10),
    (24, 4, 20),
    (17, 5, 9),
    (5, 0, 5),
    (40, 8, 3),
    (6, 11, 14),
    (150, 3, 150),
    (0, 1, 1),
]


def make_batch(
    requests: list[tuple[int, int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    block_size: int,
    prefix_full: bool,
    dtype: torch.dtype,
    device: str,
    seed: int = 0,
    spare_pages: int = 7,
):
    """Random q/k/v, a random cache pool, and metadata whose page tables use shuffled, non-contiguous pages."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    pages_per_req = [(ctx + q_len + page_size - 1) // page_size for ctx, q_len, _ in requests]
    num_pages = sum(pages_per_req) * 2 + spare_pages
    pool = list(range(num_pages))
    rng.shuffle(pool)
    max_pages = max(pages_per_req) + 2
    page_tables = torch.full((len(requests), max_pages), -1, dtype=torch.int32)
    slot_mapping = []
    for r, (n, (ctx, q_len, _)) in enumerate(zip(pages_per_req, requests, strict=True)):
        pages = [pool.pop() for _ in range(n)]
        page_tables[r, :n] = torch.tensor(pages, dtype=torch.int32)
        for pos in range(ctx, ctx + q_len):
            slot_mapping.append(pages[pos // page_size] * page_size + pos % page_size)
    query_lens = [q for _, q, _ in requests]
    total = sum(query_lens)
    cu = torch.zeros(len(requests) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(query_lens), 0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    q = rand(total, num_heads, head_dim)
    k = rand(total, num_kv_heads, head_dim)
    v = rand(total, num_kv_heads, head_dim)
    k_cache = rand(num_pages, page_size, num_kv_heads, head_dim)
    v_cache = rand(num_pages, page_size, num_kv_heads, head_dim)
    meta = PagedAttentionMetadata(
        cu_seqlens_q=cu.to(device),
        context_lens=torch.tensor([c for c, _, _ in requests], dtype=torch.int32, device=device),
        prefix_lens=torch.tensor([p for _, _, p in requests], dtype=torch.int32, device=device),
        page_tables=page_tables.to(device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        block_size=block_size,
        page_size=page_size,
        prefix_full=prefix_full,
        query_lens_cpu=query_lens,
        context_lens_cpu=[c for c, _, _ in requests],
        prefix_lens_cpu=[p for _, _, p in requests],
    )
    return q, k, v, k_cache, v_cache, meta


def check(
    requests, num_heads, num_kv_heads, head_dim, page_size, block_size, prefix_full, dtype, grouped=True, splits=None,
    min_split_keys=64,
):
    q, k, v, k_cache, v_cache, meta = make_batch(
        requests, num_heads, num_kv_heads, head_dim, page_size, block_size, prefix_full, dtype, DEVICE
    )
    scale = head_dim**-0.5
    expected = paged_attention(q, k, v, k_cache, v_cache, meta, scale)
    out = torch.full_like(q, float("nan"))
    got = triton_paged_attention(
        q, k, v, k_cache, v_cache, meta, scale, grouped=grouped, out=out, num_splits=splits,
        min_split_keys=min_split_keys,
    )
    assert got is out
    assert not torch.isnan(got).any(), "rows left unwritten or NaN produced"
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "page_size", "block_size", "prefix_full"),
    [
        (2, 2, 4, 4, False),
        (4, 2, 8, 4, True),
        (8, 2, 16, 8, False),
        (4, 1, 8, 8, True),
        (6, 2, 16, 4, True),  # group 3: padded to 4 heads per program
    ],
)
def test_matches_reference(num_heads, num_kv_heads, page_size, block_size, prefix_full, dtype):
    check(REQUESTS, num_heads, num_kv_heads, 16, page_size, block_size, prefix_full, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix_full", [False, True])
def test_ungrouped_matches_reference(prefix_full, dtype):
    check(REQUESTS, 4, 2, 16, 8, 4, prefix_full, dtype, grouped=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("splits", "grouped", "prefix_full"), [(2, True, True), (3, False, False), (5, True, False)])
def test_split_kv_matches_reference(splits, grouped, prefix_full, dtype):
    """Keys of each tile split over several programs, combined in the same launch by the last one to finish."""
    check(REQUESTS, 4, 2, 16, 8, 4, prefix_full, dtype, grouped=grouped, splits=splits)
    # twice in a row: the split counters must have been left at zero by the first launch
    check(REQUESTS, 4, 2, 16, 8, 4, prefix_full, dtype, grouped=grouped, splits=splits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cached_and_new_keys_split_apart_fill_every_slot(dtype):
    """The chunk that the cached/new boundary cuts becomes two splits: 100 cached + 8 new keys in 2 splits of 64
    keys are folded by 3 programs ([0, 64), [64, 100), the new keys), the launch's last slot included."""
    for _ in range(2):
        check([(100, 8, 20), (64, 4, 64), (0, 8, 8)], 4, 2, 16, 8, 4, False, dtype, splits=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_splits_beyond_the_keys_are_idle(dtype):
    """More splits than key tiles (a graph launched for ``max_model_len`` on short contexts): only the splits
    with keys publish partials and take part in the combine, and the counters are left at zero."""
    requests = [(5, 4, 3), (0, 3, 3), (70, 8, 20)]
    for _ in range(2):
        check(requests, 4, 2, 16, 8, 4, False, dtype, splits=16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_contexts_below_the_split_minimum_are_written_by_one_split(dtype):
    """With at most ``min_split_keys`` keys a tile has one active split, which writes its rows directly."""
    for _ in range(2):
        check(REQUESTS, 4, 2, 16, 8, 4, True, dtype, splits=4, min_split_keys=256)
        check([(300, 4, 10), (40, 2, 40)], 4, 2, 16, 8, 4, False, dtype, splits=4, min_split_keys=128)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [32, 64])
def test_head_dims(head_dim, dtype):
    check([(9, 6, 4), (32, 8, 30)], 4, 2, head_dim, 32, 4, True, dtype)


# Each layout a test of its own (each compiles its own variants); float32 at one of them: its exact (IEEE) dots at
# these head dims take a minute or more to compile per variant, and the layouts differ in what bf16 checks too.
REALISTIC_LAYOUTS = [("paged 16, prefix full", dtype) for dtype in DTYPES] + [
    ("paged 32", torch.bfloat16), ("split in 7", torch.bfloat16)]  # fmt: skip


@pytest.mark.skipif(DEVICE != "cuda", reason="realistic head dims are too slow for the interpreter")
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize(("layout", "dtype"), REALISTIC_LAYOUTS)
def test_realistic_head_dims_gpu(head_dim, grouped, dtype, layout):
    requests = [(0, 300, 290), (1000, 8, 40), (513, 5, 513), (2048, 4, 100), (0, 0, 0), (77, 64, 90)]
    if layout == "paged 16, prefix full":
        check(requests, 16, 8, head_dim, 16, 4, True, dtype, grouped=grouped)
    elif layout == "paged 32":
        check(requests, 32, 8, head_dim, 32, 8, False, dtype, grouped=grouped)
    else:
        check(requests, 16, 8, head_dim, 16, 4, True, dtype, grouped=grouped, splits=7)


@pytest.mark.skipif(DEVICE != "cuda", reason="the automatic split choice only splits on CUDA")
@pytest.mark.parametrize("dtype", DTYPES)
def test_auto_split_single_long_request_gpu(dtype):
    for _ in range(3):
        check([(4093, 8, 100)], 16, 8, 128, 16, 4, False, dtype)
        check([(3000, 5, 3000), (0, 0, 0), (700, 4, 10)], 16, 8, 128, 8, 4, True, dtype, grouped=False)


def test_all_requests_empty():
    q, k, v, k_cache, v_cache, meta = make_batch([(4, 0, 4), (0, 0, 0)], 2, 1, 16, 4, 4, False, torch.float32, DEVICE)
    out = triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    assert out.shape == (0, 2, 16)


def test_the_metadata_fixes_the_split_settings_of_a_launch():
    """`PagedAttentionMetadata.num_splits` / ``min_split_keys`` act as the launch's own arguments: a long context
    split as told gives the explicitly split launch's bits, and a context under the minimum keys per split is
    folded whole, bit for bit as unsplit (the chunk graphs' decoders beside a split long prompt)."""
    import dataclasses

    requests = [(300, 4, 10), (40, 6, 12)]
    q, k, v, k_cache, v_cache, meta = make_batch(requests, 4, 2, 16, 4, 4, False, torch.float32, DEVICE)
    explicit = triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, num_splits=3)
    told = triton_paged_attention(q, k, v, k_cache, v_cache, dataclasses.replace(meta, num_splits=3), 0.25)
    assert torch.equal(told, explicit)
    unsplit = triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, num_splits=1)
    whole = dataclasses.replace(meta, num_splits=3, min_split_keys=1024)  # 304 keys at most: one split each
    assert torch.equal(triton_paged_attention(q, k, v, k_cache, v_cache, whole, 0.25), unsplit)


class LaunchRecorder:
    """Stands in for the kernel: records each launch's variant (its constexprs and launch options, and of a TMA
    descriptor what Triton specializes on: its dtype and box) and grid, and runs nothing."""

    def __init__(self):
        self.variants = []
        self.grids = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.grids.append(tuple(grid))
            self.variants.append(tuple(sorted((name, _variant_of(value)) for name, value in kwargs.items())))

        return launch


def _variant_of(value):
    if hasattr(value, "block_shape"):  # a TensorDescriptor
        return ("tensor descriptor", value.base.dtype, tuple(value.block_shape))
    return value


@pytest.fixture
def recorder(monkeypatch):
    """Launches recorded, not run, with PDL as on a GPU that has it (at most `PDL_MAX_ROWS` rows)."""
    from diffulex.kernels import paged_attention as pa
    from diffulex.kernels.pdl import PDL_MAX_ROWS

    rec = LaunchRecorder()
    monkeypatch.setattr(pa, "_paged_attention_kernel", rec)
    monkeypatch.setattr(pa, "pdl_enabled", lambda device, rows: rows <= PDL_MAX_ROWS)
    return rec


def test_auto_split_count_asks_two_programs_per_sm(monkeypatch):
    """With fewer programs than SMs, keys are split so that about two programs run per SM, never into splits of
    fewer than the minimum keys and never into more than the cap; a grid that fills the GPU does not split."""
    from diffulex.kernels import paged_attention as pa
    from diffulex.kernels import split_counters

    cuda, sms = torch.device("cuda", 0), 132
    monkeypatch.setitem(split_counters._SM_COUNT, cuda, sms)
    for programs in range(1, 2 * sms, 5):
        for max_keys in range(1, 8192, 37):
            splits = pa._auto_num_splits(cuda, programs, max_keys, 64)
            wanted = 1 if programs >= sms else max(1, min(-(-2 * sms // programs), max_keys // 64, pa._MAX_SPLITS))
            assert splits == wanted


def test_every_split_count_is_one_kernel_variant(recorder):
    """The split count is a runtime argument: an eager step's count follows its batch and longest context, and a
    variant per count would compile while serving."""
    for splits in (2, 3, 5, 9, 32):
        q, k, v, k_cache, v_cache, meta = make_batch([(300, 4, 10)], 4, 2, 16, 4, 4, False, torch.float32, DEVICE)
        triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, num_splits=splits)
    assert len(set(recorder.variants)) == 1


@pytest.mark.parametrize("sms", [None, 20, 132])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(16, 8), (32, 8), (4, 4), (64, 2), (8, 1)])
def test_warm_up_compiles_every_variant_a_step_can_launch(recorder, monkeypatch, num_heads, num_kv_heads, grouped,
                                                          sms):  # fmt: skip
    """After the engine's warm-up, no launch of a step meets a kernel variant for the first time: prefills of any
    length and batch, decode steps, with and without split keys (short contexts and long ones, whose splits
    pipeline their key loads), with and without PDL, on a GPU of any SM count (which decides where grouped queries
    take the small tiles)."""
    from diffulex.kernels import paged_attention as pa

    if sms is not None:
        monkeypatch.setattr(pa, "_fills_gpu", lambda device, programs: programs >= sms)
    head_dim, page_size, block_size = 16, 4, 4
    k_cache = torch.zeros(8, page_size, num_kv_heads, head_dim, device=DEVICE)  # where the steps run: TMA or not
    pa._launch_every_variant(k_cache, k_cache, num_heads, block_size, False, grouped)
    warmed = set(recorder.variants)
    # 16-row and 64-row tiles, unsplit or split at one or two stages, chained by PDL or not; long-query tiles, split
    # or not
    assert len(warmed) <= 14
    rng = random.Random(0)
    for _ in range(60):
        sizes = [1, 2, 4, 8, 9, 16, 17, 40, 127, 128, 300]
        requests = [(rng.choice([0, 7, 40, 2000]), rng.choice(sizes), 5) for _ in range(rng.randint(1, 20))]
        q, k, v, k_cache, v_cache, meta = make_batch(
            requests, num_heads, num_kv_heads, head_dim, page_size, block_size, False, torch.float32, DEVICE
        )
        recorder.variants.clear()
        triton_paged_attention(
            q, k, v, k_cache, v_cache, meta, 0.25, grouped=grouped, num_splits=rng.choice([None, 1, 2, 7])
        )
        assert set(recorder.variants) <= warmed, requests


def test_grouped_queries_take_the_small_tiles_where_the_large_grid_would_not_fill_the_gpu(recorder, monkeypatch):
    """16 queries of 2 heads a KV head are 32 packed rows: the 64-row class where its grid fills the GPU (each K/V
    tile read once per group), otherwise the 16-row class over two query tiles (more programs, no padding)."""
    from diffulex.kernels import paged_attention as pa

    for sms, block_q, q_tiles in [(8, 32, 1), (9, 8, 2)]:  # the 64-row grid: 8 programs (one request, 8 KV heads)
        monkeypatch.setattr(pa, "_fills_gpu", lambda device, programs, sms=sms: programs >= sms)
        q, k, v, k_cache, v_cache, meta = make_batch([(40, 16, 16)], 16, 8, 16, 4, 4, False, torch.float32, DEVICE)
        recorder.variants.clear()
        recorder.grids.clear()
        pa.triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, num_splits=1)
        (variant,) = [dict(v) for v in recorder.variants]
        assert variant["BLOCK_Q"] == block_q and recorder.grids == [(q_tiles, 1, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads", [8, 14])  # 4 heads a KV head; 7, padded to 8 (2 queries a 16-row tile)
def test_grouped_queries_over_several_small_tiles_match_reference(monkeypatch, num_heads, dtype):
    from diffulex.kernels import paged_attention as pa

    monkeypatch.setattr(pa, "_fills_gpu", lambda device, programs: False)
    check([(9, 16, 16), (0, 11, 11), (30, 3, 8), (5, 5, 5)], num_heads, 2, 16, 4, 4, False, dtype)


@pytest.mark.skipif(DEVICE != "cuda", reason="compiles happen only on a GPU")
def test_after_warm_up_no_launch_compiles_gpu():
    import triton

    from diffulex.kernels import paged_attention as pa

    k_cache = torch.zeros(16, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE)
    pa.warm_up(k_cache, k_cache.clone(), 16, 4, False, grouped=True)
    compiles = []
    triton.knobs.runtime.jit_cache_hook = lambda *a, **kw: compiles.append(kw.get("fn")) and False
    try:
        for requests in ([(0, 10, 10)], [(0, 300, 300)], [(0, 1, 1)] * 20, [(60, 4, 10), (0, 23, 23)]):
            check(requests, 16, 8, 128, 16, 4, False, torch.bfloat16)
    finally:
        triton.knobs.runtime.jit_cache_hook = None
    assert compiles == []

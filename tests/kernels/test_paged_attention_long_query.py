"""The long-query tile class of paged attention (a prompt's prefill): 128-row query tiles whose interior key tiles
fold without the mask. Against the PyTorch reference under every rule that cuts a tile (the block-causal diagonal,
prefix-full prompt rows, windows, padding, cached prefixes), and which launches take the class.

Shapes stay small (head_dim 16, a few hundred rows): on the CPU the kernel runs under the Triton interpreter.
"""

from __future__ import annotations

import pytest
import torch

from diffulex.attention.torch_paged import paged_attention
from diffulex.kernels import paged_attention as pa
from tests.kernels.test_paged_attention import DEVICE, DTYPES, TOL, check, make_batch, recorder  # noqa: F401
from tests.kernels.test_paged_attention_window import check_window

LONG = pa._LONG_QUERY_MIN


def launched_long(recorder) -> list[bool]:  # noqa: F811
    return [dict(variant).get("FULL_TILES", False) for variant in recorder.variants]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size", "prefix_full"),
    [
        (4, 2, 4, False),  # 64 positions x 2 heads per tile: the band of each tile's last block is masked
        (4, 2, 4, True),  # prompt rows see the whole prompt, the answer block after it block-causally
        (8, 2, 8, False),  # group 4: 32 positions per tile
        (6, 2, 4, True),  # group 3 padded to 4: padding rows inside every tile
        (4, 4, 1, False),  # no grouping, causal (block 1): 128 positions per tile
    ],
)
def test_a_long_prompt_matches_reference(num_heads, num_kv_heads, block_size, prefix_full, dtype):
    """A cold prompt longer than one tile, not a multiple of the tiles nor of the blocks (the last tiles padded)."""
    check([(0, LONG + 45, LONG + 41)], num_heads, num_kv_heads, 16, 8, block_size, prefix_full, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("prefix_full", [False, True])
def test_a_long_prompt_beside_decoders_matches_reference(prefix_full, dtype):
    """A ragged batch: a prompt chunk after a cached prefix (whole cached tiles unmasked, the partial one
    masked), a cold prompt, decode rows with cached contexts, an empty request and a rebuild inside its prompt."""
    requests = [(200, LONG + 2, 330), (0, LONG + 9, LONG + 5), (24, 4, 20), (150, 3, 150), (5, 0, 5), (40, 8, 3)]
    check(requests, 4, 2, 16, 8, 4, prefix_full, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ungrouped_long_prompt_matches_reference(dtype):
    check([(70, LONG + 3, 90), (0, 6, 6)], 4, 2, 16, 16, 4, False, dtype, grouped=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [17, 70, 200])
def test_a_long_causal_piece_with_a_sliding_window_matches_reference(window, dtype):
    """Rows anchored windows: the tiles below the highest floor of a query tile are masked, those above it
    unmasked; a window wider than the prompt hides nothing."""
    check_window([(0, LONG + 30, 0), (90, LONG, 0), (3, 5, 0)], 4, 2, 16, window, False, dtype, 1, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_canvas_with_a_window_from_context_matches_reference(dtype):
    """A canvas of 130 rows after a long context, bidirectional over itself, seeing the last 40 cached keys."""
    requests = [(180, LONG + 2, 180 + LONG + 2), (50, 4, 54)]
    check_window(requests, 4, 2, 16, 41, True, dtype, 4, True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_with_key_tails_match_reference(dtype):
    """A long row range whose last block reads cached keys after the rows (`key_lens`), beside refinements."""
    from tests.kernels.test_paged_attention_key_tails import check as check_tails

    check_tails(4, 2, 8, dtype, requests=[(64, LONG + 2, 60, 200), (16, 2, 10, 24), (0, LONG, LONG, LONG)])


@pytest.mark.skipif(DEVICE != "cuda", reason="realistic head dims are too slow for the interpreter")
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "prefix_full"), [(16, False), (32, True)])
def test_long_prompts_at_realistic_head_dims_gpu(num_heads, prefix_full, dtype):
    """SDAR-1.7B and 8B head layouts: a 2k prompt, a chunk after a cached prefix and a decode row in one launch
    (one split asked for: the long class whatever the grid), and a causal piece with a sliding window. In bfloat16,
    the dtype prompts are served in: float32's long class is checked at small head dims above, and at these its
    compile alone took 3 minutes of the GPU suite's 5 on an H100."""
    requests = [(0, 2100, 2050), (300, 700, 1000), (40, 4, 20), (0, 0, 0)]
    check(requests, num_heads, 8, 128, 16, 4, prefix_full, dtype, splits=1)
    check_window([(0, 1500, 0), (200, 300, 0)], num_heads, 8, 128, 256, False, dtype, 1, False, splits=1,
                 page_size=16)  # fmt: skip


def test_the_longest_query_of_a_launch_picks_the_class(recorder, monkeypatch):  # noqa: F811
    """Where the grid fills the GPU, queries of `_LONG_QUERY_MIN` positions or more launch the long class (never
    split, never chained by PDL, 8 warps); shorter ones the decode-sized classes exactly as before (4 warps, 2 stages
    unsplit). Which grids fill the GPU is the next test's statement."""
    monkeypatch.setattr(pa, "_auto_num_splits", lambda *args: 1)
    for requests, long in [([(0, LONG, LONG)], True), ([(0, LONG - 1, LONG - 1)], False),
                           ([(64, 4, 10)] * 3 + [(0, LONG + 5, LONG)], True), ([(64, 4, 10)] * 3, False)]:  # fmt: skip
        q, k, v, k_cache, v_cache, meta = make_batch(requests, 4, 2, 16, 4, 4, False, torch.float32, DEVICE)
        recorder.variants.clear()
        pa.triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
        (variant,) = [dict(v) for v in recorder.variants]
        assert variant.get("FULL_TILES", False) == long, requests
        if long:
            assert variant["BLOCK_Q"] == pa._LONG_QUERY_TILES.rows // 2 and variant["num_warps"] == 8
            assert not variant["SPLIT"] and not variant["USE_PDL"] and "launch_pdl" not in variant
        else:
            assert variant["num_warps"] == 4 and variant["num_stages"] == pa._STAGES_UNSPLIT
            assert variant["BLOCK_Q"] in (pa._SMALL_TILE_ROWS // 2, pa._LARGE_TILE_ROWS // 2)


def test_the_long_class_gives_way_only_where_the_grid_fills_the_gpu_but_the_longest_request_does_not(monkeypatch):
    """On a GPU the long class runs where the longest request's 128-row tiles fill the SMs, or where the whole grid
    does not and the keys are split (a prefix-cache hit's short tail on a long context: one request); it gives way
    to the 64-row class where the grid fills the GPU but the longest request's tiles do not (a 512-row chunk beside
    many decoders: no split, and a few large tiles would fold the long context alone), but not where every request
    is long (8 canvases of 512 rows fill it together). A split count asked for is taken as is."""
    from diffulex.kernels import split_counters

    cuda, sms = torch.device("cuda", 0), 132
    monkeypatch.setitem(split_counters._SM_COUNT, cuda, sms)
    tiles = pa._LONG_QUERY_TILES
    # 8 KV heads, 2 query heads each: 64 positions per long tile; (max_query_len, group_pad, head_dim, slots,
    # requests, max_kv_len, splits asked, min split keys)
    assert pa._long_query_tiles(cuda, 2048, 2, 128, 8, 1, 4096, None, 64) == tiles  # 32 tiles x 8 = 256 programs
    assert pa._long_query_tiles(cuda, 1088, 2, 128, 8, 40, 32000, None, 64) == tiles  # 17 x 8 = 136 programs
    assert pa._long_query_tiles(cuda, 260, 2, 128, 8, 1, 32000, None, 64) == tiles  # 5 x 8 = 40: split keys
    assert pa._long_query_tiles(cuda, 512, 2, 128, 8, 1, 32000, None, 64) == tiles  # 8 x 8 = 64: split keys
    assert pa._long_query_tiles(cuda, 512, 2, 128, 8, 33, 32000, None, 64) is None  # 64 x 33 fill: no split
    assert pa._long_query_tiles(cuda, 260, 2, 128, 8, 40, 32000, 1, 64) == tiles  # one split asked for
    assert pa._long_query_tiles(cuda, 260, 2, 128, 8, 1, 32000, 4, 64) == tiles  # four asked for
    assert pa._long_query_tiles(cuda, 512, 2, 128, 8, 33, 32000, None, 64, long_requests=8) == tiles  # 64 x 8
    assert pa._long_query_tiles(cuda, LONG - 1, 2, 128, 64, 1, 4096, None, 64) is None


def test_wide_heads_take_tiles_of_their_own_and_only_unsplit(monkeypatch):
    """Heads of 256 and 512 (DiffusionGemma's) take the wide entries' smaller tiles, where their grid fills the GPU
    without splitting keys (several canvases, a long encoder prompt); where it would be split (one canvas) or a
    split is asked for, the decode-sized classes, which measured faster there; heads wider than every entry never
    take the class, and neither do wide heads in 4-byte inputs (on a GPU their long tiles overflow shared memory or
    compile for minutes)."""
    from diffulex.kernels import split_counters

    cuda = torch.device("cuda", 0)
    monkeypatch.setitem(split_counters._SM_COUNT, cuda, 132)
    wide = pa._WIDE_LONG_QUERY_TILES
    assert pa.long_query_tiles_for(64) is pa.long_query_tiles_for(128) is pa._LONG_QUERY_TILES
    assert pa.long_query_tiles_for(256) is wide[256] and pa.long_query_tiles_for(512) is wide[512]
    assert pa.long_query_tiles_for(1024) is None
    assert pa.long_query_tiles_for(128, 4) is pa._LONG_QUERY_TILES
    assert pa.long_query_tiles_for(256, 4) is pa.long_query_tiles_for(512, 4) is None
    assert all(not tiles.split_keys and tiles.rows * width <= 128 * 256 for width, tiles in wide.items())
    # 26B-A4B: sliding layers 8 KV heads (group 2), full layers 2 (group 8); canvases of 256 rows after 512
    assert pa._long_query_tiles(cuda, 256, 2, 256, 8, 8, 768, None, 64, long_requests=8) is wide[256]
    assert pa._long_query_tiles(cuda, 256, 8, 512, 2, 8, 768, None, 64, long_requests=8) is wide[512]
    assert pa._long_query_tiles(cuda, 256, 2, 256, 8, 1, 768, None, 64, long_requests=1) is None
    assert pa._long_query_tiles(cuda, 2048, 2, 256, 8, 1, 2048, None, 64) is wide[256]
    assert pa._long_query_tiles(cuda, 2048, 2, 256, 8, 1, 2048, 1, 64) is wide[256]
    assert pa._long_query_tiles(cuda, 2048, 2, 256, 8, 1, 2048, 2, 64) is None
    assert pa._long_query_tiles(cuda, 2048, 2, 1024, 8, 1, 2048, None, 64) is None


def wide_tiles_forced(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Whether the wide heads' long tiles are forced on this launch: the interpreter runs float32 only, where the
    rule keeps wide heads in the decode-sized classes, so there they are forced to check their folding; a GPU checks
    them in bf16, and float32 under the rule."""
    if DEVICE == "cuda" or dtype != torch.float32:
        return False
    choose = pa.long_query_tiles_for
    monkeypatch.setattr(pa, "long_query_tiles_for", lambda head_dim, elem_size=2: choose(head_dim))
    return True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("head_dim", "num_heads", "num_kv_heads", "window"), [(256, 4, 2, 40), (512, 4, 1, 0)])
def test_canvases_of_wide_heads_in_long_tiles_match_reference(head_dim, num_heads, num_kv_heads, window, dtype,
                                                              monkeypatch):  # fmt: skip
    """DiffusionGemma's decoder launch: canvases that see their whole selves and the window's cached positions
    before them (a canvas block, prefix-full, the window anchored at the context), folded in the wide tiles (float32
    on a GPU: the decode-sized classes)."""
    wide = wide_tiles_forced(dtype, monkeypatch) or dtype != torch.float32
    chosen = []
    choose = pa._long_query_tiles
    monkeypatch.setattr(pa, "_long_query_tiles", lambda *args: chosen.append(choose(*args)) or chosen[-1])
    requests = [(70, LONG, 70 + LONG), (9, LONG, 9 + LONG)]
    check_window(requests, num_heads, num_kv_heads, head_dim, window, window > 0, dtype, LONG, True, splits=1)
    assert chosen == [pa._WIDE_LONG_QUERY_TILES[head_dim] if wide else None]


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_encoder_prompt_of_wide_heads_in_long_tiles_matches_reference(dtype, monkeypatch):
    """DiffusionGemma's encoder launch: causal prompt rows (block 1), each seeing the window before it, one of them
    after a cached prefix, folded in the tiles for heads of 256 (float32 on a GPU: the decode-sized classes)."""
    wide = wide_tiles_forced(dtype, monkeypatch) or dtype != torch.float32
    chosen = []
    choose = pa._long_query_tiles
    monkeypatch.setattr(pa, "_long_query_tiles", lambda *args: chosen.append(choose(*args)) or chosen[-1])
    check_window([(0, LONG + 20, 0), (50, LONG, 0)], 4, 2, 256, 60, False, dtype, 1, False, splits=1)
    assert chosen == [pa._WIDE_LONG_QUERY_TILES[256] if wide else None]


def test_a_split_long_query_launch_keeps_the_long_tiles_without_preloading(recorder):  # noqa: F811
    """Split keys and the long class together: 128-row tiles in 8 warps, split, never chained by PDL and without
    the decode classes' preloaded first tile (8 warps of 128-row tiles have no registers to spare for it)."""
    q, k, v, k_cache, v_cache, meta = make_batch([(300, LONG + 4, 300 + LONG + 4)], 4, 2, 16, 8, 4, False,
                                                 torch.float32, DEVICE)  # fmt: skip
    pa.triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, num_splits=3)
    (variant,) = [dict(v) for v in recorder.variants]
    assert variant["FULL_TILES"] and variant["SPLIT"] and variant["num_warps"] == 8
    assert not variant["PRELOAD_TILE"] and not variant["USE_PDL"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [2, 5])
def test_long_tiles_with_split_keys_match_reference(splits, dtype):
    """The long class with its keys split (a prompt tail after a long cached context, a prefill chunk, beside a
    decode row): every split's partial is combined into the unsplit result, block-causal and prefix-full."""
    for prefix_full in (False, True):
        check([(300, LONG + 4, 300 + LONG + 4), (90, 4, 20)], 4, 2, 16, 8, 4, prefix_full, dtype, splits=splits)


@pytest.mark.parametrize(("field", "value"), [("rows", 96), ("block_n", 8), ("num_warps", 6), ("num_stages", 0)])
def test_long_tiles_refuse_shapes_the_kernel_cannot_take(field, value):
    with pytest.raises(ValueError, match=f"{field}={value}"):
        pa.LongQueryTiles(**{field: value})


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU, tools/prefill_gpu_check.sh runs the script natively")
def test_the_gpu_bench_script_runs_every_config_and_names_one_to_keep(tmp_path):
    """``bench/prefill_attention_bench.py --quick`` (tiny shapes, the interpreter): every configuration is checked
    against the reference and timed, and the one kept ran every case."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "bench/prefill_attention_bench.py", str(tmp_path), "--quick",
                           "--lengths", "130"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "prefill_attention.json").read_text())
    assert all(r["error"] is None for r in report["rows"]), report["rows"]
    assert {r["case"] for r in report["rows"]} == {"130", "130 after 200"}  # a cold prompt, a chunk after a cache
    checked = [r for r in report["rows"] if "max_abs_error" in r]  # every configuration on the first case
    assert len(checked) == len(report["geomean_x_floor"]) and all(r["max_abs_error"] <= 1e-4 for r in checked)
    assert report["keep"] in report["geomean_x_floor"] and f"keep: {report['keep']}" in done.stdout


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the script runs natively (docs/benchmarks.md)")
def test_the_wide_head_bench_checks_every_config_and_keeps_one_per_head_width(tmp_path):
    """``bench/wide_head_attention_bench.py --quick`` (tiny shapes, the interpreter): each layer kind's
    configurations are checked against the reference on its first case and timed on every case, and the one kept
    per head width ran them all."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(repo), "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "bench/wide_head_attention_bench.py", str(tmp_path), "--quick"],
                          cwd=repo, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((tmp_path / "wide_head_attention.json").read_text())
    assert all(r["error"] is None for r in report["rows"]), report["rows"]
    assert {r["head_dim"] for r in report["rows"]} == {256, 512}
    assert {r["case"] for r in report["rows"]} == {"1 canvas(es) after 40", "2 canvas(es) after 40", "prompt of 130"}
    checked = [r for r in report["rows"] if "max_abs_error" in r]
    assert checked and all(r["max_abs_error"] <= 1e-4 for r in checked)
    for head_dim, choice in report["by_head_dim"].items():
        assert choice["keep"] in choice["geomean_x_floor"] and f"heads of {head_dim}: keep" in done.stdout


def test_the_default_long_tiles_compile_for_hopper_without_spilling():
    """``bench/attention_compile_check.py`` (Triton's ptxas, no GPU): the long class as launched by default fits
    the registers of 8 warps (no stack) and an H100's shared memory."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": str(repo)}
    done = subprocess.run([sys.executable, "bench/attention_compile_check.py", "--variants", "long", "--only",
                           "default"], cwd=repo, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r"long default.*?(\d+) registers,\s+(\d+) B stack,\s+(\d+) KiB shared", done.stdout)
    assert found, done.stdout
    registers, stack, shared_kib = map(int, found.groups())
    assert stack == 0 and registers <= 255 and shared_kib <= 227


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_long_prompt_whose_keys_and_values_are_slices_of_one_fused_projection_matches_reference(dtype):
    """In the engine v (and k where nothing rewrites it) is a view into the fused q/k/v projection's output, its rows
    as far apart as all the heads: the interior tiles' loads (through TMA descriptors where they can be made) take
    the rows' stride, not the view's width."""
    q, k, v, k_cache, v_cache, meta = make_batch([(0, LONG + 45, LONG + 41)], 4, 2, 16, 8, 4, False, dtype, DEVICE)
    fused = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1)  # [T, (4 + 2 + 2) * 16]
    q_view, k_view, v_view = (part.unflatten(1, (-1, 16)) for part in fused.split([64, 32, 32], dim=1))
    assert k_view.stride(0) == 128 and pa._new_key_descriptors(k_view, v_view, 64)[0] is not None
    expected = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    got = pa.triton_paged_attention(q_view, k_view, v_view, k_cache, v_cache, meta, 0.25)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("page_size", [32, 64, 128], ids=["two pages a tile", "a page a tile", "tiles inside a page"])
@pytest.mark.parametrize("splits", [None, 3])
def test_a_chunk_after_a_cached_prefix_reads_whole_cached_tiles_through_page_boxes(page_size, splits, dtype):
    """Cached keys of a prompt chunk that every row sees whole come through TMA boxes of their pages (two a tile at
    pages of half a tile, one at larger pages), in shuffled pages: the same as the gathered rows, split or not."""
    q, k, v, k_cache, v_cache, meta = make_batch(
        [(6 * page_size + 70, LONG + 9, 6 * page_size + 70)], 4, 2, 16, page_size, 4, False, dtype, DEVICE
    )
    assert all(d is not None for d in pa._cache_descriptors(k_cache, v_cache, 64))
    expected = paged_attention(q, k, v, k_cache, v_cache, meta, 0.25)
    got = pa.triton_paged_attention(q, k, v, k_cache, v_cache, meta, 0.25, num_splits=splits)
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])

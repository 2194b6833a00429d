"""The skinny GEMM against an fp32 ``F.linear``, and the dispatch that must leave CPU (and autograd) untouched.

Under the Triton interpreter (CPU) shapes stay small; the tolerance is one unit in the last place of the output
dtype, which only fp32 accumulation meets (accumulating in bf16 over K terms would be off by many).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffulex.kernels import tma
from diffulex.kernels.activation import silu_mul
from diffulex.kernels.skinny_gemm import (
    _EARLY_RELEASE_MIN_BYTES,
    GENERIC_MAX_ROWS,
    MAX_ROWS,
    UNSUMMED_PROGRAMS,
    Output,
    SkinnyConfig,
    _eager_variant,
    _releases_early,
    config_for,
    gated_config,
    maybe_skinny_linear,
    output_config,
    skinny_linear,
    skinny_partials,
    skinny_silu_mul,
    split_shape,
    unsummed_config,
    use_skinny,
)
from diffulex.kernels.split_counters import split_counters
from diffulex.layers import ColumnParallelLinear, LMHead, MergedProjection, RowParallelLinear
from diffulex.layers.linear import linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter's tl.dot mishandles bf16 operands, so on the CPU the MMA path is checked in fp16 only.
DOT_DTYPES = (torch.bfloat16, torch.float16) if DEVICE == "cuda" else (torch.float16,)

CONFIGS = [
    SkinnyConfig(16, 32, 4, 2, use_dot=False, split_k=1),
    SkinnyConfig(32, 64, 4, 1, use_dot=False, split_k=3),
    SkinnyConfig(16, 32, 4, 2, use_dot=True, split_k=1),
    SkinnyConfig(32, 64, 4, 3, use_dot=True, split_k=2),
]
# (M, N, K): odd rows, N not a multiple of BLOCK_N, K not a multiple of BLOCK_K, and one even case.
SHAPES = [(1, 40, 96), (3, 50, 100), (5, 33, 160), (16, 64, 128)]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return nn.functional.linear(x.float(), w.float(), None if b is None else b.float())


def check(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, rtol=torch.finfo(dtype).eps, atol=1e-3)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{'dot' if c.use_dot else 'fma'}-split{c.split_k}")
def test_matches_fp32_reference(cfg: SkinnyConfig) -> None:
    gen = torch.Generator().manual_seed(0)
    dtypes = DOT_DTYPES if cfg.use_dot else (torch.bfloat16, torch.float16)
    for i, (m, n, k) in enumerate(SHAPES):
        dtype = dtypes[i % len(dtypes)]
        x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
        w = (torch.randn(n, k, generator=gen) * 0.1).to(DEVICE, dtype)
        b = torch.randn(n, generator=gen).to(DEVICE, dtype) if i % 2 else None
        check(skinny_linear(x, w, b, cfg), reference(x, w, b), dtype)


TMA_CONFIGS = [
    SkinnyConfig(16, 32, 4, 2, use_dot=True, split_k=1, tma=True),
    SkinnyConfig(32, 64, 4, 3, use_dot=True, split_k=2, tma=True),
]


@pytest.mark.parametrize("cfg", TMA_CONFIGS, ids=lambda c: f"tma-split{c.split_k}")
def test_tma_weight_loads_match_the_reference(cfg: SkinnyConfig) -> None:
    """Weight tiles through tensor descriptors: rows past N and the K tail past the last tile read as zeros."""
    gen = torch.Generator().manual_seed(3)
    for m, n, k in [(1, 40, 96), (5, 33, 160), (16, 64, 128)]:
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
        w = (torch.randn(n, k, generator=gen) * 0.1).to(DEVICE, torch.float16)
        assert tma.descriptor(w, [cfg.block_n, cfg.block_k]) is not None
        check(skinny_linear(x, w, None, cfg), reference(x, w, None), torch.float16)


def test_tma_is_skipped_for_rows_that_are_not_16_byte_aligned() -> None:
    """A weight whose rows are not 16-byte aligned (K = 100 halves) takes the plain loads, with the same result."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 100, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(50, 100, generator=gen) * 0.1).to(DEVICE, torch.float16)
    assert tma.descriptor(w, [TMA_CONFIGS[0].block_n, TMA_CONFIGS[0].block_k]) is None
    check(skinny_linear(x, w, None, TMA_CONFIGS[0]), reference(x, w, None), torch.float16)


def test_split_counters_are_left_zero_for_the_next_call() -> None:
    """The last split resets its tile's counter: a second launch (as a graph replay would be) is right too."""

    gen = torch.Generator().manual_seed(1)
    cfg = SkinnyConfig(16, 32, 4, 1, use_dot=False, split_k=4)
    x = torch.randn(2, 128, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(48, 128, generator=gen).to(DEVICE, torch.bfloat16)
    for _ in range(2):
        check(skinny_linear(x, w, None, cfg), reference(x, w, None), torch.bfloat16)
    assert int(split_counters(x.device, 1).abs().sum()) == 0


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=["fma-split1", "dot-split2"])
def test_releasing_dependents_early_changes_no_bit_of_a_chain(cfg: SkinnyConfig) -> None:
    """``release_early`` only moves when the next kernel may start its prologue (with PDL on a GPU); it still waits
    for this product, so a chain of two products gives the same bits as with the release after the stream."""
    gen = torch.Generator().manual_seed(2)
    dtype = torch.float16
    x = torch.randn(3, 128, generator=gen).to(DEVICE, dtype)
    w1 = (torch.randn(96, 128, generator=gen) * 0.1).to(DEVICE, dtype)
    w2 = (torch.randn(64, 96, generator=gen) * 0.1).to(DEVICE, dtype)
    late = skinny_linear(skinny_linear(x, w1, None, cfg), w2, None, cfg)
    early = skinny_linear(skinny_linear(x, w1, None, cfg, release_early=True), w2, None, cfg, release_early=True)
    assert torch.equal(early, late)
    check(late, reference(reference(x, w1, None).to(dtype), w2, None), dtype)


def test_only_long_weight_streams_release_their_successors_at_the_start() -> None:
    """The SDAR-1.7B MLP weights (48 and 24 MiB in bf16) hide the next GEMM's start behind their stream; o_proj
    (8 MiB) is too short to, and keeps its release after the stream."""
    gate_up, down, o_proj = (torch.empty(n, k, dtype=torch.bfloat16, device="meta") for n, k in
                             ((12288, 2048), (2048, 6144), (2048, 2048)))
    assert _releases_early(gate_up) and _releases_early(down)
    assert not _releases_early(o_proj)
    at_threshold = torch.empty(_EARLY_RELEASE_MIN_BYTES // 4, dtype=torch.float32, device="meta")
    assert _releases_early(at_threshold) and not _releases_early(at_threshold[1:])


@pytest.mark.parametrize(
    "cfg", [CONFIGS[1], CONFIGS[3], TMA_CONFIGS[1]], ids=["fma-split3", "dot-split2", "tma-split2"]
)
def test_partials_summed_in_split_order_are_exactly_the_combined_product(cfg: SkinnyConfig) -> None:
    """`skinny_partials` leaves the split-K sum to its consumer; summed from zero in split order and rounded, the
    partials give the bits `skinny_linear` writes (its last split sums the same values in the same order)."""
    gen = torch.Generator().manual_seed(5)
    for m, n, k in [(1, 40, 96), (5, 33, 160), (4, 64, 256)]:
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
        w = (torch.randn(n, k, generator=gen) * 0.1).to(DEVICE, torch.float16)
        parts = skinny_partials(x, w, cfg)
        assert parts.dtype == torch.float32 and parts.shape == (split_shape(cfg, n, k)[1], m, n)
        total = torch.zeros(m, n, dtype=torch.float32, device=DEVICE)
        for part in parts:
            total += part
        assert torch.equal(total.to(torch.float16), skinny_linear(x, w, None, cfg))


def test_unsummed_config_splits_until_the_grid_covers_the_sms() -> None:
    """A consumer that sums the partials frees the split count from the in-kernel sum's cost: SDAR-1.7B's o_proj
    (one split in the table) gets four, down_proj keeps the table's four; a shape with one K tile cannot split."""
    o_proj = config_for(2048, 2048, 4)
    assert o_proj.split_k == 1
    assert unsummed_config(o_proj, 2048, 2048).split_k == UNSUMMED_PROGRAMS // (2048 // o_proj.block_n)
    down = config_for(2048, 6144, 4)
    assert unsummed_config(down, 2048, 6144).split_k == 4
    assert unsummed_config(SkinnyConfig(64, 128, 4, 2, True), 256, 128) is None


@pytest.mark.parametrize("cfg", [CONFIGS[0], CONFIGS[3]], ids=["fma", "dot-split"])
def test_a_product_no_row_of_which_is_read_is_skipped(cfg: SkinnyConfig) -> None:
    """``readers`` names the rows anyone reads (-1: none). With no row named, the launch writes nothing (an LM
    head a continuation step does not sample from streams no weights); with any row named, every row is the
    full product, whichever rows are named and whatever the index dtype."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 96, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(80, 96, generator=gen) * 0.3).to(DEVICE, torch.float16)
    expected = skinny_linear(x, w, None, cfg)
    for rows, dtype in [([-1, -1, -1, -1], torch.int64), ([-1], torch.int32)]:
        out = torch.full((4, 80), float("nan"), dtype=torch.float16, device=DEVICE)
        skinny_linear(x, w, None, cfg, readers=torch.tensor(rows, dtype=dtype, device=DEVICE), out=out)
        assert out.isnan().all()
    for rows, dtype in [([-1, 2, -1, -1, -1], torch.int64), ([0], torch.int32), ([3, 1], torch.int64)]:
        out = torch.full((4, 80), float("nan"), dtype=torch.float16, device=DEVICE)
        skinny_linear(x, w, None, cfg, readers=torch.tensor(rows, dtype=dtype, device=DEVICE), out=out)
        assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="readers must be a 1-D int32/int64 tensor"):
        skinny_linear(x, w, None, cfg, readers=torch.zeros(2, dtype=torch.float32, device=DEVICE))



def test_partials_and_gated_launches_skip_when_no_row_is_read(monkeypatch) -> None:
    """The unsummed and gated launches of a decoder's last layer take ``readers`` too: with a row named they are
    the plain product, with none named they write nothing (outputs stay as allocated, here NaN)."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, 96, generator=gen).to(DEVICE, torch.float16)
    w = (torch.randn(80, 96, generator=gen) * 0.3).to(DEVICE, torch.float16)
    split, gated = CONFIGS[1], GATED_CONFIGS[0]
    launches = {
        "partials": lambda readers: skinny_partials(x, w, split, readers=readers),
        "gated": lambda readers: skinny_silu_mul(x, w, None, gated, readers=readers),
    }
    for name, launch in launches.items():
        expected = launch(None)
        assert torch.equal(launch(torch.tensor([-1, 3], device=DEVICE)), expected), name
        monkeypatch.setattr(torch, "empty", nan_empty)
        skipped = launch(torch.tensor([-1, -1, -1, -1], device=DEVICE))
        monkeypatch.setattr(torch, "empty", real_empty)
        assert skipped.isnan().all(), name

GATED_CONFIGS = [  # small tiles under the interpreter (the table's gated tiles are 64 columns per half)
    SkinnyConfig(16, 32, 4, 2, use_dot=False),
    SkinnyConfig(16, 32, 4, 2, use_dot=True),
    SkinnyConfig(16, 32, 4, 2, use_dot=True, tma=True),
]


@pytest.mark.parametrize("cfg", GATED_CONFIGS, ids=["fma", "dot", "tma"])
def test_gated_launch_is_the_product_then_silu_mul_bit_for_bit(cfg: SkinnyConfig) -> None:
    """SiLU-and-mul in gate_up's epilogue: the same bits as the plain launch's rounded product followed by the
    activation kernel (odd widths, a tile that straddles the end of the gate half, with and without a bias)."""
    gen = torch.Generator().manual_seed(6)
    for i, (m, inter, k) in enumerate([(1, 40, 96), (5, 33, 160), (4, 64, 128), (100, 24, 64)]):
        x = torch.randn(m, k, generator=gen).to(DEVICE, torch.float16)
        w = (torch.randn(2 * inter, k, generator=gen) * 0.3).to(DEVICE, torch.float16)
        b = torch.randn(2 * inter, generator=gen).to(DEVICE, torch.float16) if i % 2 else None
        plain = skinny_linear(x, w, b, cfg._replace(block_n=2 * cfg.block_n))
        expected = silu_mul(plain[:, :inter], plain[:, inter:])
        assert torch.equal(skinny_silu_mul(x, w, b, cfg), expected)


def test_gated_config_keeps_the_rows_per_program_and_refuses_splits() -> None:
    """The gated launch streams the plain launch's rows per program (half from each half of the weight), so the
    grid keeps its size; a config that splits K cannot gate (the activation needs whole sums), and neither can
    one whose halves would be narrower than measured worthwhile (SDAR-8B's gate_up)."""
    gate_up = config_for(12288, 2048, 4)
    assert gated_config(gate_up).block_n * 2 == gate_up.block_n
    assert gated_config(config_for(2048, 6144, 4)) is None
    assert gated_config(config_for(24576, 4096, 4)) is None


def test_a_batch_of_32_requests_blocks_takes_the_kernel_only_for_the_lm_heads_and_gated_gate_up() -> None:
    """At 65-128 rows (17-32 requests' blocks of 4) only the shapes measured to tie or beat cuBLAS there run on the
    kernel: the SDAR LM heads and SDAR-8B's gate_up, which launches gated (one launch instead of the product and the
    activation); the rest stays on cuBLAS, and so does everything past 128 rows."""
    for n, k in [(151936, 2048), (151936, 4096), (24576, 4096)]:
        assert config_for(n, k, 128) is not None and config_for(n, k, 65) == config_for(n, k, 128)
    for n, k in [(4096, 2048), (2048, 2048), (12288, 2048), (2048, 6144), (6144, 4096), (4096, 4096), (4096, 12288)]:
        assert config_for(n, k, 128) is None
    assert output_config(Output.SILU_MUL, 24576, 4096, 128).block_n * 2 == config_for(24576, 4096, 128).block_n
    assert config_for(24576, 4096, MAX_ROWS + 1) is None


def test_strided_rows_of_x() -> None:
    """A row-strided view of x (a slice of a wider activation) needs no copy and gives the same result."""
    gen = torch.Generator().manual_seed(2)
    wide = torch.randn(4, 200, generator=gen).to(DEVICE, torch.float16)
    x = wide[:, :96]
    w = torch.randn(24, 96, generator=gen).to(DEVICE, torch.float16)
    check(skinny_linear(x, w, None, CONFIGS[0]), reference(x, w, None), torch.float16)


def test_dispatch_is_off_on_cpu_and_under_autograd() -> None:
    x = torch.randn(4, 2048, dtype=torch.bfloat16)
    w = torch.randn(4096, 2048, dtype=torch.bfloat16)
    assert config_for(4096, 2048, 4) is not None  # a table shape, so only the device rules it out
    assert not use_skinny(x, w)
    assert not use_skinny(x, w, torch.zeros(4096, dtype=torch.bfloat16))
    if torch.cuda.is_available():
        xg, wg = x.cuda(), nn.Parameter(w.cuda())
        assert not use_skinny(xg, wg), "a weight that records gradients keeps the differentiable F.linear"
        assert not use_skinny(xg.float(), wg.detach().float()), "fp32 is not handled"
        assert not use_skinny(torch.randn(MAX_ROWS + 1, 2048, device="cuda", dtype=torch.bfloat16), wg.detach())


def test_config_table_rows_and_fallback() -> None:
    assert config_for(4096, 2048, MAX_ROWS + 1) is None
    assert config_for(151936, 4096, 5) == config_for(151936, 4096, 8)  # one bucket
    assert config_for(64, 64, 4) is None, "tiny matrices stay on cuBLAS"
    generic = config_for(4352, 3584, 4)  # not in the table, similar size
    assert generic is not None and generic.use_dot
    assert config_for(4352, 3584, GENERIC_MAX_ROWS + 1) is None, "above 16 rows only measured shapes"
    assert config_for(3584, 3584, 33) is not None and config_for(37888, 3584, 33) is None  # the table decides
    assert config_for(4608, 3584, 4) is None, "a measured shape where cuBLAS wins"


def test_an_moe_router_of_128_experts_splits_its_short_k_stream_and_matches_the_reference() -> None:
    """SDAR-30B-A3B's router (128 experts from a hidden state of 2,048) takes its measured config: four column tiles
    would leave the GPU idle, so the stream splits along K, and the split sum is the product."""
    cfg = config_for(128, 2048, 4)
    assert cfg is not None and cfg.split_k > 1 and config_for(128, 2048, 64) is None
    gen = torch.Generator().manual_seed(3)
    dtype = DOT_DTYPES[0]
    x = torch.randn(4, 2048, generator=gen).to(DEVICE, dtype)
    w = (torch.randn(128, 2048, generator=gen) * 0.02).to(DEVICE, dtype)
    check(skinny_linear(x, w, None, cfg), reference(x, w, None), dtype)


def test_eager_calls_that_compile_apart_are_warmed_apart() -> None:
    """The eager dedup keys on what Triton specializes: reader counts that pad to the same slots but differ in
    divisibility by 16 are different compiled kernels, and a graph captured later must find each compiled; row
    counts of one tile are one (the kernel does not specialize on them)."""
    cfg = SkinnyConfig(64, 128, 4, 4, use_dot=True, split_k=1)
    w = torch.empty(256, 128, dtype=torch.float16)

    def key(rows: int, readers: torch.Tensor | None = None) -> tuple:
        return _eager_variant(torch.empty(rows, 128, dtype=torch.float16), w, None, cfg, Output.SUM, readers)

    assert key(18, torch.arange(18)) != key(32, torch.arange(32)), "18 readers compile apart from 32"
    assert key(17, torch.arange(17)) == key(19, torch.arange(19)), "neither a multiple of 16, both 32 slots"
    assert key(18) == key(32) and key(1) == key(2), "rows of one tile: one kernel"
    assert key(16, torch.arange(16)) != key(16, torch.arange(17)[1:]), "the readers' address is specialized too"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_capture_after_the_eager_warm_up_compiles_nothing_gpu() -> None:
    from diffulex.kernels.skinny_gemm import _skinny_kernel

    assert config_for(2048, 2048, 18) is not None and config_for(2048, 2048, 32) is not None
    n, k = 2048, 2048  # SDAR-1.7B's o_proj: the table takes 18 and 32 rows
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    inputs = [torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for rows in (32, 18)]
    readers = [torch.arange(x.shape[0], device="cuda") for x in inputs]  # all rows read: a graph's last layer
    for x, rows in zip(inputs, readers, strict=True):  # the eager warm-up before a capture, largest first
        maybe_skinny_linear(x, w, readers=rows)
    compiled = sum(len(caches[0]) for caches in _skinny_kernel.device_caches.values())
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            outputs = [maybe_skinny_linear(x, w, readers=rows) for x, rows in zip(inputs, readers, strict=True)]
    assert all(y is not None for y in outputs), "under capture the skinny GEMM takes every shape of its table"
    assert sum(len(caches[0]) for caches in _skinny_kernel.device_caches.values()) == compiled
    graph.replay()
    for x, y in zip(inputs, outputs, strict=True):
        check(y, reference(x, w, None), torch.bfloat16)


def test_layers_on_cpu_are_exactly_f_linear() -> None:
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(32, 48, bias=True), RowParallelLinear(48, 32)
    x = torch.randn(4, 32)
    assert torch.equal(col(x), nn.functional.linear(x, col.weight, col.bias))
    assert torch.equal(row(col(x)), nn.functional.linear(col(x), row.weight))
    head = LMHead(100, 32)
    assert torch.equal(head(x), nn.functional.linear(x, head.weight))
    assert torch.equal(linear(x, col.weight), nn.functional.linear(x, col.weight))
    q, k = ColumnParallelLinear(32, 16), ColumnParallelLinear(32, 8)
    merged = MergedProjection(q, k)
    assert merged.merge()
    for got, want in zip(merged(x), nn.functional.linear(x, merged.weight).split([16, 8], dim=-1), strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("captured", [True, False], ids=["captured-by-the-kernel", "not-the-kernels-shape"])
def test_an_eager_call_after_the_first_takes_cublas_not_another_output_of_the_kernel(monkeypatch, captured) -> None:
    """Once the kernel's unsummed (or gated) variant is compiled, later eager calls come back None: where a capture
    would launch that output, they take the plain product from cuBLAS, never the kernel's summed output (whose first
    eager call would compile a variant no capture launches); elsewhere they go the layer's usual way."""
    from diffulex.kernels import skinny_gemm
    from diffulex.layers import linear as linear_module

    outputs: list[str] = []

    def compiled_already(x, weight, bias=None, *, output="sum", release_early=False, readers=None):
        outputs.append(output)
        return None

    monkeypatch.setattr(linear_module, "_skinny_for", lambda x: compiled_already)
    monkeypatch.setattr(skinny_gemm, "capture_config", lambda *args: CONFIGS[0] if captured else None)
    torch.manual_seed(0)
    x = torch.randn(3, 64)
    row = RowParallelLinear(64, 32)
    assert torch.equal(row.forward_unsummed(x), nn.functional.linear(x, row.weight))
    assert outputs == (["partials"] if captured else ["partials", "sum"])

    outputs.clear()
    gate, up = nn.Linear(64, 48, bias=False), nn.Linear(64, 48, bias=False)
    merged = MergedProjection(gate, up)
    assert merged.merge()
    expected = nn.functional.silu(nn.functional.linear(x, gate.weight)) * nn.functional.linear(x, up.weight)
    torch.testing.assert_close(merged.silu_mul(x), expected)
    assert outputs == (["silu_mul"] if captured else ["silu_mul", "sum"])


def test_a_batch_of_canvases_meets_the_kernel_as_its_rows(monkeypatch) -> None:
    """``[B, n, K]`` inputs (DiffusionGemma's canvases) reach the skinny GEMM as ``B * n`` rows of K and come back in
    their own shape; a strided one (no flat view) and one the kernel declines take ``F.linear``."""
    from diffulex.layers import linear as linear_module

    seen: list[tuple[int, ...]] = []

    def kernel(x, weight, bias=None, *, output="sum", release_early=False, readers=None):
        seen.append(tuple(x.shape))
        return None if x.shape[0] > 8 else 2 * nn.functional.linear(x, weight, bias)  # 2x: the kernel's mark

    monkeypatch.setattr(linear_module, "_skinny_for", lambda x: kernel if x.dim() == 2 else None)
    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 24)
    canvases = torch.randn(2, 4, 16)
    assert torch.equal(layer(canvases), 2 * nn.functional.linear(canvases, layer.weight))
    assert seen == [(8, 16)]
    wide = torch.randn(3, 4, 16)
    assert torch.equal(layer(wide), nn.functional.linear(wide, layer.weight))
    strided = torch.randn(4, 2, 16).transpose(0, 1)
    assert torch.equal(layer(strided), nn.functional.linear(strided, layer.weight))
    assert seen == [(8, 16), (12, 16)]


def test_forward_hooks_still_see_the_layer_output() -> None:
    """LoRA applied per forward is a forward hook on the layer; the overridden forward must keep it working."""
    from diffulex.lora import _lora_forward_hook

    torch.manual_seed(0)
    layer = ColumnParallelLinear(16, 8)
    a, b = torch.randn(2, 16), torch.randn(8, 2)
    layer.register_buffer("lora_A", a, persistent=False)
    layer.register_buffer("lora_B", b, persistent=False)
    layer.lora_scaling = 0.5
    layer.register_forward_hook(_lora_forward_hook)
    x = torch.randn(3, 16)
    expected = nn.functional.linear(x, layer.weight) + 0.5 * (x @ a.T) @ b.T
    torch.testing.assert_close(layer(x), expected)

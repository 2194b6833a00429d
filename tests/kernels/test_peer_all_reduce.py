"""The fused all-reduce + residual add + RMSNorm over peer inboxes, every rank run in one process.

Ranks sharing one process run one after another, so every rank pushes before any gathers (the kernel's two
phases as two launches, on the CPU under the Triton interpreter or on one GPU); a rank's result must be NCCL's
all-reduce followed by the norm. The one-launch path across devices is `bench/all_reduce_norm_latency.py`'s and
`bench/tp_decode.py`'s (two GPUs).
"""

from __future__ import annotations

import pytest
import torch

from diffulex.kernels.peer_all_reduce import all_reduce_rms_norm, exchange_supports, row_programs
from diffulex.layers import RMSNorm
from diffulex.layers.peer_exchange import ROW_PROGRAMS_MAX, PeerExchange, exchanges_in_one_process
from tests.kernels.test_fused_norm import assert_matches, make_norm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def exchange_rows(
    exchanges: list[PeerExchange],
    partials: list[torch.Tensor],
    norm: RMSNorm,
    residual: torch.Tensor,
    pushing: list[bool] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(normed, summed)``; ``pushing[r]`` False: rank ``r`` never sends (its kernel is not run)."""
    ranks = [r for r in range(len(exchanges)) if pushing is None or pushing[r]]
    results = {}
    for phases in ((True, False), (False, True)):
        for rank in ranks:
            results[rank] = all_reduce_rms_norm(
                partials[rank], exchanges[rank], norm.weight, norm.eps, residual, phases=phases
            )
    return [results[rank] for rank in ranks]


def reference(
    partials: list[torch.Tensor], norm: RMSNorm, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NCCL's sum (fp32 in rank order, rounded once), then the module's own residual add and norm (its torch code,
    on the kernel's device, where PyTorch's rsqrt is the kernel's)."""
    total = partials[0].float()
    for part in partials[1:]:
        total = total + part.float()
    summed = total.to(partials[0].dtype) + residual
    return norm._norm(summed), summed


def random_rows(world: int, rows: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[list, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    partials = [torch.randn(rows, hidden, generator=gen).to(dtype).to(DEVICE) for _ in range(world)]
    return partials, (2 * torch.randn(rows, hidden, generator=gen)).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("world", "rows", "hidden"), [(2, 1, 64), (2, 5, 96), (3, 4, 64), (4, 2, 128)])
def test_every_rank_gets_the_all_reduced_rows_normalized(dtype, world, rows, hidden) -> None:
    norm = make_norm(hidden, dtype, seed=hidden).to(DEVICE)
    partials, residual = random_rows(world, rows, hidden, dtype, seed=world * 100 + rows)
    exchanges = exchanges_in_one_process(world, DEVICE, hidden * 4)
    results = exchange_rows(exchanges, partials, norm, residual)
    expected_normed, expected_summed = reference(partials, norm, residual)
    for normed, summed in results:
        assert torch.equal(summed, expected_summed)
        assert_matches(normed, expected_normed)
        assert torch.equal(normed, results[0][0]), "the ranks must agree bit for bit"
    assert not any(exchange.timed_out() for exchange in exchanges)


@pytest.mark.parametrize("hidden", [64, 1024])
def test_consecutive_exchanges_of_different_row_counts_each_get_their_own_rows(hidden) -> None:
    """Row positions alternate between two inbox slots, each exchange flagged by its position's count: steps of
    4, 16, 4, 4 and 1 rows, each summing only its own partials. Rows of 1024 are pushed by several programs each,
    as many as the step's row count leaves room for (4, 1, 4, 4, 8), and every copy of a position's count moves on."""
    dtype = torch.bfloat16
    norm = make_norm(hidden, dtype, seed=1).to(DEVICE)
    exchanges = exchanges_in_one_process(2, DEVICE, hidden * 2, max_rows=16)
    for step, rows in enumerate([4, 16, 4, 4, 1]):
        partials, residual = random_rows(2, rows, hidden, dtype, seed=step)
        results = exchange_rows(exchanges, partials, norm, residual)
        expected_normed, expected_summed = reference(partials, norm, residual)
        for normed, summed in results:
            assert torch.equal(summed, expected_summed), f"step {step}"
            assert_matches(normed, expected_normed)
    counts = exchanges[0].uses[:5]
    assert counts.tolist() == [[count] * counts.shape[1] for count in (5, 4, 4, 4, 1)]
    assert not exchanges[0].timed_out()


@pytest.mark.parametrize(("rows", "words", "programs"), [(1, 2048, 8), (4, 2048, 4), (8, 2048, 2), (16, 2048, 1),
                                                         (1, 32, 1), (2, 128, 2)])  # fmt: skip
def test_a_row_is_pushed_by_more_programs_the_fewer_rows_an_exchange_has(rows, words, programs) -> None:
    assert row_programs(rows, words, ROW_PROGRAMS_MAX)[0] == programs
    assert row_programs(rows, words, ROW_PROGRAMS_MAX)[1] * programs >= words


def test_a_peer_that_never_sends_times_the_wait_out_instead_of_taking_older_rows() -> None:
    """Two exchanges later the same inbox slot still holds that peer's older rows: they must not pass for this
    exchange's. The wait gives up (bounded) and marks the exchange failed."""
    hidden, dtype = 64, torch.float32
    norm = make_norm(hidden, dtype, seed=2).to(DEVICE)
    exchanges = exchanges_in_one_process(2, DEVICE, hidden * 4, timeout_s=0.05)
    for step in range(2):
        partials, residual = random_rows(2, 3, hidden, dtype, seed=step)
        exchange_rows(exchanges, partials, norm, residual)
    assert not exchanges[0].timed_out()
    partials, residual = random_rows(2, 3, hidden, dtype, seed=9)
    exchange_rows(exchanges, partials, norm, residual, pushing=[True, False])
    assert exchanges[0].timed_out()


@pytest.mark.parametrize(
    ("shape", "dtype", "residual", "fits"),
    [
        ((4, 64), torch.bfloat16, True, True),
        ((4, 64), torch.bfloat16, False, False),  # the first layer's norm: no residual to add
        ((9, 64), torch.bfloat16, True, False),  # more rows than an inbox holds
        ((4, 256), torch.bfloat16, True, False),  # wider rows than an inbox holds
        ((4, 63), torch.bfloat16, True, False),  # a row that is not whole 4-byte words
        ((4, 64), torch.float64, True, False),
    ],
)
def test_what_the_exchange_takes(shape, dtype, residual, fits) -> None:
    local = torch.zeros(shape, dtype=dtype)
    assert exchange_supports(local, torch.zeros_like(local) if residual else None, 256, 8) is fits

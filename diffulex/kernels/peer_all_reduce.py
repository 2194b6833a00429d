"""A row-parallel projection's all-reduce, the residual add and the RMSNorm after it, in one launch over peer memory.

Why: under tensor parallelism a decode step at batch 1 runs two all-reduces a layer of a few kilobytes each, and
each one is latency, not bytes: NCCL's took 6.8 us on two H100s (SDAR-8B, 73 a step: 0.49 ms of a 3.9 ms step),
plus the RMSNorm launch after it, which cannot start its PDL prologue behind a NCCL kernel. Here every rank writes
its partial rows straight into every peer's inbox (mapped by CUDA IPC, `diffulex.layers.peer_exchange`), then
reads its own inbox, sums the ranks' rows in rank order (its own from its registers), adds the residual and
normalizes, all in the kernel that the norm already was.

A row is pushed by several programs at once, each storing a slice of it (`row_programs`): one SM issues its remote
stores one after another, so a whole 16 KB row from one program reached the peer in 2.3 us (4 warps; one word: 0.65
us), and the peer waits for its last word. Every program of a row still reads the whole summed row, for the norm's
sum of squares, and stores only its slice of the results.

The wire format carries its own readiness: each 8-byte word is 4 bytes of the row (two bf16/fp16 values or one
fp32) and a 4-byte flag, stored together, so a reader never sees a word's data without its flag and needs no
barrier. The flag is the count of this row position's exchanges so far (`PeerExchange.uses`), the same on every
rank because every rank runs the same exchanges in the same order. A row position keeps equal copies of its count
(one a column of ``uses``, as many as programs may push one row): each program of a row reads one that no other
program of the launch writes (a program that read the count after another had bumped it would wait for the wrong
flag), and the launch bumps them all.
A row position alternates between two inbox slots, so a slot is written again only two exchanges of that position
later; by then its readers are done with it, because a rank can only have finished the exchange between them once
every peer had pushed all of it, which each did after finishing its own previous kernels. Every exchange is such
a collective step, so no separate barrier is needed anywhere.

The result equals NCCL's all-reduce followed by `diffulex.kernels.fused_norm.rms_norm` with the residual: the
ranks' rows are summed in fp32 in rank order and rounded once to the model dtype (NCCL's sum of two bf16 values
is that rounding too), and every rank computes the same sum. The norm's roundings are `rms_norm`'s.

A rank that never pushes (dead, or far behind) would hold its peers' kernels: a reader gives up after
``timeout_ns`` of device time (`PeerExchange.timeout_ns`, the engine's collective timeout) and marks the exchange
failed (`PeerExchange.failed`). An engine's exchange then traps (`PeerExchange.trap_on_timeout`): the step fails
with a CUDA error, as a timed-out NCCL collective fails it, rather than handing on rows that are not the sum; an
exchange of a test goes on with what it has, so that the flag can be read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from diffulex.kernels.fused_norm import INTERPRETING, as_rows, cast_rne
from diffulex.kernels.pdl import launch_kwargs, pdl_enabled, release_dependents, wait_for_inputs

if TYPE_CHECKING:
    from diffulex.layers.peer_exchange import PeerExchange

_WORD_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
# Warps a row's program runs. Fewer threads make each poll's block-wide count cheaper: one exchange of 1 / 4 rows
# of 4096 bf16 in a graph of 64 (two H100s) took 5.14 / 5.18 us with 16 warps, 4.64 / 4.77 with 8, 4.58 / 4.66 with 4.
_NORM_WARPS = 4
# A waiting program reads the device clock (for its timeout) once in this many polls: reading it every poll cost
# about 0.25 us an exchange (5.14 -> 4.85 us at one row).
_POLLS_PER_CLOCK_READ = tl.constexpr(64)
_INTERPRETING = tl.constexpr(INTERPRETING)
# Under the Triton interpreter (no device clock) the wait is bounded by polls instead of nanoseconds.
_INTERPRETED_POLLS = 64
# Programs pushing one row (`row_programs`): up to the copies of a row position's count (``PeerExchange.uses``),
# aiming at this many programs a launch, each with at least this many words of the row. Measured (two H100s, one
# exchange of 4096 bf16 a row in a graph of 64): 1 / 4 rows took 4.80 / 4.95 us pushed by one program a row,
# 4.22 / 4.33 by up to 4, 4.18 / 4.48 by up to 8 (32 programs at 4 rows), 4.22 / 4.68 by up to 16.
_LAUNCH_PROGRAMS_TARGET = 16
_MIN_SLICE_WORDS = 64


@triton.jit
def _now_ns():
    """The device's global timer in nanoseconds."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _trap():
    """Abort the kernel (and the CUDA context's work): a sticky launch error on the host."""
    tl.inline_asm_elementwise("trap; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _unflagged(word, ok, flag):
    """How many of a row's words (those ``ok``) do not carry ``flag`` yet."""
    return tl.sum((((word >> 32).to(tl.int32) != flag) & ok).to(tl.int32), axis=0)


@triton.jit
def _wait_for_words(row_ptr, words, ok, flag, deadline):
    """The inbox words ``row_ptr[words]`` once each carries ``flag``, or as they are at ``deadline`` (device ns;
    under the interpreter, which has no device clock, after `_INTERPRETED_POLLS` polls).

    The block polls all its words at once and counts the ones not yet flagged. (A PTX loop in which each thread
    spins on its own words measured slower on two H100s: 6.2 against 5.1 us at one row, its words' loads one after
    another instead of together.)"""
    word = tl.load(row_ptr + words, mask=ok, other=0, volatile=True)
    waiting = _unflagged(word, ok, flag)
    polls = 0
    while waiting > 0:
        word = tl.load(row_ptr + words, mask=ok, other=0, volatile=True)
        waiting = _unflagged(word, ok, flag)
        polls += 1
        if _INTERPRETING:
            late = polls >= _INTERPRETED_POLLS
        else:
            late = False
            if polls % _POLLS_PER_CLOCK_READ == 0:
                late = _now_ns() > deadline
        if late:
            waiting = waiting * 0
    return word


@triton.jit
def _unpack(payload, PER_WORD: tl.constexpr, X_DTYPE: tl.constexpr):
    """A word's 4 data bytes as fp32 values: (low half, high half) for 16-bit dtypes, (the value, 0) for fp32."""
    if PER_WORD == 2:
        low = (payload & 0xFFFF).to(tl.uint16).to(X_DTYPE, bitcast=True).to(tl.float32)
        high = ((payload >> 16) & 0xFFFF).to(tl.uint16).to(X_DTYPE, bitcast=True).to(tl.float32)
    else:
        low = payload.to(tl.float32, bitcast=True)
        high = tl.zeros_like(low)
    return low, high


@triton.jit
def _add_residual(total, res_ptrs, sum_ptrs, ok, mine, X_DTYPE: tl.constexpr):
    """The ranks' fp32 ``total`` rounded to the model dtype, plus the residual (the torch add, rounded): stored as
    the next residual where ``mine`` and returned in fp32 where ``ok``."""
    summed = cast_rne(
        cast_rne(total, X_DTYPE).to(tl.float32) + tl.load(res_ptrs, mask=ok, other=0.0).to(tl.float32),
        sum_ptrs.dtype.element_ty,
    )
    tl.store(sum_ptrs, summed, mask=mine)
    return summed.to(tl.float32)


@triton.jit
def _store_normed(s32, rstd, w_ptrs, out_ptrs, mine, SUM_DTYPE: tl.constexpr):
    """``weight * (s * rstd rounded to the sum's dtype)``, rounded once to the output's dtype, stored where
    ``mine``."""
    out = tl.load(w_ptrs, mask=mine, other=0.0).to(tl.float32) * cast_rne(s32 * rstd, SUM_DTYPE).to(tl.float32)
    tl.store(out_ptrs, cast_rne(out, out_ptrs.dtype.element_ty), mask=mine)


@triton.jit(do_not_specialize=["n_rows"])
def _all_reduce_norm_kernel(
    local_ptr,  # int32 words of this rank's partial rows
    inboxes_ptr,  # int64: the address of every rank's inbox
    inbox_ptr,  # int64 words: this rank's inbox [2 slots, ranks, rows, words]
    uses_ptr,  # int32 per row position: its exchanges so far
    failed_ptr,  # int32: set when a wait timed out
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_rows,
    n_words,
    stride_local,
    stride_r,
    stride_o,
    stride_s,
    slot_words,
    rank_words,
    row_words,
    rank,
    inv_n,
    eps,
    timeout_ns,
    WORLD: tl.constexpr,
    PER_WORD: tl.constexpr,
    X_DTYPE: tl.constexpr,
    PUSH: tl.constexpr,
    GATHER: tl.constexpr,
    TRAP_ON_TIMEOUT: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROW_PROGRAMS: tl.constexpr,
    SLICE_W: tl.constexpr,
    COUNTS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    release_dependents(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    words = tl.arange(0, BLOCK_W)
    ok = words < n_words
    wait_for_inputs(USE_PDL)
    flag = tl.load(uses_ptr + row * COUNTS + part) + 1
    slot = (flag % 2).to(tl.int64)
    if PUSH:
        sliced = part * SLICE_W + tl.arange(0, SLICE_W)
        sliced_ok = sliced < n_words
        sent = tl.load(local_ptr + row * stride_local + sliced, mask=sliced_ok, other=0)
        packed = (flag.to(tl.int64) << 32) | (sent.to(tl.int64) & 0xFFFFFFFF)
        mine = slot * slot_words + rank * rank_words + row * row_words
        for peer in tl.static_range(WORLD):
            if peer != rank:
                inbox = tl.load(inboxes_ptr + peer).to(tl.pointer_type(tl.int64))
                tl.store(inbox + mine + sliced, packed, mask=sliced_ok)
    if GATHER:
        # this rank's own share is summed from its registers: only the peers' shares go through inboxes
        payload = tl.load(local_ptr + row * stride_local + words, mask=ok, other=0)
        low = tl.zeros([BLOCK_W], dtype=tl.float32)
        high = tl.zeros([BLOCK_W], dtype=tl.float32)
        if _INTERPRETING:
            deadline = 0
        else:
            deadline = _now_ns() + timeout_ns
        for source in tl.static_range(WORLD):
            if source == rank:
                data = payload
            else:
                row_ptr = inbox_ptr + slot * slot_words + source * rank_words + row * row_words
                word = _wait_for_words(row_ptr, words, ok, flag, deadline)
                late = _unflagged(word, ok, flag) > 0
                if late:
                    tl.atomic_max(failed_ptr, 1)
                    if TRAP_ON_TIMEOUT:
                        _trap()
                data = word.to(tl.int32)
            part_low, part_high = _unpack(data, PER_WORD, X_DTYPE)
            low += part_low
            high += part_high
        counts = tl.arange(0, COUNTS)
        tl.store(uses_ptr + row * COUNTS + counts, flag, mask=counts % ROW_PROGRAMS == part)
        # the whole row is summed for the norm; this program stores its slice of the results
        mine = ok & (words >= part * SLICE_W) & (words < (part + 1) * SLICE_W)
        # the sum over the ranks rounded once, then the residual add and the norm exactly as `rms_norm` does them;
        # a 16-bit row is two halves of the words (even and odd columns), an fp32 row one
        cols = words * PER_WORD
        s_low = _add_residual(
            low, res_ptr + row * stride_r + cols, sum_ptr + row * stride_s + cols, ok, mine, X_DTYPE
        )
        square_sum = tl.sum(s_low * s_low, axis=0)
        if PER_WORD == 2:
            s_high = _add_residual(
                high, res_ptr + row * stride_r + cols + 1, sum_ptr + row * stride_s + cols + 1, ok, mine, X_DTYPE
            )
            square_sum += tl.sum(s_high * s_high, axis=0)
        rstd = tl.math.rsqrt(square_sum * inv_n + eps)
        _store_normed(s_low, rstd, w_ptr + cols, out_ptr + row * stride_o + cols, mine, sum_ptr.dtype.element_ty)
        if PER_WORD == 2:
            _store_normed(
                s_high, rstd, w_ptr + cols + 1, out_ptr + row * stride_o + cols + 1, mine, sum_ptr.dtype.element_ty
            )


def row_programs(n_rows: int, n_words: int, max_programs: int) -> tuple[int, int]:
    """(programs a row, words each pushes): the slices as many as the row has `_MIN_SLICE_WORDS` for, within
    ``max_programs`` and about `_LAUNCH_PROGRAMS_TARGET` programs a launch; a power-of-two slice."""
    wanted = max(1, min(max_programs, _LAUNCH_PROGRAMS_TARGET // n_rows, n_words // _MIN_SLICE_WORDS))
    slice_words = triton.next_power_of_2(triton.cdiv(n_words, wanted))
    return triton.cdiv(n_words, slice_words), slice_words


def exchange_supports(local: torch.Tensor, residual: torch.Tensor | None, row_bytes: int, max_rows: int) -> bool:
    """Whether `all_reduce_rms_norm` takes this partial (else NCCL's all-reduce and the plain norm): a model dtype
    it packs, a residual of its shape and dtype, rows that fit an inbox of ``max_rows`` rows of ``row_bytes``."""
    if local.dtype not in _WORD_DTYPES or residual is None or residual.shape != local.shape:
        return False
    if residual.dtype != local.dtype or local.shape[-1] * local.element_size() % 4:
        return False
    rows = local.numel() // max(1, local.shape[-1])
    return 0 < rows <= max_rows and local.shape[-1] * local.element_size() <= row_bytes


def all_reduce_rms_norm(
    local: torch.Tensor,
    exchange: PeerExchange,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor,
    phases: tuple[bool, bool] = (True, True),
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(sum over ranks of local + residual), that sum + residual)``: `RMSNorm.forward` of the all-reduced
    ``local`` with ``residual`` (`diffulex.layers.norm`), every rank getting the same result.

    ``exchange``: this rank's `diffulex.layers.peer_exchange.PeerExchange`; `exchange_supports` must hold.
    ``phases``: (push, gather). One launch does both; where ranks share one sequential executor (the Triton
    interpreter running every rank in one process, as the CPU tests do) every rank pushes before any gathers.
    """
    n_cols = local.shape[-1]
    x2 = as_rows(local)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    per_word = 4 // local.element_size()
    n_words = n_cols // per_word
    r2 = as_rows(residual)
    out = torch.empty(local.shape, dtype=torch.promote_types(weight.dtype, local.dtype), device=local.device)
    summed = torch.empty(local.shape, dtype=local.dtype, device=local.device)
    inbox = exchange.inbox
    use_pdl = pdl_enabled(local.device, n_rows)
    programs, slice_words = row_programs(n_rows, n_words, exchange.uses.shape[1])
    _all_reduce_norm_kernel[(n_rows, programs)](
        x2.view(torch.int32),
        exchange.inboxes,
        inbox,
        exchange.uses,
        exchange.failed,
        r2,
        weight if weight.is_contiguous() else weight.contiguous(),
        out.view(-1, n_cols),
        summed.view(-1, n_cols),
        n_rows,
        n_words,
        x2.stride(0) // per_word,
        r2.stride(0),
        n_cols,
        n_cols,
        inbox.stride(0),
        inbox.stride(1),
        inbox.stride(2),
        exchange.rank,
        1.0 / n_cols,
        eps,
        exchange.timeout_ns,
        WORLD=exchange.world,
        PER_WORD=per_word,
        X_DTYPE=_WORD_DTYPES[local.dtype],
        PUSH=phases[0],
        GATHER=phases[1],
        TRAP_ON_TIMEOUT=exchange.trap_on_timeout and not INTERPRETING,
        BLOCK_W=triton.next_power_of_2(n_words),
        ROW_PROGRAMS=programs,
        SLICE_W=slice_words,
        COUNTS=exchange.uses.shape[1],
        USE_PDL=use_pdl,
        num_warps=_NORM_WARPS,
        enable_fp_fusion=False,
        **launch_kwargs(use_pdl),
    )
    return out, summed

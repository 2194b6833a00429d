"""DiffusionGemma's sampled canvas step over its float32 logits in two passes: `row_statistics`, then
`draw_and_probs`.

Why: a sampled step of `diffulex.strategy.diffusion_gemma.canvas.denoise_canvases` reads each canvas's scaled logits
(``[256, 262,144]`` float32, 256 MiB) about twenty times in PyTorch: the argmax, `token_entropy`'s log-softmax,
its product and sum, the softmax, `draw_categorical`'s quotient and argmax, and the self-conditioning input cast
from the float32 probabilities. Each row only needs a handful of numbers from one pass over it (its maximum, its
first argmax, the sum of the exponentials, the entropy), and the draw one more pass that reads the exponential race
beside the logits and may write the probabilities once, in the model's dtype.

`row_statistics` keeps, per lane of a ``BLOCK``-wide tile, a running maximum ``m`` (and the lowest index reaching
it), ``s = sum exp(x - m)`` and ``t = sum exp(x - m) * (x - m)`` over the lane's elements, and merges the lanes at
the end. When a lane's maximum grows from ``m`` to ``m'`` both sums are rescaled: ``s' = e^(m - m') s`` and
``t' = e^(m - m') (t + (m - m') s)``. Each element needs a single exponential, ``exp(-|x - m|)``: the new element's
weight when it is not above the maximum, the rescaling factor when it is (its own weight is then 1). The entropy of
``softmax(x)`` is then ``H = log(s) - t / s``; ``-inf`` entries (banned ids) have weight 0 and add nothing, as in
`token_entropy`. Rounding (measured under the interpreter against a float64 entropy): within 1e-7 relative where
``H`` is above about 1, closer than `token_entropy`'s float32 sum; within about 1e-7 absolute for a nearly one-hot
row, whose ``s`` rounds to a hair above 1 (`token_entropy` rounds its ``log(s)`` the same way).

`draw_and_probs` forms ``p = exp(x - max) / sum`` as PyTorch's CUDA softmax does (the exponential relative to the
maximum, divided by the sum, IEEE-rounded), so the probabilities are within a few ulps of that formula's (at most 4
measured under the interpreter against ``torch.exp(x - max) / sum``: the order of the sum differs; PyTorch's CPU
softmax takes a cheaper exponential, some 10 ulps from either). The draw is `draw_categorical`'s: the lowest index
of the largest ``p / race`` (IEEE division), ``race`` being the caller's ``Exp(1)`` numbers (drawn with the
request's generator, exactly as `draw_categorical` draws them).

The self-conditioning input is another softmax: that of the scaled logits rounded to the model dtype (the model is
handed its logits in its dtype, `diffulex.strategy.diffusion_gemma.canvas.self_conditioning_probs`), rounded to the
model dtype again. Asked for that dtype, `row_statistics` also keeps the maximum and the sum of the exponentials of
the rounded logits (``probs_max``, ``probs_sum``; the rounding in registers), and `draw_and_probs` writes
``exp(r(x) - probs_max) / probs_sum`` in that dtype, ``r`` the rounding to it.

A row with a NaN, a ``+inf`` or no finite entry at all is no distribution `torch.multinomial` accepts: its
``finite`` flag is False (`drawable`'s verdict), its entropy NaN (as `token_entropy`'s), its argmax and maximum
those of ``torch.argmax`` and ``torch.max`` (the first NaN; else the first ``+inf``), and its draw some index in
range. Everything else about such a row is unspecified.

On the GPU the exponential and the logarithm are libdevice's (``expf``, ``logf``, as PyTorch's kernels use; Triton's
``tl.exp`` is the faster ``ex2.approx`` form); the Triton interpreter (the CPU tests) has no libdevice and uses
``tl.exp`` and ``tl.log``. Probabilities go to the model dtype through `diffulex.kernels.fused_norm.cast_rne`
(round to nearest even, also under the interpreter).

One program per row walks the vocabulary in tiles: rows are many (256 per canvas), so the grid fills the GPU
without splitting rows. Offsets are int64 (eight canvases of rows are more than 2^31 elements). No PDL: the canvas
step launches over at least 256 rows, above `diffulex.kernels.pdl.PDL_MAX_ROWS`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from diffulex.kernels.activation import PRECISE_EXP
from diffulex.kernels.fused_norm import cast_rne

# Vocabulary entries a program reads per step of its loop, and its warps: measured on an H100 over a canvas of
# 256 x 262,144 (one program per row, so few programs: wide tiles and many warps keep loads in flight):
# statistics 173 us at 2,048 in 16 warps (254 at 4,096 in 8), the draw 243 us at 4,096 in 16 (259 in 8).
BLOCK = 2048
_NUM_WARPS = 16
_DRAW_BLOCK = 4096
_DRAW_WARPS = 16
# exp(x - max) below exp(-87) is under float32's smallest normal: such entries are taken as 0. Denormal operands
# send IEEE division to its slow path (a peaked canvas, most entries far below the maximum, drew 5x slower), and
# no such entry can win the draw (the largest probability is at least 1 / vocab) or weigh in a self-conditioning
# product.
_UNDERFLOW = tl.constexpr(-87.0)
# Dtypes `draw_and_probs` may write the probabilities in (the model's, or float32).
PROBS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_VOCAB = 2**30  # indices are int32, with room for a tile's lanes past the last id
_NO_INDEX = tl.constexpr(2**31 - 1)  # larger than any vocabulary index: "none yet" in index minimums
_PRECISE = tl.constexpr(PRECISE_EXP)  # libdevice's expf/logf on the GPU; the interpreter has no libdevice


class RowStatistics(NamedTuple):
    """Per row of the scaled logits ``x [R, V]`` (each field ``[R]``, on ``x``'s device)."""

    argmax: torch.Tensor  # int64: lowest index of the largest entry (torch.argmax)
    max: torch.Tensor  # float32: m, the largest entry
    sum: torch.Tensor  # float32: s = sum_v exp(x_v - m), softmax's denominator
    log_sum: torch.Tensor  # float32: log(s), so log_softmax(x) = x - m - log_sum
    entropy: torch.Tensor  # float32: entropy of softmax(x), -inf entries contributing 0
    finite: torch.Tensor  # bool: no NaN, no +inf and some entry above -inf (a distribution to draw from)
    probs_max: torch.Tensor  # float32: max of x rounded to the probabilities' dtype (max itself for float32)
    probs_sum: torch.Tensor  # float32: sum exp(r(x) - probs_max), r the rounding (sum itself for float32)


# The dtypes the probabilities are formed in, as Triton names them.
_TRITON_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _exp(x):
    if _PRECISE:
        y = libdevice.exp(x)
    else:
        y = tl.exp(x)
    return y


@triton.jit
def _log(x):
    if _PRECISE:
        y = libdevice.log(x)
    else:
        y = tl.log(x)
    return y


@triton.jit
def _rounded(x, ROUND_TO: tl.constexpr):
    """``x`` as the model dtype holds it (rounded to nearest even), back in float32."""
    if ROUND_TO == tl.float32:
        y = x
    else:
        y = cast_rne(x, ROUND_TO).to(tl.float32)
    return y


@triton.jit
def _add_weight(m, s, x):
    """A running maximum ``m`` and sum ``s = sum exp(v - m)`` with ``x`` added: the sum rescaled where ``x`` raises
    the maximum. One exponential, ``exp(-|x - m|)``; ``-inf`` (and NaN) entries weigh 0."""
    above = x > m
    hi = tl.where(above, x, m)
    lo = tl.where(above, m, x)
    counts = lo > float("-inf")
    hi_or_0 = tl.where(hi > float("-inf"), hi, 0.0)
    z = tl.where(counts, _exp(tl.where(counts, lo, hi_or_0) - hi_or_0), 0.0)
    return hi, tl.where(above, s * z + 1.0, s + z)


@triton.jit
def _row_statistics_kernel(
    x_ptr,
    argmax_ptr,
    max_ptr,
    sum_ptr,
    log_sum_ptr,
    entropy_ptr,
    finite_ptr,
    probs_max_ptr,
    probs_sum_ptr,
    vocab,
    BLOCK: tl.constexpr,
    ROUND_TO: tl.constexpr,  # the probabilities' dtype; float32: no statistics of their own
):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * vocab
    lanes = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)  # each lane's running maximum (NaN never enters it)
    best = lanes  # the lowest index of the lane reaching m (a lane visits its indices in increasing order)
    s = tl.zeros((BLOCK,), tl.float32)  # sum exp(x - m) over the lane
    t = tl.zeros((BLOCK,), tl.float32)  # sum exp(x - m) * (x - m) over the lane
    first_nan = tl.full((BLOCK,), _NO_INDEX, tl.int32)
    pm = tl.full((BLOCK,), float("-inf"), tl.float32)  # the same maximum and sum of the rounded logits
    ps = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        ids = start + lanes
        x = tl.load(base + ids, mask=ids < vocab, other=float("-inf"))
        above = x > m
        hi = tl.where(above, x, m)  # the lane's new maximum
        lo = tl.where(above, m, x)
        counts = lo > float("-inf")  # a -inf (or NaN) lo weighs 0: no -inf - -inf or -inf * 0 below
        hi_or_0 = tl.where(hi > float("-inf"), hi, 0.0)
        d = tl.where(counts, lo, hi_or_0) - hi_or_0  # lo - hi <= 0 where lo counts, else 0
        z = tl.where(counts, _exp(d), 0.0)  # x's weight, or (x above m) the rescaling of s and t
        dz = d * z
        s_above = s * z + 1.0
        t_above = t * z + dz * s
        s = tl.where(above, s_above, s + z)
        t = tl.where(above, t_above, t + dz)
        best = tl.where(above, ids, best)
        m = hi
        first_nan = tl.minimum(first_nan, tl.where(x != x, ids, _NO_INDEX))
        if ROUND_TO != tl.float32:
            pm, ps = _add_weight(pm, ps, _rounded(x, ROUND_TO))
    # merge the lanes: rescale each lane's sums to the row maximum
    row_max = tl.max(m, axis=0)
    arg = tl.min(tl.where(m == row_max, best, _NO_INDEX), axis=0)
    shift = tl.where(row_max == float("-inf"), 0.0, row_max)  # no finite entry: exp(-inf - 0) = 0, not NaN
    w = _exp(m - shift)
    dm = tl.where(m > float("-inf"), m - shift, 0.0)
    s_row = tl.sum(s * w, axis=0)
    t_row = tl.sum(w * (t + dm * s), axis=0)
    log_s = _log(s_row)
    entropy = log_s - tl.math.div_rn(t_row, s_row)
    nan_at = tl.min(first_nan, axis=0)
    has_nan = nan_at < _NO_INDEX
    finite = (nan_at == _NO_INDEX) & (row_max < float("inf")) & (row_max > float("-inf"))
    tl.store(argmax_ptr + row, tl.where(has_nan, nan_at, arg).to(tl.int64))
    tl.store(max_ptr + row, tl.where(has_nan, float("nan"), row_max))
    tl.store(sum_ptr + row, s_row)
    tl.store(log_sum_ptr + row, log_s)
    tl.store(entropy_ptr + row, tl.where(finite, entropy, float("nan")))
    tl.store(finite_ptr + row, finite.to(tl.int8))
    if ROUND_TO != tl.float32:
        probs_max = tl.max(pm, axis=0)
        probs_shift = tl.where(probs_max == float("-inf"), 0.0, probs_max)
        tl.store(probs_max_ptr + row, probs_max)
        tl.store(probs_sum_ptr + row, tl.sum(ps * _exp(pm - probs_shift), axis=0))


@triton.jit
def _draw_kernel(
    x_ptr,
    race_ptr,
    max_ptr,
    sum_ptr,
    finite_ptr,
    probs_max_ptr,
    probs_sum_ptr,
    drawn_ptr,
    valid_ptr,
    probs_ptr,
    vocab,
    BLOCK: tl.constexpr,
    WRITE_PROBS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offset = row * vocab
    lanes = tl.arange(0, BLOCK)
    row_max = tl.load(max_ptr + row)
    row_sum = tl.load(sum_ptr + row)
    probs_max = tl.load(probs_max_ptr + row)
    probs_sum = tl.load(probs_sum_ptr + row)
    best_q = tl.full((BLOCK,), -1.0, tl.float32)  # below every quotient p / race >= 0
    best = tl.zeros((BLOCK,), tl.int32)  # index 0 until a lane sees a number: a draw in range whatever the row
    for start in range(0, vocab, BLOCK):
        ids = start + lanes
        ok = ids < vocab
        x = tl.load(x_ptr + offset + ids, mask=ok, other=float("-inf"))
        race = tl.load(race_ptr + offset + ids, mask=ok, other=1.0)
        d = x - row_max
        weighs = d >= _UNDERFLOW  # False for -inf (banned) and NaN entries too
        p = tl.math.div_rn(_exp(tl.where(weighs, d, 0.0)), row_sum)
        if WRITE_PROBS:
            dtype = probs_ptr.dtype.element_ty
            d_soft = _rounded(x, dtype) - probs_max
            counts = d_soft >= _UNDERFLOW
            soft = tl.where(counts, tl.math.div_rn(_exp(tl.where(counts, d_soft, 0.0)), probs_sum), 0.0)
            tl.store(probs_ptr + offset + ids, cast_rne(soft, dtype), mask=ok)
        q = tl.where(weighs, tl.math.div_rn(p, race), 0.0)
        better = ok & (q > best_q)  # strictly: a lane keeps its lowest index among equal quotients
        best_q = tl.where(better, q, best_q)
        best = tl.where(better, ids, best)
    top = tl.max(best_q, axis=0)
    drawn = tl.min(tl.where(best_q == top, best, _NO_INDEX), axis=0)
    tl.store(drawn_ptr + row, drawn.to(tl.int64))
    tl.store(valid_ptr + row, tl.load(finite_ptr + row))


def _check_logits(name: str, x: torch.Tensor) -> None:
    if x.dtype != torch.float32:
        raise ValueError(f"{name} has dtype {x.dtype}; only torch.float32 is allowed")
    if x.dim() != 2:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; it must be 2-D [rows, vocab]")
    if not x.is_contiguous():
        raise ValueError(f"{name} with strides {x.stride()} must be contiguous")
    if x.shape[1] >= _MAX_VOCAB:
        raise ValueError(f"{name} has a vocabulary of {x.shape[1]}; at most {_MAX_VOCAB - 1} ids are allowed")


def row_statistics(scaled: torch.Tensor, probs_dtype: torch.dtype | None = None) -> RowStatistics:
    """One pass over ``scaled [R, V]`` (float32, contiguous, already divided by its temperature, banned ids
    ``-inf``): each row's argmax, maximum, softmax denominator and its log, entropy and finiteness (`RowStatistics`;
    the module docstring says how they round and what a non-finite row gets). With ``probs_dtype`` (one of
    `PROBS_DTYPES`; the dtype `draw_and_probs` will write the probabilities in) also the maximum and denominator of
    the logits rounded to it."""
    _check_logits("scaled", scaled)
    if probs_dtype is not None and probs_dtype not in PROBS_DTYPES:
        raise ValueError(f"probs_dtype={probs_dtype} is invalid: allowed {', '.join(map(str, PROBS_DTYPES))}")
    round_to = _TRITON_DTYPES[probs_dtype or torch.float32]
    rows, vocab = scaled.shape
    device = scaled.device
    row_max = torch.empty(rows, dtype=torch.float32, device=device)
    row_sum = torch.empty(rows, dtype=torch.float32, device=device)
    rounded = round_to != tl.float32
    stats = RowStatistics(
        argmax=torch.empty(rows, dtype=torch.int64, device=device),
        max=row_max,
        sum=row_sum,
        log_sum=torch.empty(rows, dtype=torch.float32, device=device),
        entropy=torch.empty(rows, dtype=torch.float32, device=device),
        finite=torch.empty(rows, dtype=torch.bool, device=device),
        probs_max=torch.empty_like(row_max) if rounded else row_max,
        probs_sum=torch.empty_like(row_sum) if rounded else row_sum,
    )
    if rows == 0:
        return stats
    if vocab == 0:
        raise ValueError(f"scaled has shape {tuple(scaled.shape)}; a row needs at least one entry")
    _row_statistics_kernel[(rows,)](
        scaled,
        stats.argmax,
        stats.max,
        stats.sum,
        stats.log_sum,
        stats.entropy,
        stats.finite.view(torch.int8),
        stats.probs_max,
        stats.probs_sum,
        vocab,
        BLOCK=BLOCK,
        ROUND_TO=round_to,
        num_warps=_NUM_WARPS,
    )
    return stats


def draw_and_probs(
    scaled: torch.Tensor,
    race: torch.Tensor,
    stats: RowStatistics,
    probs_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One draw per row of ``softmax(scaled)`` by the exponential race (`draw_categorical`'s ``argmax(p / race)``,
    lowest index on ties), given ``race [R, V]`` (float32 ``Exp(1)`` numbers) and ``stats = row_statistics(scaled)``.
    Returns ``(drawn, valid)``: ``[R]`` int64 indices and ``[R]`` bool, False where the row is no distribution to draw
    from (``stats.finite``; `drawable`'s verdict). When ``probs_out`` (``[R, V]`` contiguous, one of
    `PROBS_DTYPES`) is given, the softmax of ``scaled`` rounded to its dtype is also written there, rounded to
    nearest even: ``stats`` must then be ``row_statistics(scaled, probs_out.dtype)``."""
    _check_logits("scaled", scaled)
    _check_logits("race", race)
    if race.shape != scaled.shape:
        raise ValueError(f"race has shape {tuple(race.shape)}; it must be scaled's {tuple(scaled.shape)}")
    rows, vocab = scaled.shape
    for name, value in zip(RowStatistics._fields, stats, strict=True):
        if value.shape != (rows,) or value.device != scaled.device:
            raise ValueError(f"stats.{name} has shape {tuple(value.shape)} on {value.device}; it must be "
                             f"[{rows}] on scaled's device {scaled.device}")  # fmt: skip
    if stats.max.dtype != torch.float32 or stats.sum.dtype != torch.float32 or stats.finite.dtype != torch.bool:
        raise ValueError(f"stats has max {stats.max.dtype}, sum {stats.sum.dtype}, finite {stats.finite.dtype}; "
                         "they must be torch.float32, torch.float32, torch.bool (row_statistics' output)")  # fmt: skip
    if probs_out is not None:
        if probs_out.dtype not in PROBS_DTYPES:
            raise ValueError(f"probs_out has dtype {probs_out.dtype}; allowed: {', '.join(map(str, PROBS_DTYPES))}")
        if probs_out.shape != scaled.shape or not probs_out.is_contiguous() or probs_out.device != scaled.device:
            raise ValueError(f"probs_out has shape {tuple(probs_out.shape)}, strides {probs_out.stride()} on "
                             f"{probs_out.device}; it must be contiguous {tuple(scaled.shape)} on "
                             f"{scaled.device}")  # fmt: skip
    device = scaled.device
    drawn = torch.empty(rows, dtype=torch.int64, device=device)
    valid = torch.empty(rows, dtype=torch.bool, device=device)
    if rows == 0:
        return drawn, valid
    _draw_kernel[(rows,)](
        scaled,
        race,
        stats.max,
        stats.sum,
        stats.finite.view(torch.int8),
        stats.probs_max,
        stats.probs_sum,
        drawn,
        valid.view(torch.int8),
        scaled if probs_out is None else probs_out,
        vocab,
        BLOCK=_DRAW_BLOCK,
        WRITE_PROBS=probs_out is not None,
        num_warps=_DRAW_WARPS,
        enable_fp_fusion=False,
    )
    return drawn, valid

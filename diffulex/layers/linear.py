"""Every weight matrix of a model: projections, the token embedding and the LM head.

They all live here because these are exactly the layers tensor parallelism shards over the process's group
(`diffulex.layers.parallel_state`, read once when a layer is built): column-parallel projections hold their rank's
slice of the output features, row-parallel ones their slice of the input features and all-reduce their output, the
embedding and the LM head their slice of the vocabulary. At TP=1 (the default group) each class is a plain
``nn.Linear``/``nn.Embedding`` running the code it always ran. Each layer's ``weight_loader`` copies a full
checkpoint tensor's rank slice into a parameter.
Parameter names stay ``weight``/``bias`` so checkpoint keys map one to one.

Every product goes through `linear`: ``F.linear`` (cuBLAS), or on CUDA at decode row counts the Triton skinny
GEMM (`diffulex.kernels.skinny_gemm`), which streams the weights faster than cuBLAS's small-M tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from diffulex.layers.activation import silu_and_mul
from diffulex.layers.dispatch import triton_available
from diffulex.layers.parallel_state import TensorParallelGroup, tensor_parallel_group

if TYPE_CHECKING:
    from diffulex.layers.peer_exchange import PeerExchange

# The most rows the skinny GEMM takes (`diffulex.kernels.skinny_gemm.MAX_ROWS`, repeated here so that larger
# inputs skip importing it): decode steps of a few requests, whole-block forwards of a few dozen rows, and the LM
# heads and gated gate_up of 17-32 requests' blocks.
SKINNY_MAX_ROWS = 128


@functools.cache
def _skinny() -> Callable[..., torch.Tensor | None] | None:
    """`maybe_skinny_linear`, imported on the first CUDA call (triton is optional); None without triton."""
    if not triton_available():
        return None
    from diffulex.kernels.skinny_gemm import maybe_skinny_linear

    return maybe_skinny_linear


@dataclass(frozen=True)
class UnsummedProduct:
    """A row-parallel projection's output left as its K splits: ``parts [splits, rows, N]`` in fp32, whose sum in
    split order, rounded to ``dtype``, is the output.

    Why: a split GEMM ends with a dependent pass that sums the splits; at decode batch sizes that tail is on the
    critical path of every o_proj and down_proj (SDAR-1.7B batch 1, H100: about 1 us each). The residual add +
    RMSNorm that follows reads the whole row anyway and sums the partials itself (`RMSNorm.forward`). Only
    `RowParallelLinear.forward_unsummed` makes one, and only a caller whose next step is such a norm asks.
    """

    parts: torch.Tensor
    dtype: torch.dtype

    def materialize(self) -> torch.Tensor:
        """The product as a tensor, summed as the GEMM would have (for consumers without a fused path)."""
        total = self.parts[0].clone()
        for part in self.parts[1:]:
            total += part
        return total.to(self.dtype)


@dataclass(frozen=True)
class PartialOverRanks:
    """A row-parallel projection's output before its all-reduce: ``local`` is this rank's partial product (model
    dtype), whose sum over the tensor-parallel ranks is the output.

    Why: the RMSNorm that follows can do the all-reduce itself, over peer memory, with the residual add and the
    norm in the same launch (`diffulex.kernels.peer_all_reduce`): at decode sizes the all-reduce is latency, and
    NCCL's plus the separate norm cost twice what the fused kernel does. ``exchange`` is the rank's
    `diffulex.layers.peer_exchange.PeerExchange`; a consumer without the fused path calls `materialize`.
    """

    local: torch.Tensor
    exchange: PeerExchange
    tp: TensorParallelGroup

    def materialize(self) -> torch.Tensor:
        """The output: ``local`` all-reduced by NCCL (in place)."""
        return self.tp.all_reduce(self.local)


def _captured_by_skinny(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, output: str) -> bool:
    """Whether a graph capture of this call launches the skinny GEMM's `output`: then an eager call of it that came
    back None (the kernel compiled by an earlier one: `maybe_skinny_linear`) takes cuBLAS for the whole product,
    as the warm-up's later calls do, rather than a plain skinny product that no capture launches here (whose first
    eager call would compile a variant for nothing, during the warm-up before a capture)."""
    from diffulex.kernels.skinny_gemm import capture_config

    return capture_config(x, weight, bias, output) is not None


def _skinny_for(x: torch.Tensor) -> Callable[..., torch.Tensor | None] | None:
    """`maybe_skinny_linear` when ``x`` is a decode-sized CUDA input outside ``torch.compile`` tracing, else None
    (the cheap checks, made before anything imports triton)."""
    if x.is_cuda and x.dim() == 2 and x.shape[0] <= SKINNY_MAX_ROWS and not torch.compiler.is_compiling():
        return _skinny()
    return None


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    release_early: bool = False,
    readers: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear``, except where `diffulex.kernels.skinny_gemm.use_skinny` picks the skinny GEMM (few rows on
    CUDA, a shape it wins). On the CPU, under autograd and under ``torch.compile`` this is exactly ``F.linear``.
    ``release_early`` and ``readers`` (the rows anyone reads; with none the skinny GEMM may leave the output
    unwritten): see `diffulex.kernels.skinny_gemm.maybe_skinny_linear`. A contiguous ``x`` of more than two dims
    (``[B, n, K]``, as DiffusionGemma's canvases come) is taken as its ``B * n`` rows, so it meets the skinny GEMM
    by its row count as a flat one does."""
    rows = x.view(-1, x.shape[-1]) if x.dim() > 2 and x.is_contiguous() else x
    skinny = _skinny_for(rows)
    y = skinny(rows, weight, bias, release_early=release_early, readers=readers) if skinny is not None else None
    if y is None:
        return nn.functional.linear(x, weight, bias)
    return y if rows is x else y.view(*x.shape[:-1], y.shape[-1])


def _copy_into(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
    """Copy ``value`` into ``param``, refusing a shape that differs (a checkpoint of another geometry)."""
    if tuple(value.shape) != tuple(param.shape):
        raise ValueError(
            f"{what}: checkpoint tensor of shape {tuple(value.shape)} does not fit the parameter's "
            f"{tuple(param.shape)}"
        )
    with torch.no_grad():
        param.copy_(value)


def _check_full_size(loaded: torch.Tensor, dim: int, expected: int, what: str) -> None:
    """Refuse a checkpoint tensor whose full size along ``dim`` is not ``expected``, before slicing it."""
    if loaded.dim() <= dim or loaded.shape[dim] != expected:
        raise ValueError(
            f"{what}: checkpoint tensor of shape {tuple(loaded.shape)} must have {expected} along dim {dim}"
        )


class _Linear(nn.Linear):
    """``nn.Linear`` whose product goes through `linear`; forward hooks (LoRA) wrap this forward as before."""

    def forward(self, x: torch.Tensor, readers: torch.Tensor | None = None) -> torch.Tensor:
        """The product; with ``readers`` (device row indices, -1 for none) only the rows it names are promised
        (`linear`)."""
        return linear(x, self.weight, self.bias, readers=readers)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy the checkpoint's full tensor for ``param`` (this module's weight or bias) into it, whole."""
        _copy_into(param, loaded, type(self).__name__)

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        """The shape of ``param``'s tensor in a checkpoint (the whole of it, before any rank takes its slice)."""
        return tuple(param.shape)


class ReplicatedLinear(_Linear):
    """A projection every rank holds whole (small layers such as MoE routers)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)


class ColumnParallelLinear(_Linear):
    """A projection whose output features are split across TP ranks (q/k/v, gate/up); each rank computes its slice.

    ``output_parts`` names the projections a checkpoint fuses into this one matrix (LLaDA2's q/k/v): each part is
    split across the ranks on its own, so a rank holds its slice of every part, in order, and its output is
    ``[q_r, k_r, v_r]`` like an unsharded fused output. Separate projections joined by `MergedProjection` need
    nothing: each module already holds its own slice.
    """

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, output_parts: Sequence[int] | None = None
    ) -> None:
        tp = tensor_parallel_group()
        parts = tuple(output_parts) if output_parts is not None else (output_size,)
        if sum(parts) != output_size:
            raise ValueError(
                f"output_parts={list(parts)} is invalid: must add up to output_size={output_size}"
            )
        local = sum(tp.shard(part, "output features")[1] for part in parts)
        super().__init__(input_size, local, bias=bias)
        self.tp: TensorParallelGroup = tp
        self.output_size = output_size
        self.output_parts = parts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's rows of each part of the checkpoint's full weight (or bias) into ``param``."""
        what = type(self).__name__
        _check_full_size(loaded, 0, self.output_size, what)
        pieces, offset = [], 0
        for part in self.output_parts:
            start, length = self.tp.shard(part, "output features")
            pieces.append(loaded.narrow(0, offset + start, length))
            offset += part
        _copy_into(param, pieces[0] if len(pieces) == 1 else torch.cat(pieces), what)

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        return (self.output_size, *param.shape[1:])


class HeadParallelLinear(_Linear):
    """A projection to attention heads (q, k or v) whose heads are split across TP ranks.

    Why not `ColumnParallelLinear`: a grouped-query model may have fewer K/V heads than there are ranks; then each
    K/V head is held whole by ``size / heads`` consecutive ranks (replicated), so that every rank still has the K/V
    head its query heads read (``replicate``; query heads never do: each rank computes its own). ``what`` names
    the config field counting the heads, for the error of a count that fits no way.
    """

    def __init__(
        self, input_size: int, num_heads: int, head_dim: int, bias: bool, what: str, replicate: bool = False
    ) -> None:
        tp = tensor_parallel_group()
        self.head_start, self.local_heads = tp.head_shard(num_heads, what) if replicate else tp.shard(num_heads, what)
        super().__init__(input_size, self.local_heads * head_dim, bias=bias)
        self.tp: TensorParallelGroup = tp
        self.num_heads, self.head_dim = num_heads, head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy the rows of this rank's heads of the checkpoint's full weight (or bias) into ``param``."""
        what = type(self).__name__
        _check_full_size(loaded, 0, self.num_heads * self.head_dim, what)
        rows = loaded.narrow(0, self.head_start * self.head_dim, self.local_heads * self.head_dim)
        _copy_into(param, rows, what)

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        return (self.num_heads * self.head_dim, *param.shape[1:])


class RowParallelLinear(_Linear):
    """A projection whose input features are split across TP ranks (o, down): each rank multiplies its slice of
    the input by its columns of the weight, and the partial products are all-reduced; the bias is added once,
    after the sum."""

    # The rank group's peer-memory inboxes (`diffulex.layers.peer_exchange.attach_peer_exchange`), through which
    # `forward_unsummed` lets the next norm all-reduce the output; None: NCCL's all-reduce here.
    peer_exchange: PeerExchange | None = None

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = tensor_parallel_group()
        super().__init__(tp.shard(input_size, "input features")[1], output_size, bias=bias)
        self.tp: TensorParallelGroup = tp
        self.input_size = input_size

    def forward(self, x: torch.Tensor, readers: torch.Tensor | None = None) -> torch.Tensor:
        """The product of this rank's input slice, summed over the ranks; ``readers`` as in `linear`."""
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, readers=readers)
        y = self.tp.all_reduce(linear(x, self.weight, None, readers=readers))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's input columns of the checkpoint's full weight into ``param``; the bias whole."""
        what = type(self).__name__
        if param is self.bias:
            _copy_into(param, loaded, what)
            return
        _check_full_size(loaded, 1, self.input_size, what)
        start, length = self.tp.shard(self.input_size, "input features")
        _copy_into(param, loaded.narrow(1, start, length), what)

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        return tuple(param.shape) if param is self.bias else (param.shape[0], self.input_size)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the product, not yet summed over the ranks and without the bias: for a caller that
        adds several such shares (a mixture's experts) and all-reduces their sum once."""
        return linear(x, self.weight, None)

    def forward_unsummed(
        self, x: torch.Tensor, readers: torch.Tensor | None = None
    ) -> torch.Tensor | UnsummedProduct | PartialOverRanks:
        """The output, or where the skinny GEMM computes it in K splits, those splits unsummed (`UnsummedProduct`),
        or on a sharded layer with peer inboxes, this rank's partial before the all-reduce (`PartialOverRanks`).

        For callers that hand the result straight to `RMSNorm` (which sums them); a module with hooks (LoRA) or
        a bias always returns the tensor, so that hooks see the output and the bias is added once. ``readers`` as
        in `linear`.
        """
        plain = self.bias is None and not (self._forward_hooks or self._forward_pre_hooks)
        if self.tp.size > 1:
            if plain and self.peer_exchange is not None:
                return PartialOverRanks(linear(x, self.weight, None, readers=readers), self.peer_exchange, self.tp)
            return self(x, readers=readers)
        skinny = _skinny_for(x)
        if skinny is not None and plain:
            parts = skinny(x, self.weight, None, output="partials", readers=readers)
            if parts is not None:
                return UnsummedProduct(parts, x.dtype)
            if _captured_by_skinny(x, self.weight, None, "partials"):  # an eager call after the first: cuBLAS
                return nn.functional.linear(x, self.weight)
        return self(x, readers=readers)


def _load_vocab_slice(
    param: torch.Tensor, loaded: torch.Tensor, tp: TensorParallelGroup, vocab_size: int, what: str
) -> None:
    """Copy this rank's vocabulary rows of a full ``[vocab, hidden]`` tensor into ``param``; padding rows zero."""
    _check_full_size(loaded, 0, vocab_size, what)
    start, length, _ = tp.padded_shard(vocab_size)
    with torch.no_grad():
        param[length:].zero_()
    _copy_into(param[:length], loaded.narrow(0, start, length), what)


class VocabEmbedding(nn.Embedding):
    """The token embedding; under TP each rank holds a contiguous slice of the vocabulary (the same number of rows
    on every rank, the last ones zero padding where the vocabulary does not split evenly)."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        tp = tensor_parallel_group()
        start, length, padded = tp.padded_shard(num_embeddings)
        super().__init__(padded, embedding_dim)
        with torch.no_grad():
            self.weight[length:].zero_()
        self.tp: TensorParallelGroup = tp
        self.vocab_size = num_embeddings
        self.vocab_start = start
        self.vocab_length = length

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``input_ids`` (no padding index, no max norm: ``F.embedding``'s result). Indexing instead of
        ``F.embedding`` because on CUDA that takes ``index_select``'s kernel, which at decode sizes (a few rows)
        ran 4.4 us against the gather's 1.4 us on an H100. Decoders usually gather these rows together
        with their rotary angles instead (`diffulex.layers.token_inputs`); this runs where that cannot.
        Sharded, each rank looks up the ids of its slice, zeroes the others' rows, and the ranks sum."""
        if self.tp.size == 1:
            return self.weight[input_ids]
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < self.vocab_length)
        rows = self.weight[torch.where(inside, local, torch.zeros_like(local))]
        return self.tp.all_reduce(rows.masked_fill(~inside.unsqueeze(-1), 0.0))

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows of the checkpoint's full embedding into ``param``."""
        _load_vocab_slice(param, loaded, self.tp, self.vocab_size, type(self).__name__)

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        return (self.vocab_size, self.embedding_dim)


class LMHead(nn.Module):
    """Hidden states to vocabulary logits, ``x @ weight.T``.

    Holds its own ``weight`` (``[vocab, hidden]``) unless `tie_to` aliases it to the embedding's parameter, in
    which case both names refer to one tensor (no copy, one set of gradients, one load). Under TP each rank holds
    the embedding's slice of the vocabulary and the logits of the slices are gathered, so every rank gets all.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.tp: TensorParallelGroup = tensor_parallel_group()
        _, length, padded = self.tp.padded_shard(vocab_size)
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(padded, hidden_size))
        nn.init.normal_(self.weight, std=0.02)
        with torch.no_grad():
            self.weight[length:].zero_()

    def tie_to(self, embedding: nn.Embedding) -> None:
        """Share the embedding's weight (tied word embeddings)."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(
                f"cannot tie LM head {tuple(self.weight.shape)} to embedding {tuple(embedding.weight.shape)}"
            )
        self.weight = embedding.weight

    def forward(self, x: torch.Tensor, readers: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of every row of ``x``; with ``readers`` (device row indices, -1 for none) only the rows it
        names are promised, and when it names none the product may be skipped (`linear`)."""
        logits = linear(x, self.weight, readers=readers)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather(logits, dim=-1)[..., : self.vocab_size]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows of the checkpoint's full LM head into ``param``."""
        _load_vocab_slice(param, loaded, self.tp, self.vocab_size, type(self).__name__)

    def checkpoint_shape(self, param: nn.Parameter) -> tuple[int, ...]:
        return (self.vocab_size, self.hidden_size)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}"


class JoinedWeights:
    """Weights a checkpoint stores as separate matrices, joined after loading so that one launch reads them all;
    `merge_projections` calls `merge` on every instance a module holds."""

    def merge(self) -> bool:
        """Join the weights; returns False (and they stay separate) where that would change the result."""
        raise NotImplementedError


class MergedProjection(JoinedWeights):
    """Projections of the same input (q/k/v, gate/up) computed by one GEMM once `merge` has joined them.

    Checkpoints store these matrices separately and the loader and LoRA address them by those names, so the
    modules stay separate. After loading, `merge` copies their weights into one matrix and turns each module's
    weight into a view of its rows (same names, same memory), so one launch reads all of them: at decode batch
    sizes a projection is a weight-streaming kernel, and three small launches cost more than one large one.
    Projections with forward hooks (LoRA applied per forward) are left separate, since the hooks must see each
    module's own output. Not an ``nn.Module``: it owns nothing the state dict should see.
    """

    def __init__(self, *linears: nn.Linear, release_early: bool = False) -> None:
        self.linears = linears
        # q/k/v: what follows is latency-bound and streams no weights, so the merged launch lets it start early
        # (`diffulex.kernels.skinny_gemm.maybe_skinny_linear`)
        self.release_early = release_early
        self.sizes = [linear.out_features for linear in linears]
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def merge(self) -> bool:
        """Join the weights; returns False (and stays separate) where that would change the result."""
        linears = self.linears
        if any(m._forward_hooks or m._forward_pre_hooks for m in linears):
            return False
        if any(m.weight.is_meta for m in linears) or len({(m.weight.device, m.weight.dtype) for m in linears}) > 1:
            return False
        has_bias = [m.bias is not None for m in linears]
        if any(has_bias) and not all(has_bias):
            return False
        self.weight = _join([m.weight for m in linears])
        self.bias = _join([m.bias for m in linears]) if all(has_bias) else None
        return True

    def __call__(self, x: torch.Tensor, readers: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        if self.weight is None:
            return tuple(m(x) if readers is None else m(x, readers=readers) for m in self.linears)
        return linear(x, self.weight, self.bias, self.release_early, readers).split(self.sizes, dim=-1)

    def silu_mul(self, x: torch.Tensor, readers: torch.Tensor | None = None) -> torch.Tensor:
        """``silu(gate(x)) * up(x)`` of a gate/up pair: one skinny-GEMM launch with the activation in its epilogue
        where that applies (merged into two equal halves, a decode-sized CUDA input whose shape the table takes
        without splitting K: `diffulex.kernels.skinny_gemm.maybe_skinny_linear`), else the projection, then one
        activation launch over its two halves in place (`diffulex.layers.activation.silu_and_mul`); both ways give
        the same bits. ``readers`` as in `linear`."""
        if self.weight is not None and len(self.sizes) == 2 and self.sizes[0] == self.sizes[1]:
            skinny = _skinny_for(x)
            act = skinny(x, self.weight, self.bias, output="silu_mul", readers=readers) if skinny is not None else None
            if act is not None:
                return act
            if skinny is not None and _captured_by_skinny(x, self.weight, self.bias, "silu_mul"):  # after the first
                return silu_and_mul(*nn.functional.linear(x, self.weight, self.bias).split(self.sizes, dim=-1))
        return silu_and_mul(*self(x, readers))


def _join(params: list[torch.Tensor]) -> torch.Tensor:
    """One tensor holding ``params`` along dim 0; each parameter becomes a view of its slice."""
    joined = torch.cat([p.data for p in params], dim=0)
    offset = 0
    for p in params:
        rows = p.shape[0]
        p.data = joined[offset : offset + rows]
        offset += rows
    return joined


def merge_projections(model: nn.Module) -> int:
    """Merge every `JoinedWeights` (`MergedProjection`, `diffulex.layers.moe.ExpertStack`) a module of ``model``
    holds; returns how many were merged."""
    merged = 0
    for module in model.modules():
        for value in vars(module).values():
            if isinstance(value, JoinedWeights):
                merged += value.merge()
    return merged

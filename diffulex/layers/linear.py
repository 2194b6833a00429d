"""Every weight matrix of a model: projections, the token embedding and the LM head.

They all live here because these are exactly the layers tensor parallelism will shard (column-parallel
projections split their output rows, row-parallel ones their input columns and all-reduce, the vocabulary
is split across ranks). Today only TP=1 exists, so each class is a plain ``nn.Linear``/``nn.Embedding``
whose name records how it will be sharded; models already use the right class, so adding TP changes this
file only.
Parameter names stay ``weight``/``bias`` so checkpoint keys map one to one.

Every product goes through `linear`: ``F.linear`` (cuBLAS), or on CUDA at decode row counts the Triton skinny
GEMM (`diffulex.kernels.skinny_gemm`), which streams the weights faster than cuBLAS's small-M tiles.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from diffulex.layers.dispatch import triton_available

# The most rows the skinny GEMM takes (`diffulex.kernels.skinny_gemm.MAX_ROWS`, repeated here so that larger
# inputs skip importing it): decode steps of a few requests.
SKINNY_MAX_ROWS = 16


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
    unwritten): see `diffulex.kernels.skinny_gemm.maybe_skinny_linear`."""
    skinny = _skinny_for(x)
    y = skinny(x, weight, bias, release_early=release_early, readers=readers) if skinny is not None else None
    return y if y is not None else nn.functional.linear(x, weight, bias)


class _Linear(nn.Linear):
    """``nn.Linear`` whose product goes through `linear`; forward hooks (LoRA) wrap this forward as before."""

    def forward(self, x: torch.Tensor, readers: torch.Tensor | None = None) -> torch.Tensor:
        """The product; with ``readers`` (device row indices, -1 for none) only the rows it names are promised
        (`linear`)."""
        return linear(x, self.weight, self.bias, readers=readers)


class ReplicatedLinear(_Linear):
    """A projection every rank holds whole (small layers such as MoE routers)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)


class ColumnParallelLinear(_Linear):
    """A projection whose output features will be split across TP ranks (q/k/v, gate/up)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)


class RowParallelLinear(_Linear):
    """A projection whose input features will be split across TP ranks, then all-reduced (o, down)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)

    def forward_unsummed(
        self, x: torch.Tensor, readers: torch.Tensor | None = None
    ) -> torch.Tensor | UnsummedProduct:
        """The output, or where the skinny GEMM computes it in K splits, those splits unsummed (`UnsummedProduct`).

        For callers that hand the result straight to `RMSNorm` (which sums them); a module with hooks (LoRA) or
        a bias always returns the tensor, so that hooks see the output and the bias is added once. ``readers``
        as in `linear`.
        """
        skinny = _skinny_for(x)
        if skinny is not None and self.bias is None and not (self._forward_hooks or self._forward_pre_hooks):
            parts = skinny(x, self.weight, None, output="partials", readers=readers)
            if parts is not None:
                return UnsummedProduct(parts, x.dtype)
        return self(x, readers=readers)


class VocabEmbedding(nn.Embedding):
    """The token embedding; TP will give each rank a contiguous slice of the vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The rows of ``input_ids`` (no padding index, no max norm: ``F.embedding``'s result). Indexing instead of
        ``F.embedding`` because on CUDA that takes ``index_select``'s kernel, which at decode sizes (a few rows)
        ran 4.4 us against the gather's 1.4 us on an H100. Decoders usually gather these rows together
        with their rotary angles instead (`diffulex.layers.token_inputs`); this runs where that cannot."""
        return self.weight[input_ids]


class LMHead(nn.Module):
    """Hidden states to vocabulary logits, ``x @ weight.T``.

    Holds its own ``weight`` (``[vocab, hidden]``) unless `tie_to` aliases it to the embedding's parameter, in
    which case both names refer to one tensor (no copy, one set of gradients, one load).
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        nn.init.normal_(self.weight, std=0.02)

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
        return linear(x, self.weight, readers=readers)

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

    def silu_mul(self, x: torch.Tensor, readers: torch.Tensor | None = None) -> torch.Tensor | None:
        """``silu(gate(x)) * up(x)`` of a merged gate/up pair in one skinny-GEMM launch (the activation in its
        epilogue), or None where that launch does not apply: unmerged, not two equal halves, or not a decode-sized
        CUDA input (`diffulex.kernels.skinny_gemm.maybe_skinny_linear`). The caller then runs the projection and
        the activation separately; both ways give the same bits. ``readers`` as in `linear`."""
        if self.weight is None or len(self.sizes) != 2 or self.sizes[0] != self.sizes[1]:
            return None
        skinny = _skinny_for(x)
        return skinny(x, self.weight, self.bias, output="silu_mul", readers=readers) if skinny is not None else None


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

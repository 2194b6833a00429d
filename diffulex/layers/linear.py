"""Every weight matrix of a model: projections, the token embedding and the LM head.

They all live here because these are exactly the layers tensor parallelism will shard (column-parallel
projections split their output rows, row-parallel ones their input columns and all-reduce, the vocabulary
is split across ranks). Today only TP=1 exists, so each class is a plain ``nn.Linear``/``nn.Embedding``
whose name records how it will be sharded; models already use the right class, so adding TP changes this
file only.
Parameter names stay ``weight``/``bias`` so checkpoint keys map one to one.
"""

from __future__ import annotations

import torch
from torch import nn


class ReplicatedLinear(nn.Linear):
    """A projection every rank holds whole (small layers such as MoE routers)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)


class ColumnParallelLinear(nn.Linear):
    """A projection whose output features will be split across TP ranks (q/k/v, gate/up)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)


class RowParallelLinear(nn.Linear):
    """A projection whose input features will be split across TP ranks, then all-reduced (o, down)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias=bias)


class VocabEmbedding(nn.Embedding):
    """The token embedding; TP will give each rank a contiguous slice of the vocabulary."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__(num_embeddings, embedding_dim)


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, vocab_size={self.vocab_size}"

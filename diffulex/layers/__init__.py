"""Building blocks shared by the model families: norms, rotary embedding, activations, weight matrices."""

from diffulex.layers.activation import SiluAndMul
from diffulex.layers.linear import (
    ColumnParallelLinear,
    HeadParallelLinear,
    LMHead,
    MergedProjection,
    PartialOverRanks,
    ReplicatedLinear,
    RowParallelLinear,
    UnsummedProduct,
    VocabEmbedding,
    merge_projections,
)
from diffulex.layers.norm import RMSNorm
from diffulex.layers.rotary import RotaryEmbedding, apply_rotary, check_rope_scaling

__all__ = [
    "ColumnParallelLinear",
    "HeadParallelLinear",
    "LMHead",
    "MergedProjection",
    "RMSNorm",
    "ReplicatedLinear",
    "RotaryEmbedding",
    "RowParallelLinear",
    "SiluAndMul",
    "PartialOverRanks",
    "UnsummedProduct",
    "VocabEmbedding",
    "apply_rotary",
    "check_rope_scaling",
    "merge_projections",
]

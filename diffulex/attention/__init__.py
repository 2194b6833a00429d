"""Attention: per-step metadata, the block-diffusion visibility rule, and the backends that apply it."""

from diffulex.attention.layer import Attention
from diffulex.attention.mask import visibility_mask
from diffulex.attention.metadata import AttentionMetadata, DenseAttentionMetadata, PagedAttentionMetadata

__all__ = ["Attention", "AttentionMetadata", "DenseAttentionMetadata", "PagedAttentionMetadata", "visibility_mask"]

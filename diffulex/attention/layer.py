"""The attention module every model layer owns: stores new K/V into its cache slice, then attends."""

from __future__ import annotations

import torch
from torch import nn

from diffulex.attention.metadata import AttentionMetadata, DenseAttentionMetadata, PagedAttentionMetadata
from diffulex.attention.torch_paged import dense_attention, paged_attention, store_kv


class Attention(nn.Module):
    """Paged attention for one layer.

    The model runner binds ``k_cache``/``v_cache`` (``[num_pages, page_size, kv_heads, head_dim]``) after it sizes
    the page pool; the module owns no other state. Inputs are flat over the batch: q ``[T, heads, head_dim]``,
    k/v ``[T, kv_heads, head_dim]``; the output is ``[T, heads * head_dim]``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # Backend, set by the model runner from ``attn_impl`` when it binds the cache. The Triton kernels run
        # on CUDA tensors; elsewhere (CPU, tests) the PyTorch path is used.
        self.attn_impl = "naive"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if isinstance(meta, DenseAttentionMetadata):
            out = dense_attention(q, k, v, meta, self.scale)
        else:
            out = self.paged_forward(q, k, v, meta)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def paged_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        """Store this step's committed K/V, then attend over cache and new rows."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("the KV cache is not bound to this attention layer")
        if self.attn_impl in ("triton", "triton_grouped") and q.is_cuda:
            from diffulex.kernels.attention_op import store_and_attend

            grouped = self.attn_impl == "triton_grouped"
            return store_and_attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale, grouped)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)

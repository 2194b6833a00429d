"""The attention module every model layer owns: position encoding of q/k, the write of new K/V into its cache
slice, then attention.

Rotary (and Qwen3's per-head q/k norm) belongs here rather than in the model because on the paged Triton path the
kernel that rotates k is also the one that writes it to the cache: one launch instead of a rotary launch and a
store launch on every layer of every step, which at decode batch sizes is latency, not bandwidth. Everywhere else
the layer runs `rotate_qk` and then the separate store and attention; both orders give the same bits.
"""

from __future__ import annotations

import torch
from torch import nn

from diffulex.attention.metadata import AttentionMetadata, DenseAttentionMetadata, PagedAttentionMetadata
from diffulex.attention.torch_paged import dense_attention, paged_attention, store_kv
from diffulex.layers.norm import RMSNorm
from diffulex.layers.rotary import fused_rope_args, rotate_qk

TRITON_IMPLS = ("triton", "triton_grouped")


def kernels_run_on(q: torch.Tensor) -> bool:
    """The Triton kernels run on CUDA tensors (tests under the Triton interpreter make CPU tensors qualify)."""
    return q.is_cuda


def triton_supports_head_dim(head_dim: int) -> bool:
    """The Triton attention kernels tile a head in one power-of-two block of at least 16 lanes."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


class Attention(nn.Module):
    """Paged attention for one layer.

    The model runner binds ``k_cache``/``v_cache`` (``[num_pages, page_size, kv_heads, head_dim]``) after it sizes
    the page pool; the module owns no other state (the norms it may be handed stay the model's parameters, under
    their checkpoint names). Inputs are flat over the batch: q ``[T, heads, head_dim]``, k/v
    ``[T, kv_heads, head_dim]``; the output is ``[T, heads * head_dim]``.
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

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
    ) -> torch.Tensor:
        """Attend with q/k as given or, with ``rope = (cos, sin)``, with q/k first normalized per head (when the
        norms are given, both or neither) and rotated, as `rotate_qk` does; the cache receives the rotated k."""
        if rope is None:
            if q_norm is not None or k_norm is not None:
                raise ValueError("q_norm/k_norm run together with the rotary embedding: pass rope as well")
        else:
            out = self._fused_paged_forward(q, k, v, meta, rope, q_norm, k_norm)
            if out is not None:
                return out.reshape(q.shape[0], self.num_heads * self.head_dim)
            q, k = rotate_qk(q, k, rope[0], rope[1], q_norm, k_norm)
        if isinstance(meta, DenseAttentionMetadata):
            out = dense_attention(q, k, v, meta, self.scale)
        else:
            out = self.paged_forward(q, k, v, meta)
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)

    def _fused_paged_forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        rope: tuple[torch.Tensor, torch.Tensor],
        q_norm: RMSNorm | None,
        k_norm: RMSNorm | None,
    ) -> torch.Tensor | None:
        """Rotary + cache write in one launch, then attention; None where the layer must take the unfused path.

        That is: dense metadata, the torch backend, off CUDA, while ``torch.compile`` traces (the compiled graph
        keeps attention in its custom op, and `fused_rope_args` hands rotary to inductor), hooked norms, and
        layouts the kernel does not cover (the unfused path then raises or handles them as before).
        """
        if not isinstance(meta, PagedAttentionMetadata) or not self._triton_backend(q, meta):
            return None
        k_cache, v_cache = self.k_cache, self.v_cache
        if k_cache is None or v_cache is None or torch.compiler.is_compiling():
            return None
        cos, sin = rope
        args = fused_rope_args(q, k, cos, sin, q_norm, k_norm)
        if args is None:
            return None
        from diffulex.kernels.attention_op import rope_store_and_attend
        from diffulex.kernels.kv_store import kv_store_mismatch

        if kv_store_mismatch(k, v, k_cache, v_cache, meta.slot_mapping) is not None:
            return None

        grouped = self.attn_impl == "triton_grouped"
        return rope_store_and_attend(q, k, v, cos, sin, *args, k_cache, v_cache, meta, self.scale, grouped)

    def _triton_backend(self, q: torch.Tensor, meta: PagedAttentionMetadata) -> bool:
        """Whether paged steps run the Triton kernels: the configured backend, on CUDA tensors. A step whose keys go
        on past a request's rows reaches the kernels through the device copy of its key ends
        (`PagedAttentionMetadata.key_lens`); with the host copy alone it takes the PyTorch path."""
        tails_readable = meta.key_lens_cpu is None or meta.key_lens is not None
        return self.attn_impl in TRITON_IMPLS and kernels_run_on(q) and tails_readable

    def paged_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        """Store this step's committed K/V (q/k already rotated), then attend over cache and new rows."""
        if self.k_cache is None or self.v_cache is None:
            raise RuntimeError("the KV cache is not bound to this attention layer")
        if self._triton_backend(q, meta):
            from diffulex.kernels.attention_op import store_and_attend

            grouped = self.attn_impl == "triton_grouped"
            return store_and_attend(q, k, v, self.k_cache, self.v_cache, meta, self.scale, grouped)
        store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return paged_attention(q, k, v, self.k_cache, self.v_cache, meta, self.scale)

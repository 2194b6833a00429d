"""Triton kernels for the engine's hot path, each checked against its PyTorch reference in `diffulex.attention`.

Importing this package requires ``triton``; the engine imports it only when it selects a Triton backend.
"""

from diffulex.kernels.kv_store import triton_store_kv
from diffulex.kernels.paged_attention import triton_paged_attention

__all__ = ["triton_paged_attention", "triton_store_kv"]

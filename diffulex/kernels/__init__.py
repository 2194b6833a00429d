"""Triton kernels for the engine's hot path, each checked against its PyTorch reference: attention against
`diffulex.attention`, the sampler's top-1 against `diffulex.sampler.token_sampling.greedy`.

Importing this package requires ``triton``; the engine imports it only when it selects a Triton backend, and
the sampler only when its logits are on CUDA.
"""

from diffulex.kernels.kv_store import triton_store_kv
from diffulex.kernels.paged_attention import triton_paged_attention
from diffulex.kernels.top1 import triton_top1

__all__ = ["triton_paged_attention", "triton_store_kv", "triton_top1"]

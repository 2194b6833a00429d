"""What one forward needs to know to run attention: who owns each query row, what each row may see.

Two kinds of metadata exist:

* `PagedAttentionMetadata` is built by the model runner once per engine step. The batch is a flat stream of
  query rows from several requests; each request contributes one contiguous chunk of new tokens at absolute
  positions ``[context_len, context_len + query_len)``, whose first ``context_len`` positions already have K/V in
  the paged cache. A request may also attend to cached keys after its rows (``key_lens``): a refinement of a
  few rows inside a block whose K/V the cache already holds (Fast-dLLM v2's block cache).
* `DenseAttentionMetadata` carries an explicit boolean mask over one whole sequence with no cache. Only the
  naive reference decoder uses it; it is the oracle the paged path is tested against.

The visibility rule itself lives in `diffulex.attention.mask` so that both paths share one definition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedAttentionMetadata:
    """Per-step attention inputs for a ragged batch of requests over the paged KV cache.

    All tensors live on the model's device. ``R`` is the number of requests, ``T`` the number of query rows.
    """

    cu_seqlens_q: torch.Tensor  # [R + 1] int32, query row offsets per request
    context_lens: torch.Tensor  # [R] int32, tokens of each request already in the KV cache
    prefix_lens: torch.Tensor  # [R] int32, prompt length of each request (used by prefix-full masks)
    page_tables: torch.Tensor  # [R, max_pages] int32, physical page of each logical page, -1 if none
    slot_mapping: torch.Tensor  # [T] int64, cache slot to store each row's K/V into, -1 = do not store
    block_size: int  # diffusion block size: the mask granularity
    page_size: int
    prefix_full: bool  # d2f: prompt tokens attend bidirectionally to the whole prompt
    # Host copies of the ragged layout, so the PyTorch path can loop without device syncs.
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    # Per request, the end of the keys it attends to when that lies past its rows: keys ``[0, context_len)`` and
    # ``[context_len + query_len, key_len)`` come from the cache, the rows' own from this step. None: every
    # request's keys end with its rows. The PyTorch path reads this host copy, the Triton kernels `key_lens`.
    key_lens_cpu: list[int] | None = None
    # Launch-shape bounds for the kernels: the longest query chunk and the longest key range of any request.
    # Derived from the host lists when left at 0; a CUDA graph fixes them to its bucket's capacity instead, so
    # one captured launch serves every batch that fits.
    max_query_len: int = 0
    max_kv_len: int = 0
    # [R] int32 on the device: the same key ends for the kernels (a value at or below ``context_len + query_len``
    # means none past the rows). None: no request attends past its rows, and the kernels compile no tail loop.
    key_lens: torch.Tensor | None = None
    # The launch's split-KV settings (`triton_paged_attention`'s ``num_splits`` and ``min_split_keys``) where the
    # step's shape decides them rather than the grid: a CUDA graph whose grid fills the GPU but whose one long
    # request (a prompt chunk beside decoders) must fold its long context in parallel. None: the kernel's choice.
    num_splits: int | None = None
    min_split_keys: int | None = None

    def __post_init__(self) -> None:
        if self.max_query_len <= 0:
            self.max_query_len = max(self.query_lens_cpu, default=0)
        if self.max_kv_len <= 0:
            self.max_kv_len = max(
                (c + n for c, n in zip(self.context_lens_cpu, self.query_lens_cpu, strict=True)), default=0
            )
            if self.key_lens_cpu is not None:
                self.max_kv_len = max(self.max_kv_len, *self.key_lens_cpu)

    @property
    def num_requests(self) -> int:
        return len(self.query_lens_cpu)


@dataclass
class DenseAttentionMetadata:
    """One sequence, no cache: ``allowed[i, j]`` says whether query row ``i`` may attend to key row ``j``.

    A reference decoder can also model a cache that holds K/V computed from an earlier state of the sequence
    (Fast-dLLM v2's block cache) without a cache: with ``recorded_kv`` a list, every attention call of the forward
    appends its (K, V); with ``stale_kv`` (one such list from an earlier forward) the rows of ``stale_rows`` use
    that K/V instead of the one computed now, call by call. Attention calls happen in layer order, so the i-th
    call of a forward meets the i-th entry.
    """

    allowed: torch.Tensor  # [T, T] bool
    recorded_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    stale_kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    stale_rows: torch.Tensor | None = None  # [T] bool
    _calls: int = 0

    def exchange_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V this attention call attends to: the stale rows swapped in, then recorded if asked."""
        if self.stale_kv is not None:
            old_k, old_v = self.stale_kv[self._calls]
            rows = self.stale_rows.to(k.device).view(-1, *([1] * (k.dim() - 1)))
            k, v = torch.where(rows, old_k, k), torch.where(rows, old_v, v)
        self._calls += 1
        if self.recorded_kv is not None:
            self.recorded_kv.append((k, v))
        return k, v


AttentionMetadata = PagedAttentionMetadata | DenseAttentionMetadata

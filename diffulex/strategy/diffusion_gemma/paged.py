"""DiffusionGemma's attention over the paged encoder K/V: what the encoder and the decoder rows of one step see,
stated as paged-attention metadata, and the per-layer call the model's row path makes (`LayerAttention`).

* Encoder pieces are causal (block size 1): a row at position ``p`` sees the cached keys and the piece's keys up
  to ``p``; a sliding layer only ``(p - window, p]`` (the window anchored at the row). Every layer stores the
  piece's K/V in the request's pages first (sliding layers too: a later request that shares the prefix reads the
  window before its own start).
* Canvas rows are bidirectional over the context and the canvas: the canvas is a prefix-full "prompt" that ends
  where the canvas ends, so every row sees every key below ``context + canvas_length``; a sliding layer sees only
  the last ``window - 1`` cached positions (the window anchored at the context length) and the whole canvas.
  Nothing is stored: a canvas's K/V is encoded once it is finished.

On CUDA with Triton installed the kernel (`diffulex.kernels.paged_attention`) reads the pages in place; otherwise
the PyTorch path (`diffulex.attention.torch_paged`) gathers them. The attention scale is 1 (the q/k norms set it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffulex.attention.metadata import PagedAttentionMetadata
from diffulex.attention.torch_paged import paged_attention, store_kv
from diffulex.layers import dispatch

ENCODER_BLOCK_SIZE = 1  # causal: each position its own block


def triton_available(device: torch.device) -> bool:
    """Whether the Triton kernel can run here: a CUDA device and an installed triton."""
    return device.type == "cuda" and dispatch.triton_available()


def page_table_tensor(tables: Sequence[Sequence[int]], width: int, device: torch.device) -> torch.Tensor:
    """``[len(tables), width]`` int32, each request's pages then -1."""
    out = torch.full((len(tables), max(width, 1)), -1, dtype=torch.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return out.to(device)


def encoder_metadata(
    pieces: Sequence[tuple[int, int]], tables: Sequence[Sequence[int]], page_size: int, device: torch.device
) -> PagedAttentionMetadata:
    """Metadata of one encoder round: request ``r`` encodes positions ``pieces[r] = (lo, hi)``, storing their K/V
    in its pages ``tables[r]``."""
    lengths = [hi - lo for lo, hi in pieces]
    slots = []
    for (lo, hi), table in zip(pieces, tables, strict=True):
        slots.extend(table[p // page_size] * page_size + p % page_size for p in range(lo, hi))
    return PagedAttentionMetadata(
        cu_seqlens_q=torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device),
        context_lens=torch.tensor([lo for lo, _ in pieces], dtype=torch.int32, device=device),
        prefix_lens=torch.zeros(len(pieces), dtype=torch.int32, device=device),
        page_tables=page_table_tensor(tables, max(len(t) for t in tables), device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=ENCODER_BLOCK_SIZE,
        page_size=page_size,
        prefix_full=False,
        query_lens_cpu=lengths,
        context_lens_cpu=[lo for lo, _ in pieces],
        prefix_lens_cpu=[0] * len(pieces),
    )


@dataclass
class CanvasLayout:
    """The decoder rows of one step as tensors the metadata points at: ``B`` canvases of ``C`` rows, canvas ``b``
    after ``context_lens[b]`` cached positions read through ``page_tables[b]``. A CUDA graph keeps one per
    bucket and refills it in place (`fill`), so its captured launches read the new values."""

    canvas_length: int
    cu_seqlens_q: torch.Tensor  # [B + 1] int32: b * C
    context_lens: torch.Tensor  # [B] int32
    prefix_lens: torch.Tensor  # [B] int32: context + C (where the bidirectional span ends)
    page_tables: torch.Tensor  # [B, width] int32
    positions: torch.Tensor  # [B * C] int64: each row's absolute position
    contexts_cpu: list[int]

    @classmethod
    def empty(cls, batch: int, canvas_length: int, width: int, device: torch.device) -> CanvasLayout:
        """A layout of ``batch`` canvases with no context (a bucket's padding rows look like this)."""
        offsets = torch.arange(canvas_length, device=device)
        return cls(
            canvas_length,
            torch.arange(0, (batch + 1) * canvas_length, canvas_length, dtype=torch.int32, device=device),
            torch.zeros(batch, dtype=torch.int32, device=device),
            torch.full((batch,), canvas_length, dtype=torch.int32, device=device),
            torch.full((batch, max(width, 1)), -1, dtype=torch.int32, device=device),
            offsets.repeat(batch),
            [0] * batch,
        )

    def fill(self, contexts: Sequence[int], tables: Sequence[Sequence[int]]) -> None:
        """The first ``len(contexts)`` canvases take these contexts and pages; the rest become padding (no
        context: they attend to their own rows only, and nobody reads their output)."""
        batch, width, C = self.context_lens.shape[0], self.page_tables.shape[1], self.canvas_length
        lens = list(contexts) + [0] * (batch - len(contexts))
        device = self.context_lens.device
        ctx = torch.tensor(lens, dtype=torch.int32)
        self.context_lens.copy_(ctx.to(device))
        self.prefix_lens.copy_((ctx + C).to(device))
        self.page_tables.copy_(page_table_tensor([*tables, *[[]] * (batch - len(tables))], width, torch.device("cpu"))
                               .to(device))  # fmt: skip
        self.positions.copy_((ctx[:, None].long() + torch.arange(C)[None, :]).reshape(-1).to(device))
        self.contexts_cpu = lens

    def metadata(self, page_size: int, max_kv_len: int = 0) -> PagedAttentionMetadata:
        batch, C = len(self.contexts_cpu), self.canvas_length
        return PagedAttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q,
            context_lens=self.context_lens,
            prefix_lens=self.prefix_lens,
            page_tables=self.page_tables,
            slot_mapping=self.positions.new_full((0,), -1),  # the decoder stores nothing
            block_size=C,
            page_size=page_size,
            prefix_full=True,
            query_lens_cpu=[C] * batch,
            context_lens_cpu=list(self.contexts_cpu),
            prefix_lens_cpu=[c + C for c in self.contexts_cpu],
            max_query_len=C,
            max_kv_len=max_kv_len,
        )


@dataclass
class CachedAttention:
    """`diffulex.models.diffusion_gemma.LayerAttention` over the runner's page pool, for one forward."""

    k_cache: Sequence[torch.Tensor]  # per layer [num_pages, page_size, kv_heads, head_dim]
    v_cache: Sequence[torch.Tensor]
    windows: Sequence[int]  # per layer: the sliding window, 0 for full-attention layers
    meta: PagedAttentionMetadata
    stores: bool  # the encoder writes its rows' K/V; the decoder writes nothing
    use_triton: bool
    # the kernel's split-KV factor; None: its own choice from the launch (which depends on the batch and bounds)
    num_splits: int | None = None

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, needs_output: bool
    ) -> torch.Tensor | None:
        k_cache, v_cache = self.k_cache[layer], self.v_cache[layer]
        if self.stores:
            store_kv(k, v, k_cache, v_cache, self.meta.slot_mapping)
        if not needs_output:
            return None
        window, from_context = self.windows[layer], not self.stores
        if self.use_triton:
            from diffulex.kernels.paged_attention import triton_paged_attention

            return triton_paged_attention(
                q, k, v, k_cache, v_cache, self.meta, 1.0, num_splits=self.num_splits, window=window,
                window_from_context=from_context,
            )
        return paged_attention(q, k, v, k_cache, v_cache, self.meta, 1.0, window=window,
                               window_from_context=from_context)  # fmt: skip

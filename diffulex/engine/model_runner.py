"""Turns a batch of requests into one forward: flat inputs, attention metadata, logits, sampled writes.

The runner owns the model, the KV cache tensors and the sampler. For every request it computes the query
range chosen by the request (uncached committed blocks, then the running set), asks the cache to store the K/V
of committed blocks, and runs the LM head only on the rows the sampler needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from diffulex.attention import Attention, PagedAttentionMetadata
from diffulex.engine.block import BlockStatus
from diffulex.engine.request import Request, SampleTarget


@dataclass
class RunnerSettings:
    block_size: int
    page_size: int
    prefix_full: bool  # d2f: prompt rows attend to the whole prompt
    device: torch.device
    kv_dtype: torch.dtype
    attn_impl: str = "naive"  # "triton"/"triton_grouped" use the Triton kernels on CUDA


class ModelRunner:
    def __init__(self, settings: RunnerSettings, model: nn.Module, sampler) -> None:
        self.settings = settings
        self.model = model
        self.sampler = sampler
        self.attention_layers = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.attention_layers:
            raise ValueError(f"{type(model).__name__} has no Attention layers to bind a KV cache to")
        self.num_pages = 0

    # ----- KV cache ---------------------------------------------------------------------------------------

    def page_bytes(self) -> int:
        """Bytes one page takes across all layers (K and V)."""
        itemsize = torch.empty((), dtype=self.settings.kv_dtype).element_size()
        per_layer = sum(2 * a.num_kv_heads * a.head_dim for a in self.attention_layers)
        return per_layer * self.settings.page_size * itemsize

    def allocate_kv_cache(self, num_pages: int) -> None:
        s = self.settings
        for layer in self.attention_layers:
            shape = (num_pages, s.page_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=s.kv_dtype, device=s.device)
            layer.v_cache = torch.zeros(shape, dtype=s.kv_dtype, device=s.device)
            layer.attn_impl = s.attn_impl
        self.num_pages = num_pages

    # ----- one step ---------------------------------------------------------------------------------------

    @torch.inference_mode()
    def run(self, batch: list[Request]) -> dict[int, list[tuple[int, int]]]:
        """Forward the batch and sample; returns the accepted ``(position, token)`` writes per request id."""
        inputs, meta, rows, work = self._prepare(batch)
        input_ids, positions = inputs
        hidden = self.model(input_ids, positions, meta)
        if not rows:
            return {req.req_id: [] for req in batch}
        row_index = torch.tensor(rows, dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, row_index))
        writes = self.sampler(logits, work)
        for req in batch:
            writes.setdefault(req.req_id, [])
        return writes

    def _prepare(
        self, batch: list[Request]
    ) -> tuple[
        tuple[torch.Tensor, torch.Tensor],
        PagedAttentionMetadata,
        list[int],
        list[tuple[Request, list[SampleTarget]]],
    ]:
        s = self.settings
        size, page = s.block_size, s.page_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        rows: list[int] = []
        work: list[tuple[Request, list[SampleTarget]]] = []
        query_lens, context_lens, prefix_lens, cu = [], [], [], [0]
        for req in batch:
            start, end = req.query_range()
            offset = len(ids)
            ids.extend(req.token_ids[start:end])
            positions.extend(range(start, end))
            for block in req.blocks[start // size : -(-end // size)]:
                lo, hi = max(start, block.start), min(end, block.end)
                if block.status is BlockStatus.TO_CACHE:
                    base = req.page_table[lo // page] * page + lo % page
                    slots.extend(range(base, base + hi - lo))
                else:
                    slots.extend([-1] * (hi - lo))
            targets = req.sample_targets()
            shift = 1 if req.settings.logits_shift else 0
            for target in targets:
                rows.extend(offset + p - shift - start for p in target.positions)
            work.append((req, targets))
            query_lens.append(end - start)
            context_lens.append(start)
            prefix_lens.append(req.prompt_len)
            cu.append(len(ids))

        max_pages = max((len(r.page_table) for r in batch), default=0)
        table = [r.page_table + [-1] * (max_pages - len(r.page_table)) for r in batch]
        dev = s.device

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        meta = PagedAttentionMetadata(
            cu_seqlens_q=tensor(cu, torch.int32),
            context_lens=tensor(context_lens, torch.int32),
            prefix_lens=tensor(prefix_lens, torch.int32),
            page_tables=tensor(table, torch.int32).view(len(batch), max_pages),
            slot_mapping=tensor(slots, torch.long),
            block_size=size,
            page_size=page,
            prefix_full=s.prefix_full,
            query_lens_cpu=query_lens,
            context_lens_cpu=context_lens,
            prefix_lens_cpu=prefix_lens,
        )
        return (tensor(ids, torch.long), tensor(positions, torch.long)), meta, rows, work

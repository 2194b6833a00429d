"""DMax's soft inputs as static inputs of the decode graphs (`diffulex.engine.cuda_graph`).

An eager step hands the forward the rows that have candidates (`diffulex.layers.token_merge.TokenMerge`). A graph
cannot take a list whose length changes, so here every row of the padded step has a fixed-size record: its
candidate ids, their probabilities, the mask's residual and a flag saying whether the row is soft at all. The
forward merges every row and keeps the merge where the flag is set (`StaticTokenMerge`).

The records are row-major, so a bucket of ``n`` rows uses the first ``n`` records: one contiguous copy per step,
staged in a pinned host buffer (one per micro-batch, like the other step inputs) and copied with them.
"""

from __future__ import annotations

import numpy as np
import torch

from diffulex.layers.token_merge import SoftInput, StaticTokenMerge, TokenMergeSettings

INT_BYTES = 8  # ids and the soft flag (int64: the embedding gather's index type)
FLOAT_BYTES = 4  # probabilities and residual (float32: the merge's precision)


class StaticSoftInputs:
    """Per row ``[ids (K) | soft flag]`` as int64 then ``[probs (K) | residual]`` as float32, one record per row of
    the largest bucket; host staging buffers and their device mirror."""

    def __init__(
        self, settings: TokenMergeSettings, max_rows: int, device: torch.device, staging_buffers: int
    ) -> None:
        self.settings = settings
        k = self.width = settings.width
        self.max_rows = max_rows
        int_part, float_part = INT_BYTES * (k + 1), FLOAT_BYTES * (k + 1)
        # a record's length keeps every int64 field 8-byte aligned from one record to the next
        self._record = -(-(int_part + float_part) // INT_BYTES) * INT_BYTES
        total = max_rows * self._record
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(total, dtype=torch.uint8, pin_memory=pin) for _ in range(staging_buffers)]
        self._device = torch.zeros(total, dtype=torch.uint8, device=device)
        host_records = [h.numpy().reshape(max_rows, self._record) for h in self._hosts]
        self._host_ints = [r[:, :int_part].view(np.int64) for r in host_records]
        self._host_floats = [r[:, int_part : int_part + float_part].view(np.float32) for r in host_records]
        records = self._device.view(max_rows, self._record)
        self._ints = records[:, :int_part].view(torch.int64)
        self._floats = records[:, int_part : int_part + float_part].view(torch.float32)
        self._merges: dict[int, StaticTokenMerge] = {}

    def merge(self, num_rows: int) -> StaticTokenMerge:
        """The device views of the first ``num_rows`` records, as the forward's ``merge`` (the same tensors every
        step, so a captured graph reads each step's records)."""
        if num_rows not in self._merges:
            k, ints, floats = self.width, self._ints[:num_rows], self._floats[:num_rows]
            self._merges[num_rows] = StaticTokenMerge(
                ids=ints[:, :k], probs=floats[:, :k], residual=floats[:, k], soft=ints[:, k], settings=self.settings
            )
        return self._merges[num_rows]

    def stage(self, soft_rows: list[tuple[int, SoftInput]], num_rows: int, buffer: int) -> None:
        """Write a step's soft rows into host buffer `buffer`; every other of the first ``num_rows`` rows is marked
        not soft (its other fields are left as they were: finite, and never read)."""
        k = self.width
        ints, floats = self._host_ints[buffer], self._host_floats[buffer]
        ints[:num_rows, k] = 0
        if not soft_rows:
            return
        rows, ids, probs, residual = [], [], [], []
        pad_id = self.settings.mask_token_id
        for row, soft in soft_rows:
            if len(soft.ids) > k:
                raise ValueError(f"row {row} has {len(soft.ids)} token-merge candidates; token_merge_top_k is {k}")
            rows.append(row)
            ids.append(list(soft.ids) + [pad_id] * (k - len(soft.ids)))
            probs.append(list(soft.probs) + [0.0] * (k - len(soft.probs)))
            residual.append(soft.residual)
        if max(rows) >= num_rows:
            raise ValueError(f"soft row {max(rows)} lies beyond the step's {num_rows} rows")
        ints[rows, :k] = ids
        ints[rows, k] = 1
        floats[rows, :k] = probs
        floats[rows, k] = residual

    def upload(self, num_rows: int, buffer: int) -> None:
        """Queue the copy of the first ``num_rows`` records of host buffer `buffer` to the device."""
        used = num_rows * self._record
        self._device[:used].copy_(self._hosts[buffer][:used], non_blocking=True)

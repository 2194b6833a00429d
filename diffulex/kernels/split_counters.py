"""Device state shared by the kernels that split one output over several programs and combine in the same launch.

Paged attention (split-KV), the skinny GEMM (split-K) and the top-1 (split vocabulary) each let the last program of
a tile to finish combine the partials; they count arrivals in a zeroed int32 buffer and leave it zeroed again. One
buffer per device serves them all: kernels on one stream never overlap, and each resets what it used. It is
allocated once at its full size and never replaced, because a captured CUDA graph keeps the address it saw.
"""

from __future__ import annotations

import torch

# Tiles one split launch may count: far above any launch that splits (splitting is for grids that do not fill
# the GPU on their own).
MAX_SPLIT_TILES = 1 << 16

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_SM_COUNT: dict[torch.device, int] = {}


def split_counters(device: torch.device, num_tiles: int) -> torch.Tensor:
    """The zeroed arrival counters of `device` (at least `num_tiles` of them)."""
    if num_tiles > MAX_SPLIT_TILES:
        raise ValueError(f"a split launch of {num_tiles} tiles exceeds the {MAX_SPLIT_TILES} split counters")
    buf = _COUNTERS.get(device)
    if buf is None:
        buf = torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query is slow next to a kernel launch)."""
    if device not in _SM_COUNT:
        _SM_COUNT[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device]

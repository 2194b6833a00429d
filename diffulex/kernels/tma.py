"""When a kernel may read a 2-D tensor through Hopper's tensor memory accelerator (TMA), and its descriptor.

Why one place: a TMA copy moves a whole ``[rows, cols]`` box from global into shared memory, issued by one thread
while the rest of the program computes, and its rules are the hardware's (and Triton's), not a kernel's: Hopper or
later, 16-byte aligned base and row stride, unit stride along the row. Boxes of more than 256 bytes a row gave wrong
products on Triton 3.6, so none is made. Under the Triton interpreter descriptors work on CPU tensors, so the CPU
tests run the same code path.
"""

from __future__ import annotations

import torch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host tensor descriptors: every caller loads plainly
    TensorDescriptor = None

from diffulex.kernels.pdl import INTERPRETING, device_capability

MIN_CAPABILITY = 9
ALIGN_BYTES = 16
MAX_BOX_ROW_BYTES = 256


def descriptor(x: torch.Tensor, box: list[int]) -> TensorDescriptor | None:
    """A descriptor of 2-D ``x`` read in ``box``-shaped tiles, or None where TMA cannot read it (the kernel then
    loads the tiles itself): no descriptor support, a GPU before Hopper, a CPU tensor outside the interpreter, a
    misaligned base or row stride, a non-unit stride along the row, a box row wider than `MAX_BOX_ROW_BYTES`."""
    if TensorDescriptor is None or x.dim() != 2:
        return None
    if x.is_cuda:
        if device_capability(x.device)[0] < MIN_CAPABILITY:
            return None
    elif not INTERPRETING:
        return None
    elem = x.element_size()
    if (
        x.stride(1) != 1
        or x.data_ptr() % ALIGN_BYTES
        or (x.stride(0) * elem) % ALIGN_BYTES
        or box[-1] * elem > MAX_BOX_ROW_BYTES
    ):
        return None
    return TensorDescriptor.from_tensor(x, box)

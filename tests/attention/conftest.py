"""Layer tests that force the Triton backend run its kernels under the interpreter on the CPU (set before triton is
imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

"""Kernel tests run natively on a GPU and under the Triton interpreter on the CPU (set before triton is imported)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

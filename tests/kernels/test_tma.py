"""What a kernel may read through a TMA descriptor (`diffulex.kernels.tma`); under the Triton interpreter
(tests/kernels/conftest.py) descriptors work on CPU tensors, as the kernels' own TMA tests use them; on a GPU the
tensors live there (a CPU tensor outside the interpreter gets none)."""

import pytest
import torch

from diffulex.kernels import tma

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# A GPU before Hopper has no TMA: every descriptor there is None.
HAS_TMA = DEVICE == "cpu" or torch.cuda.get_device_capability()[0] >= tma.MIN_CAPABILITY


def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def test_an_aligned_matrix_gets_a_descriptor_with_the_asked_box() -> None:
    desc = tma.descriptor(zeros(100, 64, dtype=torch.float16), [32, 64])
    if not HAS_TMA:
        assert desc is None
        return
    assert desc is not None and list(desc.block_shape) == [32, 64]


def test_rows_that_are_not_16_byte_aligned_get_none() -> None:
    assert tma.descriptor(zeros(50, 100, dtype=torch.float16), [16, 32]) is None  # 200-byte rows


def test_a_base_that_is_not_16_byte_aligned_gets_none() -> None:
    x = zeros(65 * 64, dtype=torch.float16)[1:].as_strided((64, 64), (64, 1))
    assert tma.descriptor(x, [16, 64]) is None


def test_a_box_row_wider_than_256_bytes_gets_none() -> None:
    x = zeros(64, 128, dtype=torch.float32)
    assert (tma.descriptor(x, [16, 64]) is not None) == HAS_TMA  # 256 bytes
    assert tma.descriptor(x, [16, 128]) is None  # 512 bytes


def test_a_matrix_strided_along_its_rows_gets_none() -> None:
    assert tma.descriptor(zeros(64, 64, dtype=torch.float16).t(), [16, 64]) is None
    assert tma.descriptor(zeros(4, 64, 64, dtype=torch.float16), [16, 64]) is None  # not 2-D


def test_a_cpu_tensor_outside_the_interpreter_gets_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tma, "INTERPRETING", False)
    assert tma.descriptor(torch.zeros(100, 64, dtype=torch.float16), [32, 64]) is None

"""What a kernel may read through a TMA descriptor (`diffulex.kernels.tma`); under the Triton interpreter
(tests/kernels/conftest.py) descriptors work on CPU tensors, as the kernels' own TMA tests use them."""

import torch

from diffulex.kernels import tma


def test_an_aligned_matrix_gets_a_descriptor_with_the_asked_box() -> None:
    x = torch.zeros(100, 64, dtype=torch.float16)
    desc = tma.descriptor(x, [32, 64])
    assert desc is not None and list(desc.block_shape) == [32, 64]


def test_rows_that_are_not_16_byte_aligned_get_none() -> None:
    assert tma.descriptor(torch.zeros(50, 100, dtype=torch.float16), [16, 32]) is None  # 200-byte rows


def test_a_base_that_is_not_16_byte_aligned_gets_none() -> None:
    x = torch.zeros(65 * 64, dtype=torch.float16)[1:].as_strided((64, 64), (64, 1))
    assert tma.descriptor(x, [16, 64]) is None


def test_a_box_row_wider_than_256_bytes_gets_none() -> None:
    x = torch.zeros(64, 128, dtype=torch.float32)
    assert tma.descriptor(x, [16, 64]) is not None  # 256 bytes
    assert tma.descriptor(x, [16, 128]) is None  # 512 bytes


def test_a_matrix_strided_along_its_rows_gets_none() -> None:
    assert tma.descriptor(torch.zeros(64, 64, dtype=torch.float16).t(), [16, 64]) is None
    assert tma.descriptor(torch.zeros(4, 64, 64, dtype=torch.float16), [16, 64]) is None  # not 2-D

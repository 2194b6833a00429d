"""Test helpers that ship with the package: tiny real-format checkpoints for engine and model tests."""

from diffulex.testing.checkpoints import (
    tiny_special_token_ids,
    write_qwen_tokenizer,
    write_tiny_checkpoint,
)

__all__ = ["tiny_special_token_ids", "write_qwen_tokenizer", "write_tiny_checkpoint"]

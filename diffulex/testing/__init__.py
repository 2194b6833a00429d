"""Test helpers that ship with the package: tiny real-format checkpoints and adapters, the reference decoder."""

from diffulex.testing.checkpoints import (
    tiny_special_token_ids,
    write_qwen_tokenizer,
    write_tiny_checkpoint,
    write_tiny_lora_adapter,
)

__all__ = ["tiny_special_token_ids", "write_qwen_tokenizer", "write_tiny_checkpoint", "write_tiny_lora_adapter"]

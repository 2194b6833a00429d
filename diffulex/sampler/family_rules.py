"""The acceptance rule of every dense family, registered under its ``model_name``.

The original implementation's per-family rules, with ``H = {positions with confidence >
accept_threshold}``:

* ``sdar``, ``sdar_moe``, ``llada``: ``H``; if ``H`` is empty, force the top-1 position when the block has no
  previous block or its previous block is semi-complete.
* ``llada2`` and its other names (naive sampling): the Dream rule below, which is the same.
* ``dream``, ``diffucoder``, ``dream_reasoner``, ``fast_dllm_v2`` (under ``multi_bd``/``d2f``): "if there is no
  previous block or it is semi-complete: ``H`` if non-empty else top-1; otherwise ``H``". That is the same
  rule: both force exactly when ``SampleTarget.force_allowed`` (no previous block, or previous block's progress
  ``>= semi_complete_threshold``), so these families reuse `ConfidenceSampler`. Their logit shift is not a
  sampler matter: the runner already hands the sampler the row that predicts each position.
* ``stable_diffcoder``: ``H`` if non-empty else top-1, always (its authors' decoder commits at least one token
  per step in every block): `AlwaysForceSampler`.
"""

from __future__ import annotations

from diffulex.registry import AutoSampler
from diffulex.sampler.confidence import ConfidenceSampler

_LLADA2_NAMES = ("llada2", "llada2_moe", "llada2_mini", "llada2dot1_mini", "llada2_mini_dmax")
for _name in ("sdar_moe", "llada", "dream", "diffucoder", "dream_reasoner", "fast_dllm_v2", *_LLADA2_NAMES):
    AutoSampler.register(_name)(ConfidenceSampler)


@AutoSampler.register("stable_diffcoder")
class AlwaysForceSampler(ConfidenceSampler):
    """The confidence rule with forcing always allowed: every sampled block takes at least its best position."""

    force_every_block = True

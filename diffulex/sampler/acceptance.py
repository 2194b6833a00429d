"""Acceptance rules: which sampled positions of a block are written this step.

A rule sees one block's candidate confidences and decides which positions to keep; positions not kept stay
masked and are predicted again next step. Model families register the sampler class that carries their rule.
"""

from __future__ import annotations


def accept_confident(confidences: list[float], threshold: float, force_allowed: bool) -> list[int]:
    """Indices whose confidence exceeds ``threshold``; if none does and forcing is allowed, the best one.

    Forcing is what guarantees progress: the oldest active block always has a committed predecessor, so it
    fills at least one position per step, while younger blocks only take what they are sure of.
    """
    chosen = [i for i, c in enumerate(confidences) if c > threshold]
    if not chosen and force_allowed and confidences:
        best = max(range(len(confidences)), key=lambda i: (confidences[i], -i))
        chosen = [best]
    return chosen

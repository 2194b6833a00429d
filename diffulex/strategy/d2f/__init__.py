"""Discrete Diffusion Forcing: multi-block decoding with a bidirectionally encoded prompt.

The only difference from ``multi_bd``: prompt rows see the whole prompt. A prompt page's K/V then depends on the
prompt tokens after it, so a page cannot be reused by a request whose prompt continues differently: prefix caching
is off. Requests, acceptance and everything else are multi_bd's.
"""

from __future__ import annotations

from diffulex.strategy.multi_bd import MultiBD
from diffulex.strategy.strategy import register_strategy


class D2F(MultiBD):
    name = "d2f"
    aliases = ()
    bidirectional_prompt = True
    sampling_modes = ("naive",)


register_strategy(D2F())

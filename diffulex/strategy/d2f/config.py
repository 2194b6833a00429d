"""Config invariants of Discrete Diffusion Forcing: the prompt attends bidirectionally, no prefix caching."""

from __future__ import annotations

from typing import TYPE_CHECKING

from diffulex.config import force_setting
from diffulex.registry import StrategyConfigRegistry

if TYPE_CHECKING:
    from diffulex.config import Config


@StrategyConfigRegistry.register("d2f")
def normalize(config: Config) -> None:
    """With a bidirectional prompt the K/V of a prompt page depends on the tokens after it, so a page
    cannot be reused by a request whose prompt continues differently: prefix caching is turned off."""
    force_setting(config, "multi_block_prefix_full", True, "d2f attends the whole prompt bidirectionally")
    force_setting(config, "enable_prefix_caching", False, "d2f prompt pages depend on the whole prompt")

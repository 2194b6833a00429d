"""Discrete Diffusion Forcing: multi-block decoding with a bidirectionally encoded prompt.

The only differences from ``multi_bd`` are set by its config normalizer: prefix-full attention (prompt rows see
the whole prompt) and prefix caching off (a prompt page's K/V depends on later prompt tokens). The runtime
components are the shared ones.
"""

from diffulex.engine.kv_cache_manager import KVCacheManager
from diffulex.engine.model_runner import ModelRunner
from diffulex.engine.request import Request
from diffulex.engine.scheduler import Scheduler
from diffulex.registry import AutoKVCacheManager, AutoModelRunner, AutoReq, AutoScheduler
from diffulex.strategy.d2f import config  # noqa: F401

NAME = "d2f"
AutoReq.register(NAME)(Request)
AutoScheduler.register(NAME)(Scheduler)
AutoKVCacheManager.register(NAME)(KVCacheManager)
AutoModelRunner.register(NAME)(ModelRunner)

"""Multi-Block Diffusion: a running set of up to ``buffer_size`` blocks, block-causal attention, prefix caching.

With ``buffer_size=1`` this is SingleBD, the semi-autoregressive block diffusion SDAR and LLaDA2 were trained
for. It uses the shared request, scheduler, cache manager and runner unchanged.
"""

from diffulex.engine.kv_cache_manager import KVCacheManager
from diffulex.engine.model_runner import ModelRunner
from diffulex.engine.request import Request
from diffulex.engine.scheduler import Scheduler
from diffulex.registry import AutoKVCacheManager, AutoModelRunner, AutoReq, AutoScheduler
from diffulex.strategy.multi_bd import config  # noqa: F401

NAME = "multi_bd"
AutoReq.register(NAME)(Request)
AutoScheduler.register(NAME)(Scheduler)
AutoKVCacheManager.register(NAME)(KVCacheManager)
AutoModelRunner.register(NAME)(ModelRunner)

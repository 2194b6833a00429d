"""DMax: LLaDA2 edit decoding where every decoded token of an active block is refreshed each step and masks are
filled as a left-to-right run of confident positions (`diffulex.sampler.dmax`); a block commits once a step
changes nothing or everything is confident; with token merge, decoded positions enter the next forward as soft
inputs (`diffulex.layers.token_merge`). Requests are edit-mode requests; scheduler, cache manager and runner are
the shared ones.
"""

from diffulex.engine.edit_request import EditRequest
from diffulex.engine.kv_cache_manager import KVCacheManager
from diffulex.engine.model_runner import ModelRunner
from diffulex.engine.scheduler import Scheduler
from diffulex.registry import AutoKVCacheManager, AutoModelRunner, AutoReq, AutoScheduler
from diffulex.strategy.dmax import config  # noqa: F401

NAME = "dmax"
AutoReq.register(NAME)(EditRequest)
AutoScheduler.register(NAME)(Scheduler)
AutoKVCacheManager.register(NAME)(KVCacheManager)
AutoModelRunner.register(NAME)(ModelRunner)

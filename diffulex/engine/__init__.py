"""The engine core: request and block state, scheduler, KV cache manager, model runner, step loop."""

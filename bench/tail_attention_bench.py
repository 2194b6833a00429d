"""Experiment: decode rows after a long cached context, auto split count against explicit."""
from __future__ import annotations

import sys
import torch

sys.path.insert(0, ".")
from bench.prefill_attention_bench import prompt_inputs  # noqa: E402
from diffulex.kernels import paged_attention as pa  # noqa: E402

dev = torch.device("cuda")
orig = pa._auto_num_splits
def spy(*a):
    r = orig(*a)
    print("   auto splits args", a[1:], "->", r)
    return r
pa._auto_num_splits = spy
for heads, kv, cached, rows in ((16, 8, 32000, 4), (16, 8, 8000, 4), (32, 8, 32000, 4), (16, 8, 32000, 260)):
    q, k, v, cache, meta = prompt_inputs(cached, rows, heads, kv, 128, torch.bfloat16, dev)
    meta.max_kv_len = 40960
    out = torch.empty_like(q)
    for rnd in range(2):
        for splits in (None, 32, 16, None):
            def fn():
                pa.triton_paged_attention(q, k, v, cache, cache, meta, 0.088, out=out, num_splits=splits)
            fn(); torch.cuda.synchronize()
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            for _ in range(50):
                fn()
            e.record(); e.synchronize()
            print(f"heads {heads}/{kv} cached {cached} rows {rows} round {rnd} splits {splits}: {s.elapsed_time(e)/50*1e3:8.1f} us", flush=True)
    ref = out.clone()
    pa.triton_paged_attention(q, k, v, cache, cache, meta, 0.088, out=out, num_splits=32)
    print("   max diff auto vs 32:", (out.float() - ref.float()).abs().max().item())

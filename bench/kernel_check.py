"""GPU check and timing of the Triton kernels at realistic shapes (SDAR-1.7B: 16 q heads, 8 kv heads, dim 128).

For each case the kernel output is compared with the PyTorch reference (``diffulex.attention.torch_paged``) in
bf16 with the output poisoned with NaN first, so unwritten elements fail the check; then the kernel is timed with
CUDA events and its K/V read bandwidth is compared with the HBM floor of the device.

    python bench/kernel_check.py --out runs/kernel_check.json
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from diffulex.attention.metadata import PagedAttentionMetadata
from diffulex.attention.torch_paged import paged_attention, store_kv
from diffulex.kernels import triton_paged_attention, triton_store_kv

PEAK_TBPS = {"H100": 3.0, "H200": 4.3}  # rough achievable-HBM figures used as the floor


def peak_tbps(name: str) -> float | None:
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps
    return None


def make_batch(
    requests: list[tuple[int, int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    block_size: int,
    prefix_full: bool,
    dtype: torch.dtype,
    seed: int = 0,
):
    """Random inputs for ``(context_len, query_len, prompt_len)`` requests; pages are shuffled over the pool."""
    device = "cuda"
    rng = random.Random(seed)
    torch.manual_seed(seed)
    pages_per_req = [(ctx + q + page_size - 1) // page_size for ctx, q, _ in requests]
    num_pages = sum(pages_per_req) + 16
    pool = list(range(num_pages))
    rng.shuffle(pool)
    page_tables = torch.full((len(requests), max(pages_per_req) + 1), -1, dtype=torch.int32)
    slots = []
    for r, (n, (ctx, q_len, _)) in enumerate(zip(pages_per_req, requests, strict=True)):
        pages = [pool.pop() for _ in range(n)]
        page_tables[r, :n] = torch.tensor(pages, dtype=torch.int32)
        slots += [pages[p // page_size] * page_size + p % page_size for p in range(ctx, ctx + q_len)]
    q_lens = [q for _, q, _ in requests]
    cu = torch.zeros(len(requests) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    total = sum(q_lens)
    q = torch.randn(total, num_heads, head_dim, device=device, dtype=dtype)
    k = torch.randn(total, num_kv_heads, head_dim, device=device, dtype=dtype)
    v = torch.randn(total, num_kv_heads, head_dim, device=device, dtype=dtype)
    k_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn(num_pages, page_size, num_kv_heads, head_dim, device=device, dtype=dtype)
    meta = PagedAttentionMetadata(
        cu_seqlens_q=cu.to(device),
        context_lens=torch.tensor([c for c, _, _ in requests], dtype=torch.int32, device=device),
        prefix_lens=torch.tensor([p for _, _, p in requests], dtype=torch.int32, device=device),
        page_tables=page_tables.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=block_size,
        page_size=page_size,
        prefix_full=prefix_full,
        query_lens_cpu=q_lens,
        context_lens_cpu=[c for c, _, _ in requests],
        prefix_lens_cpu=[p for _, _, p in requests],
    )
    return q, k, v, k_cache, v_cache, meta


def time_ms(fn, warmup: int, iters: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def graph_time_ms(fn, iters: int) -> float | None:
    """Kernel time without Python launch overhead: ``fn`` captured once in a CUDA graph, replayed ``iters`` times."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return time_ms(graph.replay, 3, iters)
    except Exception as exc:  # timing only: report and go on
        print(f"cuda graph timing failed: {exc!r}")
        return None


def cases(args) -> list[dict]:
    out = []
    for batch in args.batches:
        for buffer_blocks in (1, 2):
            q_len = buffer_blocks * args.block_size
            out.append(
                dict(
                    name=f"decode_b{batch}_buf{buffer_blocks}",
                    requests=[(args.prefix, q_len, 200) for _ in range(batch)],
                    prefix_full=False,
                )
            )
    out.append(dict(name="decode_b32_shifted", requests=[(args.prefix - 1, 9, 200)] * 32, prefix_full=False))
    out.append(dict(name="prefill_4k_prefix_full", requests=[(0, args.prefix, args.prefix - 4)], prefix_full=True))
    mixed = [(0, 1024, 1020)] + [(args.prefix + 7 * i, 8, 100) for i in range(31)]
    out.append(dict(name="mixed_prefill_decode_b32", requests=mixed, prefix_full=False))
    return out


def run_case(case: dict, page_size: int, args, peak: float | None) -> dict:
    dtype = torch.bfloat16
    scale = args.head_dim**-0.5
    t0 = time.time()
    q, k, v, k_cache, v_cache, meta = make_batch(
        case["requests"],
        args.heads,
        args.kv_heads,
        args.head_dim,
        page_size,
        args.block_size,
        case["prefix_full"],
        dtype,
    )
    row = {"name": case["name"], "page_size": page_size, "tokens": q.shape[0], "requests": meta.num_requests}
    expected = paged_attention(q, k, v, k_cache, v_cache, meta, scale).float()
    for impl, grouped in (("triton_grouped", True), ("triton", False)):
        out = torch.full_like(q, float("nan"))
        triton_paged_attention(q, k, v, k_cache, v_cache, meta, scale, grouped=grouped, out=out)
        torch.cuda.synchronize()
        nan = bool(torch.isnan(out).any())
        err = float((out.float() - expected).abs().max()) if not nan else float("nan")
        ok = (not nan) and err <= args.atol
        call = lambda g=grouped, o=out: triton_paged_attention(q, k, v, k_cache, v_cache, meta, scale, grouped=g, out=o)
        launch_ms = time_ms(call, args.warmup, args.iters)
        graph_ms = graph_time_ms(call, args.iters)
        ms = graph_ms if graph_ms is not None else launch_ms
        elem = k_cache.element_size()
        kv_bytes = sum(c + ql for c, ql in zip(meta.context_lens_cpu, meta.query_lens_cpu, strict=True))
        kv_bytes *= 2 * args.kv_heads * args.head_dim * elem
        io_bytes = 2 * q.numel() * q.element_size()
        gbps = kv_bytes / (ms * 1e-3) / 1e9
        row[impl] = {
            "ok": ok,
            "nan": nan,
            "max_abs_err": err,
            "ms": ms,
            "ms_eager_launches": launch_ms,
            "ms_cuda_graph": graph_ms,
            "kv_read_gb": kv_bytes / 1e9,
            "kv_gbps": gbps,
            "floor_ms": (kv_bytes + io_bytes) / (peak * 1e12) * 1e3 if peak else None,
            "fraction_of_peak": gbps / (peak * 1e3) if peak else None,
        }
    # KV store of the step's rows (all rows committed)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv(k, v, ref_k, ref_v, meta.slot_mapping)
    got_k, got_v = k_cache.clone(), v_cache.clone()
    triton_store_kv(k, v, got_k, got_v, meta.slot_mapping)
    store_ok = bool(torch.equal(ref_k, got_k) and torch.equal(ref_v, got_v))
    row["store_kv"] = {
        "ok": store_ok,
        "ms": time_ms(lambda: triton_store_kv(k, v, got_k, got_v, meta.slot_mapping), 5, 20),
        "torch_ms": time_ms(lambda: store_kv(k, v, ref_k, ref_v, meta.slot_mapping), 5, 20),
    }
    row["wall_s"] = round(time.time() - t0, 2)
    g = row["triton_grouped"]
    print(
        f"{case['name']:28s} page={page_size:2d} ok={g['ok']} err={g['max_abs_err']:.2e} "
        f"eager {g['ms_eager_launches']:.3f} ms | grouped {g['ms']:.3f} ms {g['kv_gbps']:.0f} GB/s "
        f"| ungrouped {row['triton']['ms']:.3f} ms "
        f"{row['triton']['kv_gbps']:.0f} GB/s | store ok={store_ok}",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    parser.add_argument("--prefix", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 4])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--atol", type=float, default=2e-2)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this check needs a GPU"
    name = torch.cuda.get_device_name(0)
    peak = peak_tbps(name)
    report: dict = {"device": name, "torch": torch.__version__, "peak_tbps": peak, "cases": []}
    all_ok = True
    for page_size in args.page_sizes:
        for case in cases(args):
            row = run_case(case, page_size, args, peak)
            all_ok &= row["triton_grouped"]["ok"] and row["triton"]["ok"] and row["store_kv"]["ok"]
            report["cases"].append(row)
    report["all_ok"] = all_ok
    text = json.dumps(report, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print("all_ok:", all_ok)


if __name__ == "__main__":
    main()

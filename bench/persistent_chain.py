"""Experiment: the SDAR-1.7B batch-1 GEMM chain as one persistent kernel with grid barriers, against the chain of
112 skinny-GEMM launches (PDL, CUDA graph) that the engine runs. Timing only; the product is checked once.

    PYTHONPATH=. python bench/persistent_chain.py [--layers 28] [--rows 4]

Why: `what_if.py` measured the GEMMs alone at ~48 us per layer against ~34 us of weight stream on an H100: each
launch carries ~3.5 us that PDL and the L2 prefetch do not hide. In one persistent launch, programs cross a grid
barrier instead of a kernel boundary, and can prefetch the next phase's weights before they wait.

Result (H100, 2026-11-24 session 6; docs/benchmarks.md): no gain. The 112 GEMMs of a step take 1.42-1.46 ms as
one persistent launch against 1.47 ms as 112 launches with PDL (0.95 ms of weight stream); the 112 grid barriers
alone cost 0.127 ms (1.1 us each); the rest is each phase's pipeline fill and tail, which a barrier pays as a
launch boundary does. Prefetching the whole next phase into L2 before the barrier was slower (1.63 ms).
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl
from kernel_check import time_ms

from diffulex.kernels.pdl import prefetch_l2
from diffulex.kernels.skinny_gemm import skinny_linear


@triton.jit
def _grid_barrier(bar_ptr, target, SPIN_LOAD: tl.constexpr):
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    if SPIN_LOAD:
        seen = tl.load(bar_ptr, volatile=True)
        while seen < target:
            seen = tl.load(bar_ptr, volatile=True)
        tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    else:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
        while seen < target:
            seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _prefetch_phase(w_ptr, K, N, pid, P, BN: tl.constexpr, S: tl.constexpr, LINES: tl.constexpr):
    """Prefetch into L2 the first LINES 128-byte lines of every row of this program's work items (LINES < 0:
    all of its slice)."""
    if LINES != 0:
        n_items = (N // BN) * S
        k_per = K // S
        for item in range(pid, n_items, P):
            tile = item // S
            s = item % S
            k_lo = s * k_per
            rows = tile * BN + tl.arange(0, BN)
            if LINES > 0:
                ks = k_lo + tl.arange(0, LINES) * 64
                prefetch_l2(w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :])
            else:
                for kk in range(0, k_per, 64 * 16):
                    ks = k_lo + kk + tl.arange(0, 16) * 64
                    prefetch_l2(w_ptr + rows.to(tl.int64)[:, None] * K + ks[None, :])


@triton.jit
def _gemm_phase(
    x_ptr,  # fp32 partials [XS, M, x_stride]: the input is their sum over XS
    x_stride,
    w_ptr,  # [N, K]
    out_ptr,  # fp32 partials [S, M, N]
    K,
    N,
    pid,
    P,
    M,
    XS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    S: tl.constexpr,
    STAGES: tl.constexpr,
):
    n_items = (N // BN) * S
    k_per = K // S
    offs_m = tl.arange(0, BM)
    row_ok = (offs_m < M)[:, None]
    for item in range(pid, n_items, P):
        tile = item // S
        s = item % S
        k_lo = tl.multiple_of(s * k_per, BK)
        offs_n = tile * BN + tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * K + (k_lo + offs_k)[None, :]
        x_ptrs = x_ptr + offs_m[:, None] * x_stride + (k_lo + offs_k)[None, :]
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for _k in tl.range(0, k_per, BK, num_stages=STAGES):
            w = tl.load(w_ptrs)
            xv = tl.load(x_ptrs, mask=row_ok, other=0.0, cache_modifier=".cg")
            for xs in tl.static_range(1, XS):
                xv += tl.load(x_ptrs + xs * M * x_stride, mask=row_ok, other=0.0, cache_modifier=".cg")
            acc = tl.dot(w, tl.trans(xv.to(tl.bfloat16)), acc)
            w_ptrs += BK
            x_ptrs += BK
        out = tl.trans(acc)
        tl.store(out_ptr + s * M * N + offs_m[:, None] * N + offs_n[None, :], out, mask=row_ok)


@triton.jit
def _chain_kernel(
    h_ptr,  # fp32 [S4, M, H]: the residual stream as partials (layer input)
    qkv_ptr,
    o_ptr,
    gu_ptr,
    w_qkv,
    w_o,
    w_gu,
    w_down,
    bar_ptr,
    exit_ptr,
    L,
    M,
    H: tl.constexpr,
    QKV: tl.constexpr,
    I2: tl.constexpr,
    BM: tl.constexpr,
    BN1: tl.constexpr,
    BK1: tl.constexpr,
    S1: tl.constexpr,
    ST1: tl.constexpr,
    BN2: tl.constexpr,
    BK2: tl.constexpr,
    S2: tl.constexpr,
    ST2: tl.constexpr,
    BN3: tl.constexpr,
    BK3: tl.constexpr,
    S3: tl.constexpr,
    ST3: tl.constexpr,
    BN4: tl.constexpr,
    BK4: tl.constexpr,
    S4: tl.constexpr,
    ST4: tl.constexpr,
    PREF: tl.constexpr,
    SPIN_LOAD: tl.constexpr,
    SKIP_GEMM: tl.constexpr = False,
):
    pid = tl.program_id(0)
    P = tl.num_programs(0)
    INTER: tl.constexpr = I2 // 2
    nb = 0
    for layer in range(L):
        wq = w_qkv + layer.to(tl.int64) * QKV * H
        wo = w_o + layer.to(tl.int64) * H * H
        wg = w_gu + layer.to(tl.int64) * I2 * H
        wd = w_down + layer.to(tl.int64) * H * INTER
        if not SKIP_GEMM:
            _gemm_phase(h_ptr, H, wq, qkv_ptr, H, QKV, pid, P, M, S4, BM, BN1, BK1, S1, ST1)
        _prefetch_phase(wo, H, H, pid, P, BN2, S2, PREF)
        nb += 1
        _grid_barrier(bar_ptr, nb * P, SPIN_LOAD)
        if not SKIP_GEMM:
            _gemm_phase(qkv_ptr, QKV, wo, o_ptr, H, H, pid, P, M, S1, BM, BN2, BK2, S2, ST2)
        _prefetch_phase(wg, H, I2, pid, P, BN3, S3, PREF)
        nb += 1
        _grid_barrier(bar_ptr, nb * P, SPIN_LOAD)
        if not SKIP_GEMM:
            _gemm_phase(o_ptr, H, wg, gu_ptr, H, I2, pid, P, M, S2, BM, BN3, BK3, S3, ST3)
        _prefetch_phase(wd, INTER, H, pid, P, BN4, S4, PREF)
        nb += 1
        _grid_barrier(bar_ptr, nb * P, SPIN_LOAD)
        if not SKIP_GEMM:
            _gemm_phase(gu_ptr, I2, wd, h_ptr, INTER, H, pid, P, M, S3, BM, BN4, BK4, S4, ST4)
        if layer + 1 < L:
            _prefetch_phase(w_qkv + (layer + 1).to(tl.int64) * QKV * H, H, QKV, pid, P, BN1, S1, PREF)
        nb += 1
        _grid_barrier(bar_ptr, nb * P, SPIN_LOAD)
    # every program has passed the last barrier once it arrives here: the last one resets both counters
    done = tl.atomic_add(exit_ptr, 1, sem="acq_rel", scope="gpu")
    if done == P - 1:
        tl.atomic_xchg(bar_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(exit_ptr, 0, sem="relaxed", scope="gpu")


def _launch_args(cfg: dict, **constants) -> dict:
    """The kernel's constexpr arguments: the per-phase (BN, BK, S, STAGES) of `cfg` and the given constants."""
    kw = dict(constants)
    for i, key in enumerate(("c1", "c2", "c3", "c4"), 1):
        bn, bk, s, st = cfg[key]
        kw.update({f"BN{i}": bn, f"BK{i}": bk, f"S{i}": s, f"ST{i}": st})
    return kw


def _runner(bufs: tuple, x0: torch.Tensor, programs: int, kw: dict):
    h = bufs[0]

    def run() -> None:
        h.zero_()
        h[0].copy_(x0.float())
        _chain_kernel[(programs,)](*bufs, num_warps=4, **kw)

    return run


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--programs", type=int, default=0, help="0: one per SM")
    p.add_argument("--spin-load", action="store_true", help="spin on a volatile load instead of an atomic")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = torch.device("cuda")
    L, M, H, QKV, INTER = args.layers, args.rows, 2048, 4096, 6144
    gen = torch.Generator(device=dev).manual_seed(0)

    def rnd(*shape):
        return (torch.randn(*shape, device=dev, generator=gen) * 0.02).to(torch.bfloat16)

    w_qkv, w_o, w_gu, w_down = rnd(L, QKV, H), rnd(L, H, H), rnd(L, 2 * INTER, H), rnd(L, H, INTER)
    weight_bytes = sum(t.numel() * 2 for t in (w_qkv, w_o, w_gu, w_down))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    P = args.programs or sms
    rows = {}

    # copy bandwidth (read + write) for the floor
    src = torch.empty(1 << 29, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_ms(lambda: dst.copy_(src), 3, 10)
    bw = 2 * src.numel() / (t * 1e-3)

    rows["copy_TBps"] = bw / 1e12
    rows["weight_stream_ms"] = weight_bytes / bw * 1e3

    # baseline: the engine's chain of skinny launches, captured in a graph
    x0 = rnd(M, H)

    def chain():
        h = x0
        for layer in range(L):
            qkv = skinny_linear(h, w_qkv[layer])
            o = skinny_linear(qkv[:, :H].contiguous(), w_o[layer])
            gu = skinny_linear(o, w_gu[layer])
            h = skinny_linear(gu[:, :INTER].contiguous(), w_down[layer])
        return h

    chain()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ref_out = chain()
    rows["launch_chain_ms"] = time_ms(g.replay, 3, 30)

    def configs():
        # (BN, BK, S, STAGES) per phase: qkv, o, gate_up, down
        yield "a", dict(c1=(32, 128, 1, 4), c2=(32, 128, 2, 4), c3=(64, 128, 1, 4), c4=(32, 256, 4, 3))
        yield "b", dict(c1=(32, 256, 1, 4), c2=(16, 256, 1, 4), c3=(32, 256, 1, 4), c4=(16, 256, 2, 4))
        yield "c", dict(c1=(16, 256, 2, 4), c2=(16, 256, 1, 4), c3=(16, 256, 1, 4), c4=(16, 256, 3, 4))

    bar = torch.zeros(2, dtype=torch.int32, device=dev)
    for name, cfg in configs():
        s4 = cfg["c4"][2]
        s1, s2, s3 = cfg["c1"][2], cfg["c2"][2], cfg["c3"][2]
        h = torch.zeros(s4, M, H, dtype=torch.float32, device=dev)
        qkv = torch.empty(s1, M, QKV, dtype=torch.float32, device=dev)
        o = torch.empty(s2, M, H, dtype=torch.float32, device=dev)
        gu = torch.empty(s3, M, 2 * INTER, dtype=torch.float32, device=dev)
        constants = {"H": H, "QKV": QKV, "I2": 2 * INTER, "BM": 16, "SPIN_LOAD": args.spin_load}
        bufs = (h, qkv, o, gu, w_qkv, w_o, w_gu, w_down, bar[0:], bar[1:], L, M)
        for pref in (0, 8, -1):
            tag = f"persistent_{name}_pref{pref}"
            run = _runner(bufs, x0, P, _launch_args(cfg, PREF=pref, **constants))
            try:
                run()
                torch.cuda.synchronize()
                got = h.sum(0)
                err = (got - ref_out.float()).abs().max().item() / max(ref_out.float().abs().max().item(), 1e-6)
                rows[f"{tag}_ms"] = time_ms(run, 3, 30)
                rows[f"{tag}_relerr"] = err
            except Exception as exc:  # noqa: BLE001 - an experiment: report and go on
                rows[f"{tag}_error"] = str(exc)[:200]
            print(json.dumps({k: v for k, v in rows.items() if tag in k}))
        if name == "a":
            kw = _launch_args(cfg, PREF=0, SKIP_GEMM=True, **constants)
            rows["barriers_only_ms"] = time_ms(_runner(bufs, x0, P, kw), 3, 30)
            print("barriers only", rows["barriers_only_ms"])
    print("PERSISTENT", json.dumps(rows, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

"""Upper bounds for fusion work: the batch-1 graph replay with some of its launches removed (timing only).

    PYTHONPATH=. python bench/what_if.py --model 1.7b --skip norm,silu   # one engine per call

Builds an engine over a random SDAR checkpoint (``load_format="dummy"``), lets one request settle into decode and
times back-to-back replays of its captured graph (`step_anatomy.replay_cost`) and 100 engine steps. ``--skip``
replaces layers by identity functions before the engine is built, so their kernels vanish from the graph:

* ``norm``: every RMSNorm (input, post-attention, final; the residual add goes with it);
* ``silu``: SiLU-and-mul (the MLP passes the gate half on);
* ``attn``: the attention layer, q/k norm, rotary and KV store included (it passes q on).

The tokens are then meaningless; the replay time says how much a perfect fusion of those launches could save.
``--table N,K,BUCKET=BN,BK,WARPS,STAGES,DOT,SPLIT[,TMA]`` overrides a skinny-GEMM config and ``--attn-splits`` caps
the split-KV factor, to time configurations in the chain of kernels rather than alone.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from step_anatomy import replay_cost

from diffulex import Diffulex
from diffulex.bench.throughput import _admit_until_decoding, _greedy, random_prompts, write_sdar_checkpoint


def _remove(skip: set[str]) -> None:
    if "norm" in skip:
        from diffulex.layers.norm import RMSNorm

        RMSNorm.forward = lambda self, x, residual=None: x if residual is None else (x, residual)
    if "silu" in skip:
        from diffulex.layers.activation import SiluAndMul

        SiluAndMul.forward = lambda self, gate, up: gate
    if "attn" in skip:
        from diffulex.attention.layer import Attention

        Attention.forward = lambda self, q, k, v, meta, rope=None, q_norm=None, k_norm=None: q.reshape(q.shape[0], -1)


def _override(tables: list[str], attn_splits: int | None) -> None:
    from diffulex.kernels import paged_attention, skinny_gemm

    for item in tables:
        key, cfg = item.split("=")
        n, k, bucket = (int(v) for v in key.split(","))
        bn, bk, warps, stages, dot, split, *tma = (int(v) for v in cfg.split(","))
        skinny_gemm._TABLE[(n, k, bucket)] = skinny_gemm.SkinnyConfig(
            bn, bk, warps, stages, bool(dot), split, bool(tma and tma[0])
        )
    if attn_splits is not None:
        auto = paged_attention._auto_num_splits
        paged_attention._auto_num_splits = lambda *args: min(attn_splits, auto(*args))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--skip", default="", help="comma-separated: norm, silu, attn")
    ap.add_argument("--table", nargs="*", default=[])
    ap.add_argument("--attn-splits", type=int)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--data-dir", default="tests/data/sdar-4b-chat")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    _remove(skip)
    _override(args.table, args.attn_splits)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_sdar_checkpoint(Path(tmp) / args.model, args.model, args.data_dir)
        engine = Diffulex(
            str(path), block_size=4, buffer_size=1, max_num_reqs=1, max_model_len=1024, load_format="dummy"
        )
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, 1, 128, 0)
        ids = [engine.add_request(p, _greedy(800)) for p in prompts]
        _admit_until_decoding(engine, [r for r in engine.scheduler.waiting if r.req_id in set(ids)], 20)
        for _ in range(5):
            engine.step()
        replay = replay_cost(engine, 50)["replay GPU (back to back)"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step = 1e3 * (time.perf_counter() - t0) / args.steps
        print(f"WHATIF {args.model} {args.tag} skip={sorted(skip)} replay_ms={replay:.3f} step_ms={step:.3f}")
        engine.exit()


if __name__ == "__main__":
    main()

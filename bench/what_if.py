"""Upper bounds for fusion work: the batch-1 graph replay with some of its launches removed (timing only).

    PYTHONPATH=. python bench/what_if.py --model 1.7b --skip norm,silu   # one engine per call

Builds an engine over a random SDAR checkpoint (``load_format="dummy"``), lets one request settle into decode and
times back-to-back replays of its captured graph (`step_anatomy.replay_cost`) and 100 engine steps. ``--skip``
replaces layers by identity functions before the engine is built, so their kernels vanish from the graph:

* ``norm``: every RMSNorm (input, post-attention, final; the residual add goes with it);
* ``silu``: SiLU-and-mul (the MLP passes the gate half on);
* ``attn``: the attention layer, q/k norm, rotary and KV store included (it passes q on);
* ``rope``: only the q/k norm + rotary + KV store launch before attention (attention reads q/k as they come);
* ``attnkernel``: only the attention launch after it (its output is q).

The tokens are then meaningless; the replay time says how much a perfect fusion of those launches could save.
``--partials N,K ...`` makes the skinny GEMMs of those weight shapes skip their split-K sum (the output is then
garbage; the time says what a consumer summing the partials itself could save, minus its extra reads).
``--lookahead LINES`` launches, right after each layer's qkv GEMM, a kernel that prefetches into L2 the first LINES
128-byte lines of every row of that layer's gate_up weight, while attention leaves the memory idle.
``--release-early N,K ...`` (or ``all``) lets the kernels after those skinny GEMMs start at their beginning, and
``--prefetch-mb`` sets the L2 prefetch budget per matrix, ``--prefetch-for N,K=MB ...`` that of single weight shapes.
``--step-timeline`` prints the same increments over whole engine steps (forward and sampling graphs, the result's
store), ``--step-sequence`` a few steps' events in order with the decoder layers collapsed (what a step does around
its layers, and the gaps between those launches). ``--norm-warps`` and ``--rope-warps`` set the warps of the
RMSNorm and q/k norm + rotary programs.
``--table N,K,BUCKET=BN,BK,WARPS,STAGES,DOT,SPLIT[,TMA]`` overrides a skinny-GEMM config and
``--attn-splits`` caps the split-KV factor, ``--attn-min-keys`` sets the fewest keys a split takes and
``--attn-prefetch-keys`` how many cached keys each attention program pulls into L2 before its PDL wait, to time
configurations in the chain of kernels rather than alone.
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from step_anatomy import replay_cost, smallest_graph

from diffulex import Diffulex
from diffulex.bench.throughput import _admit_until_decoding, _greedy, random_prompts, write_sdar_checkpoint
from diffulex.kernels.pdl import prefetch_l2, release_dependents, wait_for_inputs


def _shape(item: str) -> tuple[int, ...]:
    """A weight shape given on the command line as ``N,K``."""
    return tuple(int(v) for v in item.split(","))


def _remove(skip: set[str]) -> None:
    if "norm" in skip:
        from diffulex.layers.linear import UnsummedProduct
        from diffulex.layers.norm import RMSNorm

        def passthrough(self, x, residual=None):
            if isinstance(x, UnsummedProduct):  # the first split's fp32 bits read as the model dtype: right shape
                x = x.parts[0].view(x.dtype)[:, : x.parts.shape[-1]]
            return x if residual is None else (x, residual)

        RMSNorm.forward = passthrough
    if "silu" in skip:
        from diffulex.layers.activation import SiluAndMul

        SiluAndMul.forward = lambda self, gate, up: gate
    if "attn" in skip:
        from diffulex.attention.layer import Attention

        Attention.forward = lambda self, q, k, v, meta, rope=None, q_norm=None, k_norm=None: q.reshape(q.shape[0], -1)
    if "rope" in skip:
        from diffulex.kernels import attention_op

        attention_op.qk_norm_rope_store = lambda q, k, *args: (q, k)
    if "attnkernel" in skip:
        from diffulex.kernels import attention_op

        attention_op.triton_paged_attention = lambda q, *args, **kwargs: q


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


def _attention_keys(min_keys: int | None, prefetch_keys: int | None) -> None:
    """The fewest keys per attention split and the keys each program prefetches, replacing the built-in ones."""
    from diffulex.kernels import attention_op, paged_attention

    if min_keys is not None:
        attention_op.triton_paged_attention = functools.partial(
            paged_attention.triton_paged_attention, min_split_keys=min_keys
        )
    if prefetch_keys is not None:
        paged_attention._PREFETCH_KEYS = prefetch_keys


def _release_early(shapes: list[str], prefetch_mb: float | None) -> None:
    """The skinny GEMMs of these weight shapes (``N,K``; ``all``: every one) let the next kernels start at their
    beginning rather than after their weight stream; `prefetch_mb` replaces the L2 prefetch budget per matrix."""
    from diffulex.kernels import skinny_gemm

    if prefetch_mb is not None:
        skinny_gemm._PREFETCH_BUDGET_BYTES = int(prefetch_mb * (1 << 20))
    if not shapes:
        return
    wanted = {_shape(item) for item in shapes if item != "all"}
    launch = skinny_gemm._launch

    def early(x, weight, bias, config, output, release_early=False, readers=None, out=None):
        release_early = release_early or "all" in shapes or tuple(weight.shape) in wanted
        return launch(x, weight, bias, config, output, release_early, readers, out)

    skinny_gemm._launch = early


def _prefetch_for(items: list[str]) -> None:
    """The L2 prefetch budget of the skinny GEMMs of single weight shapes (``N,K=MB``), the others unchanged."""
    from diffulex.kernels import skinny_gemm

    if not items:
        return
    budgets = {}
    for item in items:
        shape, mb = item.split("=")
        budgets[_shape(shape)] = int(float(mb) * (1 << 20))
    launch = skinny_gemm._launch

    def with_budget(x, weight, *args, **kwargs):
        default = skinny_gemm._PREFETCH_BUDGET_BYTES
        skinny_gemm._PREFETCH_BUDGET_BYTES = budgets.get(tuple(weight.shape), default)
        try:
            return launch(x, weight, *args, **kwargs)
        finally:
            skinny_gemm._PREFETCH_BUDGET_BYTES = default

    skinny_gemm._launch = with_budget


def _norm_warps(norm_warps: int | None, rope_warps: int | None) -> None:
    """Warps of the RMSNorm and of the q/k norm + rotary programs, replacing the built-in choice."""
    from diffulex.kernels import fused_norm

    if norm_warps is not None:
        fused_norm._norm_warps = lambda block_n: norm_warps
    if rope_warps is not None:
        fused_norm._QK_NORM_ROPE_WARPS = rope_warps


def _skip_combine(shapes: list[str]) -> None:
    from diffulex.kernels import skinny_gemm

    wanted = {_shape(item) for item in shapes}
    full = skinny_gemm.skinny_linear

    def patched(x, weight, bias=None, config=None):
        if tuple(weight.shape) in wanted and bias is None:
            parts = skinny_gemm.skinny_partials(x, weight, config)
            return parts.view(x.dtype)[0, :, : weight.shape[0]]  # right shape and dtype, wrong values
        return full(x, weight, bias, config)

    skinny_gemm.skinny_linear = patched


@triton.jit
def _prefetch_rows_kernel(w_ptr, n_rows, stride, LINES: tl.constexpr, LINE_ELEMS: tl.constexpr, BLOCK_R: tl.constexpr):
    release_dependents(True)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows = tl.minimum(rows, n_rows - 1).to(tl.int64)
    cols = tl.arange(0, LINES) * LINE_ELEMS
    prefetch_l2(w_ptr + rows[:, None] * stride + cols[None, :])
    wait_for_inputs(True)


def _lookahead(lines: int, target: str) -> None:
    from diffulex.models.dense import DenseAttention, DenseDecoderLayer

    layer_forward = DenseDecoderLayer.forward

    def layer_fwd(self, hidden, residual, rope, attn_meta, readers=None):
        w = self.mlp.gate_up.weight if target == "gate_up" else self.mlp.down_proj.weight
        self.self_attn._ahead = w
        return layer_forward(self, hidden, residual, rope, attn_meta, readers)

    def attn_fwd(self, x, rope, attn_meta, unsummed=False, readers=None):
        T = x.shape[0]
        q, k, v = self.qkv(x)
        w = self._ahead
        if w is not None and w.is_cuda and x.shape[0] <= 16:
            block_r = 32
            _prefetch_rows_kernel[(triton.cdiv(w.shape[0], block_r),)](
                w, w.shape[0], w.stride(0), LINES=lines, LINE_ELEMS=64, BLOCK_R=block_r, launch_pdl=True
            )
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attn(q, k, v, attn_meta, rope, self.q_norm, self.k_norm))

    DenseDecoderLayer.forward = layer_fwd
    DenseAttention.forward = attn_fwd


def decoding_engine(tmp: Path, model: str, data_dir: str) -> Diffulex:
    """A batch-1 engine over a random SDAR checkpoint of `model`'s geometry (block 4, buffer 1, graphs on) whose
    one request has settled into decode with plenty of tokens left: what the replay measurements run on."""
    path = write_sdar_checkpoint(tmp / model, model, data_dir)
    engine = Diffulex(str(path), block_size=4, buffer_size=1, max_num_reqs=1, max_model_len=1024, load_format="dummy")
    prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, 1, 128, 0)
    ids = {engine.add_request(p, _greedy(800)) for p in prompts}
    _admit_until_decoding(engine, [r for r in engine.scheduler.waiting if r.req_id in ids], 20)
    for _ in range(5):
        engine.step()
    return engine


def _gpu_events(run) -> list[tuple[float, float, str]]:
    """``(start, end, name)`` in us of every kernel and copy that `run` puts on the GPU, in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    return sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and not e.is_user_annotation
    )


def _step_events(engine, steps: int) -> list[tuple[float, float, str]]:
    """`_gpu_events` of `steps` whole engine steps, after a few untimed ones (graphs warm, continuations flowing)."""
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    return _gpu_events(lambda: [engine.step() for _ in range(steps)])


def chain_increments(engine, replays: int = 20, by_gemm: bool = False) -> list[tuple[str, float, float]]:
    """Per kernel name: calls per replay, and the mean of (its end - the previous kernel's end) in us, summed per
    replay. Kernels of a PDL chain overlap, but each ends after the one before it, so these increments add up to
    the replay and say what each launch costs the chain (not its own run time). ``by_gemm`` tells the skinny
    GEMMs of a dense layer apart by their place in it (q/k/v, o, gate_up, down; the SiLU-and-mul fused)."""
    graph = smallest_graph(engine)
    kernels = _gpu_events(lambda: [graph.replay() for _ in range(replays)])
    per_replay = len(kernels) // replays
    total: dict[str, list[float]] = {}
    for r in range(1, replays):  # the first replay has no predecessor on the timeline
        chunk = kernels[r * per_replay - 1 : (r + 1) * per_replay]
        gemms = 0
        for prev, cur in zip(chunk[:-1], chunk[1:], strict=True):
            name = cur[2].split("_kernel")[0][:40]
            if by_gemm and name == "_skinny":  # a layer's GEMMs in order: qkv, o, gate_up, down
                name = f"_skinny[{('qkv', 'o', 'gate_up', 'down')[gemms % 4]}]"
                gemms += 1
            total.setdefault(name, []).append(cur[1] - prev[1])
    rows = [(n, len(v) / (replays - 1), sum(v) / (replays - 1)) for n, v in total.items()]
    return sorted(rows, key=lambda row: -row[2])


def step_increments(engine, steps: int = 40) -> list[tuple[str, float, float]]:
    """`chain_increments` over whole engine steps (forward graph, sampling graph, the copy of the result and the
    idle time between them), per kernel or copy name: calls and microseconds per step. What a step costs beyond
    the forward graph's replay shows here (the LM head is a ``_skinny`` call too: one per sampling step)."""
    events = _step_events(engine, steps)
    total: dict[str, list[float]] = {}
    reached = events[0][1]  # the latest end so far: each event is charged only for what it adds past it
    for _start, end, name in events[1:]:
        total.setdefault(name.split("_kernel")[0][:40], []).append(max(0.0, end - reached))
        reached = max(reached, end)
    rows = [(n, len(v) / steps, sum(v) / steps) for n, v in total.items()]
    return sorted(rows, key=lambda row: -row[2])


def step_sequence(engine, steps: int = 3) -> list[str]:
    """The GPU's events over a few whole steps, in order, with each one's critical-path increment; the decoder
    layers' kernels collapsed into one line per run of them, so what a step does around its layers shows."""
    layer_kernels = ("_skinny", "_rms_norm", "_qk_norm_rope", "_paged_attention", "_attention")
    events = _step_events(engine, steps)
    lines: list[str] = []
    reached = events[0][1]
    run: list[float] = []
    for start, end, name in events[1:]:
        increment, gap = max(0.0, end - reached), start - reached
        reached = max(reached, end)
        if name.startswith(layer_kernels) and not (name.startswith("_skinny") and end - start > 100):
            run.append(increment)
            continue
        if run:
            lines.append(f"[{len(run)} layer kernels] +{sum(run):.1f}")
            run = []
        lines.append(f"{name[:90]} gap={gap:.1f} +{increment:.1f} (runs {end - start:.1f})")
    if run:
        lines.append(f"[{len(run)} layer kernels] +{sum(run):.1f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.7b")
    ap.add_argument("--skip", default="", help="comma-separated: norm, silu, attn, rope, attnkernel")
    ap.add_argument("--table", nargs="*", default=[])
    ap.add_argument("--attn-splits", type=int)
    ap.add_argument("--attn-min-keys", type=int, help="fewest keys per attention split (a multiple of 64)")
    ap.add_argument("--attn-prefetch-keys", type=int, help="cached keys per attention program prefetched (power of 2)")
    ap.add_argument("--lookahead", type=int, default=0, help="L2 lines per gate_up row prefetched during attention")
    ap.add_argument("--lookahead-target", default="gate_up")
    ap.add_argument("--release-early", nargs="*", default=[], help="weight shapes N,K (or all) releasing at once")
    ap.add_argument("--prefetch-mb", type=float, help="L2 prefetch budget per matrix, MB")
    ap.add_argument("--prefetch-for", nargs="*", default=[], help="per weight shape: N,K=MB of L2 prefetch")
    ap.add_argument("--norm-warps", type=int, help="warps per RMSNorm program")
    ap.add_argument("--rope-warps", type=int, help="warps per q/k norm + rotary program")
    ap.add_argument("--partials", nargs="*", default=[], help="weight shapes N,K whose split sum is skipped")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--data-dir", default="tests/data/sdar-4b-chat")
    ap.add_argument("--tag", default="")
    ap.add_argument("--timeline", action="store_true", help="also print each kernel's critical-path increment")
    ap.add_argument("--by-gemm", action="store_true", help="with --timeline: one row per projection of a layer")
    ap.add_argument("--step-timeline", action="store_true", help="the same over whole steps (both graphs, copies)")
    ap.add_argument("--step-sequence", action="store_true", help="a few steps' events in order, layers collapsed")
    args = ap.parse_args()
    skip = {s for s in args.skip.split(",") if s}
    _remove(skip)
    _override(args.table, args.attn_splits)
    _attention_keys(args.attn_min_keys, args.attn_prefetch_keys)
    _skip_combine(args.partials)
    _release_early(args.release_early, args.prefetch_mb)
    _prefetch_for(args.prefetch_for)
    _norm_warps(args.norm_warps, args.rope_warps)
    if args.lookahead:
        _lookahead(args.lookahead, args.lookahead_target)
    with tempfile.TemporaryDirectory() as tmp:
        engine = decoding_engine(Path(tmp), args.model, args.data_dir)
        replay = replay_cost(engine, 50)["replay GPU (back to back)"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
        step = 1e3 * (time.perf_counter() - t0) / args.steps
        tags = f"skip={sorted(skip)} partials={args.partials} lookahead={args.lookahead} table={args.table}"
        tags += f" release_early={args.release_early} prefetch_mb={args.prefetch_mb} prefetch_for={args.prefetch_for}"
        tags += f" norm_warps={args.norm_warps} rope_warps={args.rope_warps} attn_splits={args.attn_splits}"
        tags += f" attn_min_keys={args.attn_min_keys} attn_prefetch_keys={args.attn_prefetch_keys}"
        print(f"WHATIF {args.model} {args.tag} {tags} replay_ms={replay:.3f} step_ms={step:.3f}")
        if args.timeline:
            for name, calls, us in chain_increments(engine, by_gemm=args.by_gemm):
                print(f"CHAIN {name:40s} calls={calls:5.1f} us_per_replay={us:8.1f} us_per_call={us / calls:6.2f}")
        if args.step_timeline:
            for name, calls, us in step_increments(engine):
                print(f"STEP {name:40s} calls={calls:5.1f} us_per_step={us:8.1f} us_per_call={us / calls:6.2f}")
        if args.step_sequence:
            for line in step_sequence(engine):
                print(f"SEQ {line}")
        engine.exit()


if __name__ == "__main__":
    main()

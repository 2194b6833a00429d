"""``diffulex bench throughput``: decode speed of the engine on real SDAR (and Fast-dLLM v2) geometries, against the
hardware floors.

For every (model, batch size, buffer size) the engine runs the sweep's strategy (``--strategy``: ``multi_bd`` with
block 4 by default; ``fast_dllm_v2`` with sub-blocks of 8, 4 per block, its block cache on and off), greedy,
``ignore_eos``, on fixed random prompts, and only decode steps are timed: the steps that contain any prompt
computation (every request's first forward, and the steps while the batch is still being admitted) run before the
timed region, which starts with all requests running and ends after the step in which the first request finishes
(or at the step or time budget), so every timed step carries the whole batch. The region is bracketed by device
synchronizations; each step is also timed on the host for the median (a step ends in a device-to-host copy of the
sampled tokens, so host time per step is device time per step).

Each timed step is compared with its floors (`diffulex.bench.roofline`): the bytes it must move over the measured
copy bandwidth and the flops it must do over the measured matmul throughput (`diffulex.bench.hardware`). The
models need no download: `write_sdar_checkpoint` writes folders with the real SDAR ``config.json`` geometry and the
real Qwen tokenizer (`write_fast_dllm_v2_checkpoint` the Fast-dLLM-v2-7B geometry), and the engine fills them with
random weights (``load_format="dummy"``). Random weights are not confident, so about one token per running block is
accepted per step: TPF is a lower bound of a trained model's, while milliseconds per step, which depend only on
shapes, are representative.

A ``fast_dllm_v2`` step's rows are not the cached tail of each request (a refinement computes one sub-block and reads
the rest of its block from the cache), so its work is read from each request's state just before the step
(`_fdv2_request_work`); that bookkeeping is timed apart and taken out of the step time (the device is idle then: a
step ends by reading its result).
"""

from __future__ import annotations

import contextlib
import gc
import json
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffulex.bench.hardware import HardwarePeaks, add_matmul_peak, measure_peaks, time_linear
from diffulex.bench.roofline import (
    CostModel,
    Floors,
    ModelGeometry,
    StepWork,
    block_causal_pairs,
    cost_model_from_module,
    linear_roofline,
    step_bytes,
    step_experts,
    step_floors,
    step_flops,
    summarize_floors,
)

# Geometry changes applied to the real SDAR-4B-Chat config.json (Qwen3-1.7B / Qwen3-8B shapes; 4B as it is).
SDAR_SIZES: dict[str, dict[str, Any]] = {
    "1.7b": {
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "max_window_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "4b": {},
    "8b": {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "max_window_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
    # SDAR-30B-A3B (SDAR-MoE): Qwen3-30B-A3B's shapes, 128 experts of 768, 8 per token, in every layer; 61 GB of
    # bf16 weights, of which a batch-1 step of 4 rows reads about 16 GB (29 distinct experts per layer)
    "30b-a3b": {
        "model_type": "sdar_moe",
        "architectures": ["SDARMoeForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "max_window_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    },
}
# LLaDA2 geometries with random weights: the tiny LLaDA2 tokenizer (the Ling one is not available offline) and the
# real sizes; `write_llada2_checkpoint` writes them.
LLADA2_SIZES: dict[str, dict[str, Any]] = {
    "llada2-mini": {
        "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 128, "intermediate_size": 5120, "moe_intermediate_size": 512, "num_experts": 256,
        "num_experts_per_tok": 8, "num_shared_experts": 1, "n_group": 8, "topk_group": 4,
        "routed_scaling_factor": 2.5, "first_k_dense_replace": 1, "partial_rotary_factor": 0.5, "rotary_dim": 64,
        "vocab_size": 157184, "max_position_embeddings": 32768, "torch_dtype": "bfloat16",
    },
}  # fmt: skip
# Fast-dLLM-v2-7B (Qwen2.5-7B shapes): `write_fast_dllm_v2_checkpoint` writes it with the real Qwen2 tokenizer.
FDV2_SIZES: dict[str, dict[str, Any]] = {
    "fdv2-7b": {
        "hidden_size": 3584, "num_hidden_layers": 28, "max_window_layers": 28, "num_attention_heads": 28,
        "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064, "tie_word_embeddings": False,
        "max_position_embeddings": 32768, "torch_dtype": "bfloat16", "layer_types": ["full_attention"] * 28,
    },
}  # fmt: skip
# The strategies the sweep runs: (block size, buffer sizes) by default. Fast-dLLM v2's block is a buffer of
# sub-blocks (its checkpoints are trained with blocks of 32 = 4 sub-blocks of 8).
STRATEGY_DEFAULTS: dict[str, tuple[int, list[int]]] = {"multi_bd": (4, [1, 2]), "fast_dllm_v2": (8, [4])}


# ----- checkpoint folders ------------------------------------------------------------------------------------


def write_sdar_checkpoint(path: str | Path, size: str, data_dir: str | Path | None = None) -> Path:
    """Write a weightless SDAR checkpoint folder of `size` (``1.7b``, ``4b``, ``8b``) into `path`; returns it.

    ``config.json`` is the real SDAR-4B-Chat config with the geometry of `size` (`SDAR_SIZES`), and the tokenizer
    files are the real Qwen ones (`diffulex.testing.write_qwen_tokenizer`), both read from `data_dir`, else from
    the source checkout's ``tests/data/sdar-4b-chat``. Load it with ``load_format="dummy"``.
    """
    from diffulex.testing.checkpoints import sdar_reference_dir, write_qwen_tokenizer

    if size not in SDAR_SIZES:
        raise ValueError(f"size={size!r} is invalid: must be one of {', '.join(SDAR_SIZES)}")
    path = Path(path)
    source = Path(data_dir) if data_dir is not None else sdar_reference_dir()
    try:
        template = json.loads((source / "config.json").read_text(encoding="utf-8"))
        write_qwen_tokenizer(path, "sdar", source)
    except FileNotFoundError:
        raise ValueError(
            f"data_dir={str(source)!r} holds no SDAR-4B-Chat config.json and tokenizer files: pass --data-dir DIR, "
            "a folder with them (a download of JetLM/SDAR-4B-Chat without its weights, or a source checkout's "
            "tests/data/sdar-4b-chat)"
        ) from None
    if (source / "generation_config.json").is_file():
        (path / "generation_config.json").write_bytes((source / "generation_config.json").read_bytes())
    config = {**template, **SDAR_SIZES[size]}
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


def write_fast_dllm_v2_checkpoint(path: str | Path, size: str, data_dir: str | Path | None = None) -> Path:
    """Write a weightless Fast-dLLM v2 checkpoint folder of `size` (`FDV2_SIZES`) into `path`; returns it.

    ``config.json`` has every key of the published Fast-dLLM v2 config (written as `write_tiny_checkpoint` writes
    the family's) with the geometry of `size` and the real special-token ids; the tokenizer is the real Qwen2.5 one
    with Fast-dLLM v2's mask token (`diffulex.testing.write_qwen_tokenizer`), read from `data_dir`, else from the
    source checkout's ``tests/data/sdar-4b-chat``. Load it with ``load_format="dummy"``.
    """
    from diffulex.testing.checkpoints import (
        qwen_special_token_ids,
        sdar_reference_dir,
        write_qwen_tokenizer,
        write_tiny_checkpoint,
    )

    if size not in FDV2_SIZES:
        raise ValueError(f"size={size!r} is invalid: must be one of {', '.join(FDV2_SIZES)}")
    path = Path(path)
    source = Path(data_dir) if data_dir is not None else sdar_reference_dir()
    try:
        write_qwen_tokenizer(path, "fast_dllm_v2", source)
    except FileNotFoundError:
        raise ValueError(
            f"data_dir={str(source)!r} holds no Qwen tokenizer files: pass --data-dir DIR, a folder with "
            "SDAR-4B-Chat's tokenizer files (a source checkout's tests/data/sdar-4b-chat)"
        ) from None
    ids = qwen_special_token_ids("fast_dllm_v2")
    eot, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_checkpoint(Path(tmp) / "tiny", family="fast_dllm_v2")
        config = json.loads((tiny / "config.json").read_text(encoding="utf-8"))
        generation = json.loads((tiny / "generation_config.json").read_text(encoding="utf-8"))
    config.update(FDV2_SIZES[size], bos_token_id=eot, eos_token_id=im_end, pad_token_id=im_end)
    generation.update(bos_token_id=eot, eos_token_id=[im_end, eot], pad_token_id=eot)
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    return path


# ----- settings ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelEntry:
    """One checkpoint to measure: a generated SDAR geometry or a folder given with ``--model``."""

    name: str
    path: str
    load_format: str
    size: str | None = None  # the SDAR size of a generated folder (its path is a temporary directory)


@dataclass
class ThroughputSettings:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32, 128])
    buffer_sizes: list[int] | None = None  # None: the strategy's (`STRATEGY_DEFAULTS`)
    prompt_len: int = 128
    max_tokens: int = 256
    block_size: int | None = None  # None: the strategy's
    strategy: str = "multi_bd"
    block_cache: list[bool] | None = None  # fast_dllm_v2: the block cache settings swept (None: on, then off)
    seed: int = 0
    max_seconds: float = 60.0  # timed decode region per configuration
    max_steps: int | None = None  # timed decode steps per configuration
    warmup_tokens: int = 16
    profile_batch: int | None = None  # None = no profile
    profile_steps: int = 20
    roofline_batches: list[int] | None = None  # None = no linear roofline
    quick: bool = False
    engine_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from diffulex.validation import check_int, check_number, invalid_value

        if self.strategy not in STRATEGY_DEFAULTS:
            raise invalid_value("strategy", self.strategy, f"must be one of {', '.join(STRATEGY_DEFAULTS)}")
        default_block, default_buffers = STRATEGY_DEFAULTS[self.strategy]
        if self.buffer_sizes is None:
            self.buffer_sizes = list(default_buffers)
        if self.block_cache is not None and self.strategy != "fast_dllm_v2":
            raise invalid_value("block_cache", self.block_cache, "only fast_dllm_v2 has a block cache to sweep")
        if self.block_cache is not None and not self.block_cache:
            raise ValueError("block_cache is empty: give on and/or off")
        named = self.engine_overrides.get("decoding_strategy")
        if named in STRATEGY_DEFAULTS:  # strategies the harness knows are measured by their own step accounting
            raise ValueError(f"--decoding-strategy {named}: use --strategy {named}")
        for name in ("batch_sizes", "buffer_sizes", *(("roofline_batches",) if self.roofline_batches else ())):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"{name} is empty: give at least one value")
            for v in values:
                check_int(name, v, low=1)
        for name in ("prompt_len", "max_tokens", "warmup_tokens", "profile_steps"):
            check_int(name, getattr(self, name), low=1)
        if self.max_steps is not None:
            check_int("max_steps", self.max_steps, low=1)
        if self.profile_batch is not None:
            check_int("profile_batch", self.profile_batch, low=1)
        check_number("max_seconds", self.max_seconds, low=0.0, low_open=True)
        if "buffer_size" in self.engine_overrides:
            raise ValueError("--buffer-size is set by the sweep: use --buffer-sizes")
        if self.engine_overrides.get("block_size") is not None:  # --block-size: the engine's and the floors' block
            self.block_size = self.engine_overrides["block_size"]
        if self.block_size is None:
            self.block_size = default_block
        check_int("block_size", self.block_size, low=1)

    @property
    def strategy_variants(self) -> list[dict[str, Any]]:
        """The strategy options each (model, buffer size) runs with: one empty set, or Fast-dLLM v2's block cache
        on and off."""
        if self.strategy != "fast_dllm_v2":
            return [{}]
        caches = self.block_cache if self.block_cache is not None else [True, False]
        return [{"fdv2_use_block_cache": on} for on in caches]

    @property
    def max_model_len(self) -> int:
        """Room for the prompt, the answer (or the profile's steps) and one block of slack."""
        profile_tokens = (self.profile_steps + 8) * self.block_size * max(self.buffer_sizes)
        return self.prompt_len + max(self.max_tokens, profile_tokens if self.profile_batch else 0) + self.block_size

    def engine_fields(
        self, entry: ModelEntry, buffer_size: int, options: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "decoding_strategy": self.strategy,
            "block_size": self.block_size,
            "buffer_size": buffer_size,
            "max_num_reqs": max(self.batch_sizes + ([self.profile_batch] if self.profile_batch else [])),
            "max_model_len": self.max_model_len,
            "max_num_batched_tokens": max(4096, self.max_model_len),
            "load_format": entry.load_format,
            "seed": self.seed,
        }
        if options:
            fields["strategy_options"] = dict(options)
        fields.update(self.engine_overrides)
        return fields


# ----- one configuration -------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_prompts(vocab_limit: int, mask_token_id: int, batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """Fixed random token prompts (the mask token replaced by 0), the same for every run with the same seed."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_limit, (batch, prompt_len), generator=gen)
    ids[ids == mask_token_id] = 0
    return ids.tolist()


def _greedy(max_tokens: int) -> Any:
    from diffulex.sampling_params import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _admit_until_decoding(engine: Any, requests: Sequence[Any], step_limit: int) -> int:
    """Step until every request has done its first forward (its prompt is cached); returns the steps taken."""
    from diffulex.strategy.request import RequestStatus

    steps = 0
    while not all(r.nfe >= 1 and r.status is RequestStatus.RUNNING for r in requests):
        if any(r.is_finished for r in requests):
            raise RuntimeError("a request finished before the batch reached decode: raise --max-tokens")
        if steps >= step_limit:
            running = sum(r.status is RequestStatus.RUNNING for r in requests)
            raise RuntimeError(
                f"only {running} of {len(requests)} requests could run at once after {steps} steps (KV cache too "
                "small for this batch?)"
            )
        engine.step()
        steps += 1
    return steps


def _step_work(records: Sequence[tuple[Any, Any, int, int]], block_size: int, mask_token_id: int) -> StepWork:
    """The work of one step from its records: ``(request, record, cached tokens before, cached tokens after)``."""
    total = StepWork(0, 0, 0, 0, 0)
    for req, record, before, after in records:
        context = before - (1 if req.settings.logits_shift and before > 0 else 0)
        end = context + record.query_len
        ids = record.running_block_ids
        lo = req.blocks[ids[0]].start if ids else end
        tokens = record.running_token_ids
        first, last = max(lo, req.prompt_len), min(end, req.decode_limit, lo + len(tokens))
        still_masked = sum(1 for p in range(first, last) if tokens[p - lo] == mask_token_id)
        total = total + StepWork(
            query_tokens=record.query_len,
            logit_rows=still_masked + record.num_new_tokens,
            context_tokens=context,
            written_tokens=max(0, after - before),
            attn_pairs=block_causal_pairs(context, end, block_size),
        )
    return total


def _keys_seen(start: int, end: int, key_end: int, block_size: int) -> int:
    """(query, key) pairs of rows ``[start, end)`` whose keys run to the end of their block, capped at ``key_end``
    (a refinement's rows see the cached rest of their block past ``end``)."""
    pairs, p = 0, start
    while p < end:
        block_end = (p // block_size + 1) * block_size
        rows_end = min(block_end, end)
        pairs += (rows_end - p) * min(block_end, key_end)
        p = rows_end
    return pairs


def _fdv2_request_work(req: Any) -> StepWork:
    """What a Fast-dLLM v2 request's next forward computes, read from its state before the step as the model runner
    reads it (`ModelRunner.collect`): its rows, the cached keys it reads (prefix and, for a refinement, the rest of
    its block), the K/V it stores and the masks it samples."""
    size = req.settings.block_size
    start, end = req.query_range()
    key_end = max(end, req.keys_end() or end)
    written = sum(
        min(end, b.end) - max(start, b.start) for b in req.blocks[start // size : -(-end // size)] if req.stores_kv(b)
    )
    return StepWork(
        query_tokens=end - start,
        logit_rows=sum(len(t.positions) for t in req.sample_targets()),
        context_tokens=start + key_end - end,
        written_tokens=written,
        attn_pairs=_keys_seen(start, end, key_end, size),
    )


# Strategies whose step work is read from the requests' state before each step (see the module docstring).
_REQUEST_WORK: dict[str, Callable[[Any], StepWork]] = {"fast_dllm_v2": _fdv2_request_work}


def measure_decode(
    engine: Any,
    batch: int,
    settings: ThroughputSettings,
    cost: CostModel,
    peaks: HardwarePeaks,
    flops_per_s: float,
    count_experts: bool = False,
) -> dict[str, Any]:
    """Warm up, admit `batch` requests, then time decode steps (see the module docstring for what is counted).

    ``count_experts`` (an MoE model): after the timed region the same requests run again, eagerly and untimed,
    with the experts each MoE layer selects recorded (`diffulex.bench.expert_use`); step ``i`` of that re-run gives
    the experts timed step ``i`` read, and the floors are taken on those counts. The uniform-routing floors stay
    beside them (``uniform_*``)."""
    device = engine.device
    prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, batch, settings.prompt_len, settings.seed)
    engine.generate(prompts, _greedy(settings.warmup_tokens), use_tqdm=False)

    ids = [engine.add_request(p, _greedy(settings.max_tokens)) for p in prompts]
    wanted = set(ids)
    requests = [r for r in engine.scheduler.waiting if r.req_id in wanted]
    by_id = {r.req_id: r for r in requests}
    prefill_steps = _admit_until_decoding(engine, requests, step_limit=4 * batch + 16)

    step_times: list[float] = []
    # per step: (req_id, record) of each update, and the cached tokens of each request before the step. Only the
    # records are kept: holding the updates' answer lists would give the collector work the engine does not make
    raw: list[tuple[list[tuple[int, Any]], list[int]]] = []
    stopped_by = "request_finished"
    gc_pauses: list[float] = []  # collector pauses inside the timed region (a cause of slow outlier steps)
    gc_started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            gc_started[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_started[0])

    request_work = _REQUEST_WORK.get(settings.strategy)
    planned: dict[int, StepWork] = {}  # id(record) -> the work its request's forward did (`_REQUEST_WORK`)
    bookkeeping = 0.0  # seconds spent reading that work: taken out of the timed region

    _sync(device)
    gc.callbacks.append(on_gc)
    continued = getattr(engine, "num_continuations", 0)
    replays = graph_replays(engine)
    t0 = time.perf_counter()
    while True:
        before = [r.num_cached_tokens for r in requests]  # the only bookkeeping inside the region (~0.2 us each)
        if request_work is not None:
            tb = time.perf_counter()
            plans = {r.req_id: request_work(r) for r in requests if not r.is_finished}
            bookkeeping += time.perf_counter() - tb
        ts = time.perf_counter()
        updates = engine.step()
        step_times.append(time.perf_counter() - ts)
        raw.append(([(u.req_id, u.record) for u in updates if u.record is not None], before))
        if request_work is not None:
            planned.update((id(u.record), plans[u.req_id]) for u in updates if u.record is not None)
        if any(u.finished for u in updates):
            break
        if settings.max_steps is not None and len(step_times) >= settings.max_steps:
            stopped_by = "max_steps"
            break
        if time.perf_counter() - t0 >= settings.max_seconds:
            stopped_by = "max_seconds"
            break
    _sync(device)
    elapsed = time.perf_counter() - t0 - bookkeeping
    gc.callbacks.remove(on_gc)
    continued = getattr(engine, "num_continuations", 0) - continued
    engine_steps = len(step_times)
    replays = None if replays is None else graph_replays(engine) - replays
    raw, step_times = _rounds(raw, step_times, engine.config.micro_batches)
    final = [r.num_cached_tokens for r in requests]
    preemptions = sum(r.num_preemptions for r in requests)
    timed_tokens = [list(r.token_ids) for r in requests]
    for rid in ids:
        engine.abort_request(rid)

    # Everything below runs after the timed region: none of it is in the measured time.
    index = {r.req_id: i for i, r in enumerate(requests)}
    works: list[StepWork] = []
    tokens = request_forwards = 0
    partial_steps = 0
    for k, (step_records, before) in enumerate(raw):
        after = raw[k + 1][1] if k + 1 < len(raw) else final
        records = [
            (by_id[req_id], record, before[index[req_id]], after[index[req_id]]) for req_id, record in step_records
        ]
        if request_work is not None:
            works.append(sum((planned[id(record)] for _, record, _, _ in records), StepWork(0, 0, 0, 0, 0)))
        else:
            works.append(_step_work(records, settings.block_size, engine.mask_token_id))
        tokens += sum(record.num_new_tokens for _, record in step_records)
        request_forwards += len(records)
        partial_steps += len(records) != batch
    steps = len(step_times)
    mean_s = elapsed / steps
    by_rows: dict[int, list[float]] = {}
    for work, seconds in zip(works, step_times, strict=False):
        by_rows.setdefault(work.query_tokens, []).append(seconds)
    uniform = [step_floors(cost, w, peaks.copy_bandwidth_bps, flops_per_s) for w in works]
    floors: list[Floors] = uniform
    experts_read = [step_experts(cost, w) for w in works]
    counted: dict[str, Any] = {}
    if count_experts and cost.moe_layers:
        if engine.config.micro_batches != 1:
            counted["expert_count_error"] = "experts are counted with micro_batches=1 only"
        else:
            t_count = time.perf_counter()
            try:
                counted = _count_experts(engine, prompts, settings, engine_steps, timed_tokens, works)
            except Exception as err:  # noqa: BLE001  (the timed row stands on the uniform floor; say why)
                counted = {"expert_count_error": f"{type(err).__name__}: {err}"}
            counted["expert_count_s"] = time.perf_counter() - t_count  # the untimed re-run's wall time
        per_step = counted.pop("per_step", None)
        if per_step is not None:
            experts_read = [float(sum(layers)) for layers in per_step]
            floors = [
                step_floors(cost, w, peaks.copy_bandwidth_bps, flops_per_s, n)
                for w, n in zip(works, experts_read, strict=True)
            ]
            counted.update({f"uniform_{k}": v for k, v in summarize_floors(mean_s, uniform).items()})
            counted["uniform_bytes_per_step"] = sum(step_bytes(cost, w) for w in works) / steps
    moe = {}
    if cost.moe_layers:
        moe = {
            # distinct experts read per step, summed over the MoE layers: counted where `count_experts` counted
            # them, else the uniform estimate
            "experts_read_per_step": sum(experts_read) / steps,
            "experts_counted": "experts_per_layer" in counted,
            "uniform_experts_read_per_step": sum(step_experts(cost, w) for w in works) / steps,
        }
    return {
        "prefill_steps": prefill_steps,
        "steps": steps,
        "stopped_by": stopped_by,
        "partial_steps": partial_steps,
        "continued_steps": continued,  # launched before the previous step's result (`async_scheduling`)
        "engine_steps": engine_steps,
        "graph_replays": replays,  # launches served by captured CUDA graphs (None: the runner has none)
        "preemptions": preemptions,
        "ms_per_step_mean": 1e3 * mean_s,
        "ms_per_step_p50": 1e3 * statistics.median(step_times),
        "ms_per_step_p90": 1e3 * _percentile(step_times, 0.9),
        "ms_per_step_max": 1e3 * max(step_times),
        "slowest_step": step_times.index(max(step_times)),
        "gc_pauses": len(gc_pauses),
        "gc_ms": 1e3 * sum(gc_pauses),
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "tpf": tokens / max(request_forwards, 1),
        "nfe_per_request": request_forwards / batch,  # forwards each request ran in the timed region
        "ms_per_token": 1e3 * elapsed / max(tokens, 1),
        "query_tokens_per_step": sum(w.query_tokens for w in works) / steps,
        # steps grouped by the rows they computed: which step shapes the mean's excess comes from (a strategy whose
        # steps differ in rows, such as Fast-dLLM v2's whole-block and sub-block forwards)
        "ms_per_step_by_rows": {
            rows: {"steps": len(times), "ms_mean": 1e3 * statistics.fmean(times)}
            for rows, times in sorted(by_rows.items())
        },
        "logit_rows_per_step": sum(w.logit_rows for w in works) / steps,
        "context_tokens_per_step": sum(w.context_tokens for w in works) / steps,
        "bytes_per_step": sum(step_bytes(cost, w, n) for w, n in zip(works, experts_read, strict=True)) / steps,
        "flops_per_step": sum(step_flops(cost, w) for w in works) / steps,
        **summarize_floors(mean_s, floors),
        **moe,
        **counted,
    }


def _count_experts(
    engine: Any,
    prompts: list[list[int]],
    settings: ThroughputSettings,
    steps: int,
    timed_tokens: list[list[int]],
    works: Sequence[StepWork],
) -> dict[str, Any]:
    """The experts each timed step's MoE layers selected, from an eager re-run of the same requests (the module
    docstring of `diffulex.bench.expert_use` says why not in the timed steps).

    The engine keeps one step in flight: once the batch is admitted, the step launched last is the twin of the
    first timed step, and each later call launches the next, one forward each (checked against the runner's
    launch count). Returns ``per_step`` (``[step][layer]`` counts, None where the re-run could not give them, with
    ``expert_count_error`` saying why), the mean per layer, and whether the re-run computed the timed steps' rows
    and decoded the same tokens where both decoded one (float rounding between graphed and eager kernels may
    flip a near tie, and the steps after it differ slightly)."""
    from diffulex.bench.expert_use import ExpertUseRecorder, without_graphs

    runner = engine.runner
    engine.step()  # apply the timed region's last launch (its requests were aborted): none is in flight now
    ids = [engine.add_request(p, _greedy(settings.max_tokens)) for p in prompts]
    wanted = set(ids)
    requests = [r for r in engine.scheduler.waiting if r.req_id in wanted]
    recorder = ExpertUseRecorder(engine.model)
    try:
        with without_graphs(runner), recorder:
            launched = getattr(runner, "launched_steps", None)
            _admit_until_decoding(engine, requests, step_limit=4 * len(prompts) + 16)
            first = recorder.forwards - 1
            for _ in range(steps - 1):
                engine.step()
            launches = None if launched is None else runner.launched_steps - launched
        replay_tokens = [list(r.token_ids) for r in requests]
    finally:
        for rid in ids:
            engine.abort_request(rid)
    result: dict[str, Any] = {"per_step": None}
    if launches is not None and launches != recorder.forwards:
        result["expert_count_error"] = f"{launches} launches ran {recorder.forwards} MoE forwards, not one each"
        return result
    if first < 0 or recorder.forwards < first + steps:
        result["expert_count_error"] = f"the re-run ran {max(recorder.forwards - first, 0)} of the {steps} steps"
        return result
    per_step = recorder.counts()[first : first + steps]
    rows = recorder.rows[first : first + steps]
    mask = engine.mask_token_id
    agree = all(
        a == b for timed, again in zip(timed_tokens, replay_tokens, strict=True)
        for a, b in zip(timed, again, strict=False) if a != mask and b != mask
    )  # fmt: skip
    layers = len(per_step[0])
    result.update({
        "per_step": per_step,
        "experts_per_layer": sum(map(sum, per_step)) / (steps * layers),
        "experts_per_layer_min": min(map(min, per_step)),
        "experts_per_layer_max": max(map(max, per_step)),
        "expert_count_steps": steps,
        "expert_rerun_rows_agree": rows == [w.query_tokens for w in works],
        "expert_rerun_tokens_agree": agree,
    })  # fmt: skip
    return result


def step_paths(engine: Any) -> tuple[int, int] | None:
    """``(steps launched, of them through the eager forward)`` by the engine's runner so far (None for a runner
    that does not count them): two readings around a phase give the share of its steps on the graph path."""
    runner = engine.runner
    launched, eager = getattr(runner, "launched_steps", None), getattr(runner, "eager_steps", None)
    return (launched, eager) if isinstance(launched, int) and isinstance(eager, int) else None


def graphed_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of the steps launched between two `step_paths` readings that ran on the graph path (None when
    the runner does not count, or no step ran)."""
    if before is None or after is None or after[0] == before[0]:
        return None
    return 1.0 - (after[1] - before[1]) / (after[0] - before[0])


def graph_replays(engine: Any) -> int | None:
    """Launches the engine's runner has served by replaying captured CUDA graphs so far (None for a runner that
    has no decode graphs to report on)."""
    count = getattr(engine.runner, "graph_replays", None)
    return count if isinstance(count, int) else None


def _rounds(
    raw: list[tuple[list[tuple[int, Any]], list[int]]], step_times: list[float], micro_batches: int
) -> tuple[list[tuple[list[tuple[int, Any]], list[int]]], list[float]]:
    """With micro-batches an engine step advances one share of the batch: count consecutive steps over disjoint
    requests as one step of the whole batch (a round: its records joined, its cached tokens as before its first
    part, its time the sum), so that milliseconds per step, bytes and floors mean what they mean without them.
    A step that meets a request already in the round starts the next round (with one request, every step)."""
    if micro_batches == 1:
        return raw, step_times
    rounds: list[tuple[list[tuple[int, Any]], list[int]]] = []
    times: list[float] = []
    seen: set[int] = set()
    for (records, before), seconds in zip(raw, step_times, strict=True):
        ids = {req_id for req_id, _ in records}
        if not rounds or ids & seen:
            rounds.append(([], before))
            times.append(0.0)
            seen = set()
        rounds[-1][0].extend(records)
        times[-1] += seconds
        seen |= ids
    return rounds, times


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def profile_decode(
    engine: Any, batch: int, settings: ThroughputSettings, max_tokens: int | None = None
) -> dict[str, Any]:
    """GPU busy/idle share over `settings.profile_steps` decode steps at `batch` (`diffulex.bench.gpu_profile`).
    Each request asks for ``max_tokens`` (None: enough for every profiled step to decode a whole block)."""
    from diffulex.bench.gpu_profile import profile_steps

    steps = settings.profile_steps
    prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, batch, settings.prompt_len, settings.seed + 1)
    if max_tokens is None:
        max_tokens = (steps + 8) * settings.block_size * engine.config.buffer_size
    ids = [engine.add_request(p, _greedy(max_tokens)) for p in prompts]
    wanted = set(ids)
    requests = [r for r in engine.scheduler.waiting if r.req_id in wanted]
    _admit_until_decoding(engine, requests, step_limit=4 * batch + 16)
    for _ in range(3):  # settle: graphs replayed, allocator warm
        engine.step()
    try:
        return profile_steps(engine.step, steps, engine.device)
    finally:
        for rid in ids:
            engine.abort_request(rid)


# ----- the sweep ---------------------------------------------------------------------------------------------


def _engine_dtype(device: torch.device, fields: Mapping[str, Any], config_json: Mapping[str, Any]) -> torch.dtype:
    """The dtype the engine will run in (the rule of `DiffulexEngine`): the ``dtype`` field, else float32 on
    CPU, else the checkpoint's ``torch_dtype``, else bfloat16. Known before loading, so peaks are measured first."""
    dtype = fields.get("dtype", "auto")
    if dtype != "auto":
        return getattr(torch, dtype)
    if device.type == "cpu":
        return torch.float32
    known = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    return known.get(str(config_json.get("torch_dtype")), torch.bfloat16)


def _device(overrides: Mapping[str, Any]) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    ids = overrides.get("device_ids") or []
    return torch.device("cuda", ids[0] if ids else overrides.get("device_start", 0))


def _close(engine: Any) -> None:
    """Abort what is left and drop the KV cache; after a failure the engine may be half-way through a step."""
    if engine is not None:
        with contextlib.suppress(Exception):
            engine.exit()


def _release(device: torch.device) -> None:
    """Return freed memory to the device once the last reference to an engine is gone (call it after dropping
    the engine and outside any ``except`` block, whose traceback would keep the engine's tensors alive)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def linear_roofline_rows(
    entry: ModelEntry, geometry: ModelGeometry, settings: ThroughputSettings, device: torch.device,
    dtype: torch.dtype, peaks: HardwarePeaks,
) -> list[dict[str, Any]]:
    """Time each linear shape of the model at M = batch x block size tokens and place it on the roofline."""
    flops_per_s = add_matmul_peak(peaks, device, dtype, settings.quick)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for batch in settings.roofline_batches or []:
        m = batch * settings.block_size
        for shape, (n, k) in geometry.linear_shapes().items():
            seconds = time_linear(m, n, k, device, dtype, iters=5 if settings.quick else 20)
            rows.append({"model": entry.name, "batch": batch, "m": m, "shape": shape, "n": n, "k": k,
                         **linear_roofline(m, n, k, itemsize, seconds, peaks.copy_bandwidth_bps, flops_per_s)})
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def variant_label(options: Mapping[str, Any]) -> str:
    """A short name of a configuration's strategy options for tables and plots ("" when it has none)."""
    if "fdv2_use_block_cache" in options:
        return "cache on" if options["fdv2_use_block_cache"] else "cache off"
    return ",".join(f"{k}={v}" for k, v in sorted(options.items()))


def _sweep_engine(
    entry: ModelEntry,
    buffer_size: int,
    options: Mapping[str, Any],
    settings: ThroughputSettings,
    device: torch.device,
    peaks: HardwarePeaks,
    results: list[dict[str, Any]],
    profiles: list[dict[str, Any]],
    log: Callable[[str], None],
    progress: list[int],
) -> None:
    """Every batch size of one (model, buffer size, strategy options) on one engine (a fresh one after a failure),
    then its profile if asked; rows go to `results` and `profiles`."""
    from diffulex import Diffulex

    variant = variant_label(options)
    named = f"{entry.name} buffer {buffer_size}" + (f" {variant}" if variant else "")
    fields = settings.engine_fields(entry, buffer_size, options)
    engine = None
    for batch in settings.batch_sizes:
        progress[0] += 1
        row: dict[str, Any] = {
            "model": entry.name, "load_format": entry.load_format, "strategy": settings.strategy,
            "variant": variant, "strategy_options": dict(options), "buffer_size": buffer_size, "batch": batch,
            "block_size": settings.block_size, "prompt_len": settings.prompt_len,
            "max_tokens": settings.max_tokens, "error": None,
        }  # fmt: skip
        log(f"[{progress[0]}/{progress[1]}] {named} batch {batch} ...")
        failure = None
        try:
            if engine is None:
                t0 = time.perf_counter()
                engine = Diffulex(entry.path, **fields)
                log(f"  engine ready in {time.perf_counter() - t0:.1f} s ({engine.dtype}, {engine.device})")
            itemsize = torch.empty((), dtype=engine.dtype).element_size()
            cost = cost_model_from_module(engine.model, itemsize)
            flops_per_s = add_matmul_peak(peaks, device, engine.dtype, settings.quick)
            row["dtype"] = str(engine.dtype).removeprefix("torch.")
            row["weight_bytes"] = cost.weight_bytes
            row["cuda_graphs"] = bool(engine.policy.cuda_graphs)
            row.update(measure_decode(engine, batch, settings, cost, peaks, flops_per_s))
            log("  " + format_row(row))
        except Exception as err:  # out of memory, a kernel failure: record it and go on
            failure = _error(err)
        if failure is not None:  # a fresh engine for the next configuration
            row["error"] = failure
            log(f"  failed: {failure}")
            _close(engine)
            engine = None
            _release(device)
        results.append(row)
    if settings.profile_batch is not None and device.type == "cuda":
        head = {"model": entry.name, "variant": variant, "buffer_size": buffer_size, "batch": settings.profile_batch}
        try:
            if engine is None:
                engine = Diffulex(entry.path, **fields)
            prof = {**head, **profile_decode(engine, settings.profile_batch, settings)}
            log("  " + format_profile(prof))
        except Exception as err:
            prof = {**head, "error": _error(err)}
            log(f"  profile failed: {prof['error']}")
        profiles.append(prof)
    elif settings.profile_batch is not None:
        log("  profile skipped: it reads GPU kernel times and this run has no CUDA device")
    _close(engine)
    engine = None  # the last reference: the next configuration's engine must find its memory returned
    _release(device)


def run_sweep(
    models: Sequence[ModelEntry], settings: ThroughputSettings, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Measure every (model, buffer size, batch size); a configuration that fails (out of memory, say) is recorded
    with its error and the sweep goes on with a fresh engine."""
    from diffulex.config import Config

    device = _device(settings.engine_overrides)
    configs = {}
    for entry in models:  # validate every configuration before spending time on any
        for buffer_size in settings.buffer_sizes:
            for options in settings.strategy_variants:
                configs[entry.name] = Config(entry.path, **settings.engine_fields(entry, buffer_size, options))
    dtypes = sorted(
        {_engine_dtype(device, settings.engine_overrides, c.model_config_dict) for c in configs.values()}, key=str
    )
    log(f"measuring peaks on {device} ({', '.join(str(d).removeprefix('torch.') for d in dtypes)}) ...")
    peaks = measure_peaks(device, dtypes, settings.quick)
    log(f"copy bandwidth {peaks.copy_bandwidth_bps / 1e9:.0f} GB/s, matmul "
        + ", ".join(f"{k} {v / 1e12:.3g} TFLOP/s" for k, v in peaks.matmul_flops_per_s.items()))

    results: list[dict[str, Any]] = []
    profiles: list[dict[str, Any]] = []
    rooflines: list[dict[str, Any]] = []
    total = len(models) * len(settings.buffer_sizes) * len(settings.strategy_variants) * len(settings.batch_sizes)
    progress = [0, total]  # configurations started, of all
    for entry in models:
        config_json = configs[entry.name].model_config_dict
        dtype = _engine_dtype(device, settings.engine_overrides, config_json)
        if settings.roofline_batches:
            try:
                geometry = ModelGeometry.from_config(config_json)
                rooflines += linear_roofline_rows(entry, geometry, settings, device, dtype, peaks)
                log(format_roofline([r for r in rooflines if r["model"] == entry.name]))
            except (ValueError, RuntimeError) as err:  # includes torch.OutOfMemoryError
                log(f"{entry.name}: linear roofline skipped: {_error(err)}")
            _release(device)
        for buffer_size in settings.buffer_sizes:
            for options in settings.strategy_variants:
                _sweep_engine(entry, buffer_size, options, settings, device, peaks, results, profiles, log, progress)
    return {
        "device": _device_info(device),
        "hardware": peaks.to_dict(),
        "settings": {**{k: v for k, v in asdict(settings).items() if k != "engine_overrides"},
                     "engine_overrides": settings.engine_overrides},
        "models": [asdict(m) | ({"path": None} if m.size else {}) for m in models],
        "results": results,
        "profile": profiles,
        "linear_roofline": rooflines,
    }


def _device_info(device: torch.device) -> dict[str, Any]:
    import platform

    cpu = f"cpu ({platform.processor() or platform.machine()})"
    return {
        "name": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cpu_threads": torch.get_num_threads(),
    }


# ----- output ------------------------------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_row(row: Mapping[str, Any]) -> str:
    if row.get("error"):
        return f"error: {row['error']}"
    return (
        f"{row['steps']} decode steps: {row['ms_per_step_mean']:.2f} ms/step (p50 {row['ms_per_step_p50']:.2f}, "
        f"p90 {row.get('ms_per_step_p90', float('nan')):.2f}, max {row.get('ms_per_step_max', float('nan')):.2f} "
        f"at step {row.get('slowest_step')}; gc {row.get('gc_pauses')} pauses, {row.get('gc_ms', 0.0):.1f} ms), "
        f"{row['tokens_per_s']:.0f} tok/s, TPF {row['tpf']:.2f}, NFE {row.get('nfe_per_request', 0):.1f} per "
        f"request; floors: memory {row['memory_floor_ms']:.3f} ms, "
        f"compute {row['compute_floor_ms']:.3f} ms -> {row['floor_ratio']:.2f}x the {row['bound']} floor"
    )


def format_table(results: Sequence[Mapping[str, Any]]) -> str:
    header = (f"{'model':<10} {'variant':<9} {'buf':>3} {'batch':>5} {'steps':>5} {'ms/step':>8} {'p50':>8} "
              f"{'tok/s':>9} {'TPF':>5} {'NFE':>5} {'mem ms':>8} {'comp ms':>8} {'x floor':>7} {'x mem':>6} "
              f"{'x comp':>7}")
    lines = [header, "-" * len(header)]
    for r in results:
        head = f"{r['model']:<10} {r.get('variant', ''):<9} {r['buffer_size']:>3} {r['batch']:>5}"
        if r.get("error"):
            lines.append(f"{head}  error: {r['error']}")
            continue
        lines.append(
            f"{head} {r['steps']:>5} {r['ms_per_step_mean']:>8.2f} {r['ms_per_step_p50']:>8.2f} "
            f"{r['tokens_per_s']:>9.0f} {r['tpf']:>5.2f} {r.get('nfe_per_request', 0):>5.1f} "
            f"{r['memory_floor_ms']:>8.3f} {r['compute_floor_ms']:>8.3f} {r['floor_ratio']:>7.2f} "
            f"{r['memory_floor_ratio']:>6.2f} {r['compute_floor_ratio']:>7.2f}"
        )
    return "\n".join(lines)


def format_profile(prof: Mapping[str, Any]) -> str:
    cats = ", ".join(f"{k} {v:.3f}" for k, v in prof["kernel_ms_per_step"].items())
    return (
        f"profile {prof['model']} buffer {prof['buffer_size']} batch {prof['batch']} ({prof['steps']} steps): GPU busy "
        f"{100 * prof['gpu_busy_share']:.1f}%, idle {100 * prof['gpu_idle_share']:.1f}% of "
        f"{prof['wall_ms_per_step']:.2f} ms/step; without the profiler: idle "
        f"{100 * prof.get('gpu_idle_share_unprofiled', float('nan')):.1f}% of "
        f"{prof.get('wall_ms_per_step_unprofiled', float('nan')):.2f} ms/step (target: idle <= 10% at batch 1 with "
        f"CUDA graphs); "
        f"{prof['kernels_per_step']:.0f} kernels/step; kernel ms/step: {cats}"
    )


def format_roofline(rows: Sequence[Mapping[str, Any]]) -> str:
    lines = [f"{'model':<10} {'M':>5} {'shape':<16} {'N':>7} {'K':>6} {'ms':>8} {'TFLOP/s':>8} {'% peak':>7} "
             f"{'% roofline':>10} bound"]
    for r in rows:
        lines.append(
            f"{r['model']:<10} {r['m']:>5} {r['shape']:<16} {r['n']:>7} {r['k']:>6} {r['ms']:>8.4f} "
            f"{r['tflops']:>8.1f} {r['pct_of_matmul_peak']:>7.1f} {r['pct_of_roofline']:>10.1f} {r['bound']}"
        )
    return "\n".join(lines)


def _key(section: str, row: Mapping[str, Any]) -> tuple[Any, ...]:
    if section == "linear_roofline":
        return row["model"], row["m"], row["shape"]
    return row["model"], row.get("strategy", "multi_bd"), row.get("variant", ""), row["buffer_size"], row["batch"]


def read_report(path: str | Path, device_name: str) -> dict[str, Any]:
    """The report ``--append`` adds to: a JSON report of this tool measured on ``device_name`` (read before
    anything is measured, so a file that cannot take the rows is refused first)."""
    try:
        report = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(
            f"--append --out {str(path)!r}: the existing file is not a readable JSON report: {err}"
        ) from None
    if not isinstance(report, dict) or not isinstance(report.get("results"), list):
        raise ValueError(
            f"--append --out {str(path)!r}: the existing file is not a report of 'diffulex bench throughput' (a "
            "JSON object with 'results'); write to another --out"
        )
    measured_on = (report.get("device") or {}).get("name") if isinstance(report.get("device"), dict) else None
    if measured_on != device_name:
        raise ValueError(
            f"--append --out {str(path)!r}: the existing report was measured on {measured_on!r}, this run is on "
            f"{device_name!r}; write to another --out"
        )
    return report


def merge_reports(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """`new` over `old`: rows of the same (model, strategy, variant, buffer, batch) are replaced, others kept. Both
    must come from the same device, since floors and speeds of different machines do not belong in one table."""
    if old.get("device", {}).get("name") != new["device"]["name"]:
        raise ValueError(
            f"--append: the existing report was measured on {old.get('device', {}).get('name')!r}, this run on "
            f"{new['device']['name']!r}; write to another --out"
        )
    merged = dict(new)
    for section in ("results", "profile", "linear_roofline"):
        fresh = {_key(section, r) for r in new.get(section, [])}
        kept = [r for r in old.get(section, []) if _key(section, r) not in fresh]
        merged[section] = kept + list(new.get(section, []))
    merged["commands"] = [*old.get("commands", [old.get("command")]), new["command"]]
    return merged


def plot(report: Mapping[str, Any], path: str | Path) -> None:
    """Tokens/s and floor ratio against batch size, one line per (model, buffer size)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_ratio) = plt.subplots(1, 2, figsize=(12, 4.5))
    lines: dict[tuple[str, int, str], list[Mapping[str, Any]]] = {}
    for r in report["results"]:
        if not r.get("error"):
            lines.setdefault((r["model"], r["buffer_size"], r.get("variant", "")), []).append(r)
    for (model, buffer_size, variant), rows in sorted(lines.items()):
        rows = sorted(rows, key=lambda r: r["batch"])
        batches = [r["batch"] for r in rows]
        label = f"{model}, buffer {buffer_size}" + (f", {variant}" if variant else "")
        ax_tps.plot(batches, [r["tokens_per_s"] for r in rows], marker="o", label=label)
        ax_ratio.plot(batches, [r["floor_ratio"] for r in rows], marker="o", label=label)
    batches = sorted({r["batch"] for rows in lines.values() for r in rows})
    for ax in (ax_tps, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch size (requests)")
        ax.grid(True, which="both", alpha=0.3)
    ax_tps.set_ylabel("decode tokens/s")
    ax_ratio.set_ylabel("ms per step / max(memory floor, compute floor)")
    ax_ratio.axhline(1.0, color="black", linewidth=0.8)
    ax_tps.legend(fontsize=8)
    fig.suptitle(f"diffulex decode throughput, {report['device']['name']} ({report['date']})")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_llada2_checkpoint(path: str | Path, size: str) -> Path:
    """Write a weightless LLaDA2 checkpoint folder of `size` (`LLADA2_SIZES`) into `path`; returns it. The config
    keys are LLaDA2.0-mini's; load it with ``load_format="dummy"``."""
    from diffulex.testing.checkpoints import write_tiny_checkpoint

    if size not in LLADA2_SIZES:
        raise ValueError(f"size={size!r} is invalid: must be one of {', '.join(LLADA2_SIZES)}")
    path = Path(path)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = write_tiny_checkpoint(Path(tmp) / "tiny", family="llada2")
        path.mkdir(parents=True, exist_ok=True)
        for item in tiny.iterdir():
            if item.suffix != ".safetensors":
                (path / item.name).write_bytes(item.read_bytes())
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    config.update(LLADA2_SIZES[size])
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return path


# The geometries measured when none is named, by the family the written checkpoints load as: the dense SDAR sizes,
# else those of the first family the strategy runs.
DEFAULT_GEOMETRIES: dict[str, list[str]] = {
    "sdar": ["1.7b", "4b", "8b"],
    "fast_dllm_v2": list(FDV2_SIZES),
    "llada2": list(LLADA2_SIZES),
}


def default_geometries(strategy: str) -> list[str]:
    """The geometries `diffulex bench throughput` measures for ``strategy`` when given neither ``--models`` nor
    ``--model``: asked of the strategy (`Strategy.check_family`), so that a plugin's strategy gets the geometries of
    a family it runs, and one that runs none of them an error saying so."""
    from diffulex.models.family import FAMILIES
    from diffulex.strategy.strategy import STRATEGIES

    rule = STRATEGIES.get(strategy)
    for family, sizes in DEFAULT_GEOMETRIES.items():
        try:
            rule.check_family(FAMILIES.get(family))
        except ValueError:
            continue
        return sizes
    raise ValueError(
        f"--strategy {strategy} runs none of the families of the built-in geometries ({', '.join(DEFAULT_GEOMETRIES)}):"
        " measure a checkpoint of a family it runs with --model DIR"
    )


# ----- entry point -------------------------------------------------------------------------------------------


def run(
    settings: ThroughputSettings,
    sizes: Sequence[str] = (),
    model_dir: str | None = None,
    load_format: str | None = None,
    data_dir: str | None = None,
    out: str | None = None,
    plot_path: str | None = None,
    append: bool = False,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Write the checkpoint folders, run the sweep, print the table, write the JSON and the plot.

    Everything that can be refused is checked before anything is measured: the output paths (``--out``,
    ``--plot``), the report ``--append`` adds to (JSON of this tool, from this device), and that the generated
    geometries (``--models``) have a CUDA device to run on."""
    from diffulex.bench.config import check_output_file

    if model_dir is None and not sizes:
        raise ValueError("nothing to measure: give --models and/or --model DIR")
    if append and not out:
        raise ValueError("--append needs --out (the report to add to)")
    if out:
        check_output_file("--out", out)
    if plot_path:
        check_output_file("--plot", plot_path)
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'diffulex[bench]' (or matplotlib)") from None
    device = _device(settings.engine_overrides)
    if sizes and device.type != "cuda":
        raise ValueError(
            f"--models {' '.join(sizes)}: these random-weight geometries (1.7 to 30 billion parameters) need a CUDA "
            "device and none is available: run on a GPU machine, or measure a small checkpoint on this CPU with "
            "--model DIR"
        )
    old = None
    if append and Path(out).is_file():
        old = read_report(out, _device_info(device)["name"])
    with tempfile.TemporaryDirectory(prefix="diffulex-throughput-") as tmp:
        models: list[ModelEntry] = []
        if model_dir is not None:
            models.append(ModelEntry(Path(model_dir).name, str(model_dir), load_format or "safetensors"))
        for size in sizes:
            if size in FDV2_SIZES:
                path = write_fast_dllm_v2_checkpoint(Path(tmp) / size, size, data_dir)
                models.append(ModelEntry(size, str(path), load_format or "dummy", size))
                continue
            if size in LLADA2_SIZES:
                path = write_llada2_checkpoint(Path(tmp) / size, size)
                models.append(ModelEntry(size, str(path), load_format or "dummy", size))
                continue
            path = write_sdar_checkpoint(Path(tmp) / f"sdar-{size}", size, data_dir)
            models.append(ModelEntry(f"sdar-{size}", str(path), load_format or "dummy", size))
        report = {
            "tool": "diffulex bench throughput",
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "command": shlex.join(["diffulex", *sys.argv[1:]]),
            **run_sweep(models, settings, log),
        }
    if old is not None:
        report = merge_reports(old, report)
    log(format_table(report["results"]))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        log(f"results: {out}")
    if plot_path:
        plot(report, plot_path)
        log(f"plot: {plot_path}")
    return report

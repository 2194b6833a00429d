"""``diffulex bench canvas``: milliseconds per DiffusionGemma denoising step against the step's hardware floor.

The engine serves the ``diffusion_gemma`` strategy on random weights (``load_format="dummy"``) of the published
DiffusionGemma-26B-A4B geometry (`diffulex.testing.checkpoints.DIFFUSION_GEMMA_26B_CONFIG`), or of fewer layers
where 30 do not fit the device with their KV cache (the report says which). For each batch size, that many requests
with random prompts of ``prompt_len`` tokens each ask for one canvas; ``confidence_threshold`` 0 keeps every canvas
denoising for all ``steps`` steps. A first batch warms up (kernels compiled, the bucket's CUDA graph captured);
then, in a second, the engine steps that each compute exactly one denoising step of every canvas are timed on the
host. An engine step applies the step in flight and launches the next; the first launches two (the first of which
also encodes the prompts) and the last none, so ``steps - 2`` calls are timed, back to back as in serving (the device
synchronized before the first and after the last): each call waits for the step in flight, so in a steady run a
call's time is a step's, and where a step is continued on the device (`CanvasRunner.launch_continuation`) the
host's work between two steps overlaps the GPU's, as it does when serving. The decoder pass alone is timed
apart, back to back (``decoder_ms_per_pass``: the graph replay) and each pass awaited as a step's is
(``decoder_ms_per_awaited_pass``; over several ranks it also holds the latency of telling the workers), so the rest
of the step (LM head, each canvas's sampling rule and self-conditioning input) is the difference. Each row names the
path the experts took over the batch's rows (``experts_impl``: each layer's own choice, or the one ``experts_impl``
forces, so that two runs compare the fused kernels with the grouped GEMM on one machine). With ``profile``
(``--profile``), one more batch's steps and the decoder pass alone run under the profiler: GPU time by kernel kind
and the longest kernels.

The floor of one step (`diffulex.bench.roofline`, MoE accounting included): bytes = every weight outside the
experts (the tied embedding once, as the LM head) + the experts the step's ``batch x canvas_length`` rows select
(uniform routing: at 256 rows nearly all 128 experts per layer) + the gathered embedding rows + the cached K/V the
canvases read (a sliding layer at most ``window - 1`` positions); over the measured copy bandwidth. Flops =
linears per row (each row through its ``top_k`` experts), the LM head and the self-conditioning product (each
``vocab x hidden`` per row), attention pairs; over the measured matmul rate. The report gives both parts, the
floor (the larger) and the measured step time over it.
"""

from __future__ import annotations

import contextlib
import gc
import json
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from diffulex.bench.hardware import measure_peaks
from diffulex.bench.roofline import CostModel, StepWork, step_bytes, step_flops
from diffulex.layers.moe import MOE_IMPLS

# "sweep": the performance sweep's DiffusionGemma layout (`diffulex.bench.sweep_models.DIFFUSION_GEMMA_TEXT`, a
# canvas of the tiny writer's length), so that the sweep's row has a tool that breaks its step down (``--profile``)
GEOMETRIES = ("26b-a4b", "sweep", "tiny")
# Expert paths a run may force: those a CUDA graph captures (the exact loop asks the host which experts ran).
FORCED_EXPERTS_IMPLS = tuple(impl for impl in MOE_IMPLS if impl != "loop")
# Layers kept per retry when the geometry does not fit: one period of the 5 sliding : 1 full pattern
LAYER_PERIOD = 6
# A tiny geometry for checking the tool end to end on the CPU (the shapes of the CPU tests' checkpoints)
TINY_TEXT_CONFIG = {
    "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_global_key_value_heads": 1, "global_head_dim": 32, "sliding_window": 8, "num_experts": 4,
    "top_k_experts": 2, "moe_intermediate_size": 32, "vocab_size": 384, "max_position_embeddings": 4096,
}  # fmt: skip
TINY_CANVAS = 16


@dataclass
class CanvasBenchSettings:
    geometry: str = "26b-a4b"
    num_layers: int | None = None  # None: the geometry's own (30), fewer only when that does not fit
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8])
    prompt_len: int = 512
    steps: int = 12  # denoising steps per canvas (steps - 2 of them timed)
    # the requests' temperature: sampled canvases (the default) take the fused sampling passes and their
    # self-conditioning products; 0 is the greedy rule the performance sweep's strategies row decodes with
    temperature: float = 1.0
    seed: int = 0
    quick: bool = False  # small peak measurements
    experts_impl: str | None = None  # None: each layer's experts choose per step (`StackedExperts.impl_for`)
    profile: bool = False  # also profile the steps and the decoder pass: kernel time by kind, the longest kernels
    engine_overrides: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.geometry not in GEOMETRIES:
            raise ValueError(f"geometry={self.geometry!r} must be one of {', '.join(GEOMETRIES)}")
        if self.steps < 3:
            raise ValueError(f"steps={self.steps} must be >= 3 (the first engine step launches two denoising "
                             "steps, the last none)")  # fmt: skip
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy canvases)")
        if self.prompt_len < 1 or not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError("prompt_len and every batch size must be >= 1")
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers={self.num_layers} must be >= 1")
        if self.experts_impl is not None and self.experts_impl not in FORCED_EXPERTS_IMPLS:
            raise ValueError(f"experts_impl={self.experts_impl!r} must be one of {', '.join(FORCED_EXPERTS_IMPLS)}")


def write_folder(path: Path, geometry: str, num_layers: int | None) -> tuple[Path, int]:
    """A folder with the geometry's ``config.json`` (``num_layers`` layers, the last a global one), the tiny
    Gemma-flavoured tokenizer and a generation config; no weights (they are drawn at load). Returns the folder
    and its layer count."""
    from diffulex.testing.checkpoints import DIFFUSION_GEMMA_26B_CONFIG, _tiny_tokenizer_files

    config = json.loads(json.dumps(DIFFUSION_GEMMA_26B_CONFIG))
    text = config["text_config"]
    if geometry == "tiny":
        text.update(TINY_TEXT_CONFIG)
        config["canvas_length"] = TINY_CANVAS
        config.pop("image_token_id")  # an id beyond the tiny vocabulary
    elif geometry == "sweep":
        from diffulex.bench.sweep_models import DIFFUSION_GEMMA_TEXT

        text.update({k: v for k, v in DIFFUSION_GEMMA_TEXT.items() if k != "layer_types"})  # derived per layer count
        config["canvas_length"] = TINY_CANVAS
    default_layers = LAYER_PERIOD if geometry == "tiny" else text["num_hidden_layers"]
    layers = num_layers if num_layers is not None else default_layers
    text["num_hidden_layers"] = layers
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": config["eos_token_id"]}))
    for name, data in _tiny_tokenizer_files("diffusion_gemma").items():
        (path / name).write_bytes(data)
    return path, layers


def canvas_cost_model(model: torch.nn.Module, itemsize: int) -> CostModel:
    """`CostModel` of a `DiffusionGemmaForDiffusionLM`: the stacked experts as routed experts, the tied embedding
    as the LM head, every other matrix a trunk linear, vectors "other". K/V and attention are counted apart
    (`step_floor`): the window and the two head geometries do not fit the model's per-token terms.

    This rank's model (the engine's process is rank 0): over several ranks its trunk is its shard, its experts those
    it holds (expert parallelism) at the width it holds (tensor parallelism), and the LM head whole, which rank 0
    alone runs; so the floor is rank 0's step."""
    from diffulex.models.diffusion_gemma import StackedExperts

    stacks = [m for m in model.modules() if isinstance(m, StackedExperts)]
    expert_ids = {id(p) for s in stacks for p in s.parameters()}
    head = model.lm_head.weight
    trunk = other = 0
    for param in model.parameters():
        if id(param) in expert_ids or param is head:
            continue
        if param.dim() >= 2:
            trunk += param.numel()
        else:
            other += param.numel()
    config = model.config
    return CostModel(
        trunk_linear_params=trunk, lm_head_params=head.numel(), other_params=other,
        embedding_row=config.hidden_size, kv_per_token=0, attn_flops_per_pair=0, itemsize=itemsize,
        moe_layers=len(stacks), num_experts=config.num_experts, experts_per_token=config.top_k_experts,
        expert_params=3 * config.hidden_size * stacks[0].down_proj.shape[2], held_experts=len(stacks[0].owned),
    )  # fmt: skip


def experts_path(model: torch.nn.Module, impl: str | None, rows: int) -> str:
    """Set ``impl`` on every layer's experts (None: each chooses per step) and return the path a step of ``rows``
    rows takes."""
    from diffulex.models.diffusion_gemma import StackedExperts

    stacks = [m for m in model.modules() if isinstance(m, StackedExperts)]
    for stack in stacks:
        stack.impl = impl
    weight = stacks[0].down_proj
    return stacks[0].impl_for(torch.empty(rows, weight.shape[1], dtype=weight.dtype, device=weight.device))


def step_floor(
    model: torch.nn.Module, cost: CostModel, contexts: Sequence[int], bandwidth_bps: float, flops_per_s: float
) -> dict[str, float | str]:
    """The floor of one denoising step of canvases after ``contexts`` cached positions, and its parts: this rank's
    (`canvas_cost_model`; its attention heads and K/V heads too)."""
    config = model.config
    C = config.canvas_length
    rows = C * len(contexts)
    work = StepWork(query_tokens=rows, logit_rows=rows, context_tokens=0, written_tokens=0, attn_pairs=0)
    kv_elements = attn_flops = 0
    for layer in model.layers:
        attention = layer.self_attn
        for ctx in contexts:
            seen = min(ctx, config.sliding_window - 1) if attention.is_sliding else ctx
            kv_elements += 2 * attention.num_kv_heads * attention.head_dim * seen
            attn_flops += 4 * attention.num_heads * attention.head_dim * C * (seen + C)
    experts_bytes = cost.moe_layers * cost.expected_experts(rows) * cost.expert_params * cost.itemsize
    memory_bytes = step_bytes(cost, work) + kv_elements * cost.itemsize
    soft_flops = 2 * cost.lm_head_params * rows  # softmax(logits) @ E for the next step's self-conditioning
    flops = step_flops(cost, work) + attn_flops + soft_flops
    memory_s, compute_s = memory_bytes / bandwidth_bps, flops / flops_per_s
    return {
        "weight_GB": cost.weight_bytes / 1e9,
        "experts_GB": experts_bytes / 1e9,
        "experts_per_layer": cost.expected_experts(rows),
        "kv_read_GB": kv_elements * cost.itemsize / 1e9,
        "step_GB": memory_bytes / 1e9,
        "step_TFLOP": flops / 1e12,
        "memory_floor_ms": 1e3 * memory_s,
        "compute_floor_ms": 1e3 * compute_s,
        "floor_ms": 1e3 * max(memory_s, compute_s),
        "bound": "memory" if memory_s >= compute_s else "compute",
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _requests(engine: Any, batch: int, settings: CanvasBenchSettings, seed: int) -> list[Any]:
    from diffulex.bench.throughput import random_prompts
    from diffulex.sampling_params import SamplingParams

    ids = random_prompts(engine.vocab_limit, engine.mask_token_id, batch, settings.prompt_len, seed)
    C = engine.model.config.canvas_length
    params = [
        SamplingParams(temperature=settings.temperature, max_tokens=C, ignore_eos=True, seed=seed + i)
        for i in range(batch)
    ]
    req_ids = [engine.add_request(prompt, sp) for prompt, sp in zip(ids, params, strict=True)]
    by_id = {req.req_id: req for req in engine.scheduler.waiting}
    return [by_id[i] for i in req_ids]


def time_batch(engine: Any, batch: int, settings: CanvasBenchSettings, seed: int) -> tuple[list[float], int, int]:
    """Seconds of each engine step that computes one denoising step of all ``batch`` canvases, and of the steps
    those calls launched, how many were continued on the device and how many of those dropped."""
    requests = _requests(engine, batch, settings, seed)
    engine.step()  # encodes the prompts, computes each canvas's first step and launches its second
    if not all(req.nfe == 1 for req in requests):
        raise RuntimeError(f"only {sum(r.nfe == 1 for r in requests)} of {batch} requests ran in the first step "
                           "(KV cache too small for this batch?)")  # fmt: skip
    device = engine.device
    continued, dropped = engine.num_continuations, engine.num_dropped_continuations
    _sync(device)
    stamps = [time.perf_counter()]
    for _ in range(settings.steps - 2):  # each applies one step and launches the next
        engine.step()
        stamps.append(time.perf_counter())
    _sync(device)  # the last step's work is timed too
    stamps[-1] = time.perf_counter()
    times = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    continued = engine.num_continuations - continued
    dropped = engine.num_dropped_continuations - dropped
    while not engine.is_finished():
        engine.step()
    if any(req.nfe != settings.steps for req in requests):
        raise RuntimeError(f"canvases took {sorted({r.nfe for r in requests})} steps, not {settings.steps} each")
    return times, continued, dropped


def decoder_pass(engine: Any, batch: int, prompt_len: int) -> Callable[[], object] | None:
    """The decoder pass alone (`CanvasRunner.decode`: the graph replayed where the batch has a bucket) over
    ``batch`` canvases after ``prompt_len`` positions of pages (their contents do not matter for time),
    self-conditioning on, as a call; None when the pool has too few pages."""
    runner, config, device = engine.runner, engine.model.config, engine.device
    C = config.canvas_length
    pages_each = -(-(prompt_len + C) // runner.settings.page_size)
    if pages_each * batch > runner.num_pages:
        return None
    tables = [list(range(i * pages_each, (i + 1) * pages_each)) for i in range(batch)]
    canvas = torch.randint(0, engine.vocab_limit, (batch, C), device=device)
    dtype = next(engine.model.parameters()).dtype
    soft = torch.zeros(batch, C, config.hidden_size, dtype=dtype, device=device)

    def run() -> object:
        with torch.inference_mode():
            return runner.decode(canvas, soft, [prompt_len] * batch, tables)

    return run


def time_decoder_pass(
    engine: Any, batch: int, prompt_len: int, iters: int = 5, each_awaited: bool = False
) -> float | None:
    """Milliseconds of `decoder_pass` (None when the pool has too few pages): back to back, or with
    ``each_awaited`` each pass's device work awaited before the next starts, as a step is (over several ranks the
    latency of telling the workers then shows, which back-to-back passes overlap)."""
    run = decoder_pass(engine, batch, prompt_len)
    if run is None:
        return None
    run()
    _sync(engine.device)
    t0 = time.perf_counter()
    for _ in range(iters):
        run()
        if each_awaited:
            _sync(engine.device)
    _sync(engine.device)
    return 1e3 * (time.perf_counter() - t0) / iters


PROFILE_TOP_KERNELS = 15


def profile_batch(engine: Any, batch: int, settings: CanvasBenchSettings, seed: int) -> dict[str, Any]:
    """Where the GPU time of the timed steps and of the decoder pass alone goes (`diffulex.bench.gpu_profile`):
    ``steps`` (engine steps of one denoising step of every canvas each, as `time_batch` times them) and
    ``decoder_pass``, each with its kernel time by kind and its longest kernels."""
    from diffulex.bench.gpu_profile import profile_steps

    device = engine.device
    requests = _requests(engine, batch, settings, seed)
    engine.step()
    # the requests have only these steps left: none to spare for an unprofiled timing (`time_batch` did it)
    steps = profile_steps(engine.step, settings.steps - 2, device, top=PROFILE_TOP_KERNELS, time_unprofiled=False)
    while not engine.is_finished():
        engine.step()
    if any(req.nfe != settings.steps for req in requests):
        raise RuntimeError(f"canvases took {sorted({r.nfe for r in requests})} steps, not {settings.steps} each")
    run = decoder_pass(engine, batch, settings.prompt_len)
    profile: dict[str, Any] = {"steps": steps, "decoder_pass": None}
    if run is not None:
        run()
        profile["decoder_pass"] = profile_steps(run, 3, device, top=PROFILE_TOP_KERNELS)
    return profile


def _log_profile(profile: dict[str, Any], log: Callable[[str], None]) -> None:
    for part in ("steps", "decoder_pass"):
        summary = profile.get(part)
        if summary is None:
            continue
        kinds = ", ".join(f"{kind} {ms:.2f}" for kind, ms in summary["kernel_ms_per_step"].items())
        log(f"  profiled {part}: GPU busy {summary['gpu_busy_ms_per_step']:.2f} ms of "
            f"{summary['wall_ms_per_step']:.2f} a call; kernel ms by kind: {kinds}")  # fmt: skip
        for k in summary.get("top_kernels", []):
            log(f"    {k['ms_per_step']:8.3f} ms  x{k['calls_per_step']:<6.1f} [{k['category']}] {k['kernel'][:90]}")


def _engine(folder: Path, settings: CanvasBenchSettings, batch: int) -> Any:
    from diffulex import Diffulex

    C = json.loads((folder / "config.json").read_text()).get("canvas_length", 256)
    fields = dict(
        load_format="dummy", max_num_reqs=batch, max_model_len=settings.prompt_len + C, enable_prefix_caching=False,
        # every prompt is encoded in the first step, so that the timed steps each denoise all the canvases
        max_num_batched_tokens=batch * (settings.prompt_len + C),
        strategy_options={"diffusion_gemma_max_denoising_steps": settings.steps,
                          "diffusion_gemma_confidence_threshold": 0.0},
        seed=settings.seed,
    )  # fmt: skip
    if torch.cuda.is_available():
        fields["dtype"] = "bfloat16"
    fields.update(settings.engine_overrides)
    return Diffulex(str(folder), **fields)


def measure(folder: Path, settings: CanvasBenchSettings, batch: int, peaks: Any, log: Callable[[str], None]) -> dict:
    engine = _engine(folder, settings, batch)
    try:
        experts_impl = experts_path(engine.model, settings.experts_impl, batch * engine.model.config.canvas_length)
        time_batch(engine, batch, settings, seed=settings.seed + 1000)  # warm-up: compiles and captures
        times, continued, dropped = time_batch(engine, batch, settings, seed=settings.seed)
        decoder_ms = time_decoder_pass(engine, batch, settings.prompt_len)
        awaited_ms = time_decoder_pass(engine, batch, settings.prompt_len, each_awaited=True)
        model, runner = engine.model, engine.runner
        itemsize = next(model.parameters()).element_size()
        cost = canvas_cost_model(model, itemsize)
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        floor = step_floor(model, cost, [settings.prompt_len] * batch, peaks.copy_bandwidth_bps,
                           peaks.matmul_flops_per_s[dtype])  # fmt: skip
        graphs = sorted(b for b, g in runner.graphs.items() if g.graph is not None)
        mean_ms = 1e3 * statistics.fmean(times)
        row = {
            "batch": batch, "timed_steps": len(times), "ms_per_step": mean_ms,
            "median_ms_per_step": 1e3 * statistics.median(times), "min_ms_per_step": 1e3 * min(times),
            "decoder_ms_per_pass": decoder_ms, "decoder_ms_per_awaited_pass": awaited_ms,
            **floor, "floor_ratio": mean_ms / floor["floor_ms"],
            "memory_floor_ratio": mean_ms / floor["memory_floor_ms"],
            "cuda_graph_buckets": graphs, "dtype": dtype, "attention": "triton" if runner.use_triton else "torch",
            "experts_impl": experts_impl, "pages": runner.num_pages,
            # of the steps the timed calls launched: continued on the device, and dropped (`CanvasRunner.can_continue`)
            "continued_steps": continued, "dropped_continuations": dropped,
        }  # fmt: skip
        if settings.profile:
            row["profile"] = profile_batch(engine, batch, settings, seed=settings.seed + 2000)
    finally:
        with contextlib.suppress(Exception):
            engine.exit()
    log(f"batch {batch}: {row['ms_per_step']:.2f} ms/step (median {row['median_ms_per_step']:.2f}), floor "
        f"{row['floor_ms']:.2f} ms ({row['bound']}; memory {row['memory_floor_ms']:.2f}: weights "
        f"{row['weight_GB']:.2f} GB + experts {row['experts_GB']:.2f} GB ({row['experts_per_layer']:.1f}/layer) + "
        f"K/V {row['kv_read_GB']:.3f} GB; compute {row['compute_floor_ms']:.2f}: {row['step_TFLOP']:.2f} TFLOP), "
        f"ratio {row['floor_ratio']:.2f}, graphs {graphs or 'none'}, experts {experts_impl}, {continued} steps "
        f"continued on the device ({dropped} dropped); decoder pass alone "
        f"{'n/a' if decoder_ms is None else f'{decoder_ms:.2f} ms ({awaited_ms:.2f} each awaited)'}")  # fmt: skip
    if "profile" in row:
        _log_profile(row["profile"], log)
    return row


def _out_of_memory(err: BaseException) -> bool:
    return isinstance(err, torch.cuda.OutOfMemoryError) or "out of memory" in str(err).lower() or (
        "too small" in str(err) and "KV cache" in str(err)
    )


def run(settings: CanvasBenchSettings, out: str | Path | None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure every batch size; where the geometry does not fit, retry with one period of layers fewer (the
    report's ``num_layers`` and ``layers_note`` say so). Writes the report to ``out`` (JSON) when given."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and settings.geometry != "tiny":
        raise ValueError(f"geometry={settings.geometry!r} needs a CUDA device (50 GB of weights); --geometry tiny "
                         "checks the tool on a CPU")  # fmt: skip
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, settings.engine_overrides.get("dtype", str(dtype).removeprefix("torch.")))
    peaks = measure_peaks(device, [dtype], quick=settings.quick)
    log(f"peaks: {json.dumps(peaks.to_dict())}")
    report: dict[str, Any] = {
        "tool": "diffulex bench canvas", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "geometry": settings.geometry,
        "prompt_len": settings.prompt_len, "steps_per_canvas": settings.steps, "temperature": settings.temperature,
        "peaks": peaks.to_dict(),
        "device": peaks.device, "torch": torch.__version__, "results": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder, full_layers = write_folder(Path(tmp) / "model", settings.geometry, settings.num_layers)
        layers = full_layers
        while True:
            try:
                report["results"] = [measure(folder, settings, batch, peaks, log) for batch in settings.batch_sizes]
                break
            except (RuntimeError, ValueError) as err:
                if not _out_of_memory(err) or layers <= LAYER_PERIOD:
                    raise
                message = str(err).splitlines()[0]
            gc.collect()  # outside the except block, whose traceback holds the engine's tensors
            if device.type == "cuda":
                torch.cuda.empty_cache()
            log(f"{layers} layers do not fit ({message}); retrying with {layers - LAYER_PERIOD}")
            folder, layers = write_folder(folder, settings.geometry, layers - LAYER_PERIOD)
    report["num_layers"] = layers
    report["layers_note"] = (
        f"all {layers} layers of the geometry" if layers == full_layers
        else f"{layers} of the geometry's {full_layers} layers: {full_layers} do not fit this device"
    )  # fmt: skip
    _write(report, out, log)
    return report


def _write(report: dict[str, Any], out: str | Path | None, log: Callable[[str], None]) -> None:
    if out is None:
        return
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    log(f"report: {path}")

"""``diffulex bench``: run a benchmark from a YAML config, compare two runs, or measure decode throughput.

    diffulex bench --config configs/sdar_chat_gsm8k.yml                 # run (same as: diffulex bench run ...)
    diffulex bench --config FILE.yml --dataset-limit 20 --max-num-reqs 32 --set eval.max_tokens=256
    diffulex bench compare RUN_A RUN_B [--json]
    diffulex bench throughput --models 1.7b 4b 8b --batch-sizes 1 8 32 128 --buffer-sizes 1 2 --out FILE.json
    diffulex bench canvas --batch-sizes 1 8 --out FILE.json             # DiffusionGemma-26B-A4B denoising steps
    diffulex bench sweep --targets batch prefill strategies moe start serving --out DIR [--quick]
    diffulex bench sweep --targets dp --out DIR                          # DP=2 against DP=1 through the server

Overrides, applied over the file key by key: every engine field as a flag (``--max-num-reqs 32``,
``--enforce-eager/--no-enforce-eager``; the same flags as ``diffulex generate``), ``--model-path``, every eval
key as a flag (``--dataset-name``, ``--dataset-limit``, ``--max-tokens``, ``--allow-code-execution``, ...), and
``--set SECTION.KEY=VALUE`` for anything (the value is read as YAML:
``--set engine.decoding_thresholds={accept_threshold: 0.95}``).

``throughput`` measures decode steps on random-weight checkpoints of the real SDAR geometries (or ``--model DIR``)
against the hardware floors; it takes the engine flags (``--enforce-eager``, ``--attn-impl``, ...) and
``--max-tokens``, not ``--config``/``--set`` (docs/benchmarks.md, "Throughput (GPU)"). ``canvas`` measures
milliseconds per DiffusionGemma denoising step against the step's floor (docs/benchmarks.md, "DiffusionGemma
denoising steps (GPU)"). ``sweep`` runs the
performance targets (docs/benchmarks.md, "Performance sweep"): ``--targets``, ``--out DIR``, ``--max-seconds`` per
target, ``--total-seconds`` for all, ``--quick`` (tiny checkpoints, the CPU path), ``--prefill-parts`` (the
prefill target's parts: ``ttft``, ``beside``), ``--data-dir`` and the engine flags.

Exit codes: 0 done, 2 bad config or arguments (the message names the key), 1 the run failed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from diffulex.bench.config import EvalConfig


def _eval_flag_type(annotation: Any) -> Any:
    base = str(annotation).replace(" | None", "")
    if base == "int":
        return int
    if base == "float":
        return float
    return str


def add_eval_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per eval key (``--dataset-limit``); unset flags stay out of the overrides."""
    import dataclasses

    from diffulex.cli import field_default

    group = parser.add_argument_group("eval keys (see docs/benchmarks.md)")
    for f in dataclasses.fields(EvalConfig):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata.get("help", "").replace("%", "%%")
        default = field_default(f)
        if default is not None and "default" not in help_text.lower():
            help_text += f" (default: {default})".replace("%", "%%")
        if f.type == "bool":
            group.add_argument(flag, dest=f"eval__{f.name}", action=argparse.BooleanOptionalAction, default=None,
                               help=help_text)
        else:
            group.add_argument(flag, dest=f"eval__{f.name}", type=_eval_flag_type(f.type), default=None,
                               metavar=f.name.upper(), help=help_text)


def eval_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len("eval__"):]: v for k, v in vars(args).items() if k.startswith("eval__") and v is not None}


def parse_set(items: list[str] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--set engine.KEY=VALUE`` / ``--set eval.KEY=VALUE`` -> (engine overrides, eval overrides)."""
    import yaml

    engine: dict[str, Any] = {}
    eval_: dict[str, Any] = {}
    for item in items or []:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or section not in ("engine", "eval") or not name:
            raise ValueError(f"--set {item!r} is invalid: must be engine.KEY=VALUE or eval.KEY=VALUE")
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise ValueError(f"--set {item!r}: the value is not valid YAML: {err}") from None
        (engine if section == "engine" else eval_)[name] = value
    return engine, eval_


def add_parser(subparsers: Any) -> None:
    from diffulex.cli import add_engine_flags

    parser = subparsers.add_parser(
        "bench",
        help="run a benchmark from a YAML config, compare two runs, or measure decode throughput",
        description=(__doc__ or "").split("\n\n", 1)[1] if __doc__ else None,
    )
    parser.add_argument("action", nargs="?", choices=("run", "compare", "throughput", "canvas", "sweep"),
                        default="run",
                        help="run (default), compare, throughput, canvas (DiffusionGemma denoising steps) or sweep")
    parser.add_argument("runs", nargs="*", metavar="RUN", help="compare: two run directories (or metrics.json files)")
    parser.add_argument("--config", default=None, help="benchmark YAML (engine: + eval: sections)")
    parser.add_argument("--model-path", "--model", dest="model_path", default=None,
                        help="checkpoint directory (overrides engine.model_path)")
    parser.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                        help="set any engine/eval key; the value is read as YAML (repeatable)")
    parser.add_argument("--check", action="store_true", help="validate the config and tasks, then stop")
    parser.add_argument("--json", action="store_true", help="compare: print the differences as JSON")
    add_throughput_flags(parser)
    add_canvas_flags(parser)
    add_eval_flags(parser)
    add_engine_flags(parser)
    parser.set_defaults(func=cmd_bench)


def add_throughput_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``diffulex bench throughput``; unset ones stay None so other actions can reject them."""
    from diffulex.bench.throughput import FDV2_SIZES, LLADA2_SIZES, SDAR_SIZES, STRATEGY_DEFAULTS

    group = parser.add_argument_group("throughput (diffulex bench throughput; see docs/benchmarks.md)")
    group.add_argument("--models", dest="tp__models", nargs="+", type=str.lower,
                       choices=(*SDAR_SIZES, *LLADA2_SIZES, *FDV2_SIZES),
                       help="SDAR (and LLaDA2, Fast-dLLM v2) geometries with random weights (default: 1.7b 4b 8b, "
                            "with --strategy fast_dllm_v2 fdv2-7b, unless --model is given); LLaDA2 is trained with "
                            "--block-size 32")
    group.add_argument("--strategy", dest="tp__strategy", choices=tuple(STRATEGY_DEFAULTS),
                       help="decoding strategy of the sweep (default: multi_bd, block 4, buffers 1 2; fast_dllm_v2: "
                            "sub-blocks of 8, buffer 4 = blocks of 32)")
    group.add_argument("--block-cache", dest="tp__block_cache", nargs="+", choices=("on", "off"),
                       help="fast_dllm_v2: its block cache settings to sweep (default: on off)")
    group.add_argument("--batch-sizes", dest="tp__batch_sizes", nargs="+", type=int, metavar="N",
                       help="requests decoded at once (default: 1 8 32 128)")
    group.add_argument("--buffer-sizes", dest="tp__buffer_sizes", nargs="+", type=int, metavar="N",
                       help="blocks decoded at once per request; fast_dllm_v2: sub-blocks per block (default: 1 2; "
                            "fast_dllm_v2: 4)")
    group.add_argument("--prompt-len", dest="tp__prompt_len", type=int, metavar="N",
                       help="random prompt tokens per request (default: 128); --max-tokens sets the answer (256)")
    group.add_argument("--out", dest="tp__out", metavar="FILE.json",
                       help="write the report here (sweep: the directory of its JSON, plots and tables.md)")
    group.add_argument("--plot", dest="tp__plot", metavar="FILE.png", help="draw tokens/s and floor ratio here")
    group.add_argument("--append", dest="tp__append", action="store_true", default=None,
                       help="merge into an existing --out (same device), replacing rows measured again")
    group.add_argument("--max-seconds", dest="tp__max_seconds", type=float, metavar="S",
                       help="timed decode budget per configuration (default: 60); sweep: the budget of each target "
                            "(default: 120, --quick 60)")
    group.add_argument("--max-steps", dest="tp__max_steps", type=int, metavar="N",
                       help="timed decode steps per configuration at most (default: until a request finishes)")
    group.add_argument("--quick", dest="tp__quick", action="store_true", default=None,
                       help="smoke run: 32 tokens, at most 8 timed steps, small peak measurements")
    group.add_argument("--profile", dest="tp__profile", action="store_true", default=None,
                       help="also profile decode steps (CUDA): GPU busy/idle share and kernel time by category "
                            "(canvas: the steps and the decoder pass, with their longest kernels)")
    group.add_argument("--profile-batch", dest="tp__profile_batch", type=int, metavar="N",
                       help="batch size of the profile (default: 1)")
    group.add_argument("--profile-steps", dest="tp__profile_steps", type=int, metavar="N",
                       help="decode steps profiled (default: 20)")
    group.add_argument("--linear-roofline", dest="tp__linear_roofline", action="store_true", default=None,
                       help="also time each linear shape of the model against the roofline")
    group.add_argument("--roofline-batches", dest="tp__roofline_batches", nargs="+", type=int, metavar="N",
                       help="batch sizes of the linear roofline, M = batch x block size (default: 32 128)")
    group.add_argument("--data-dir", dest="tp__data_dir", metavar="DIR",
                       help="folder with the real SDAR-4B-Chat config.json and tokenizer (default: a source "
                            "checkout's tests/data/sdar-4b-chat)")
    from diffulex.bench.sweep_common import DEFAULT_TARGETS, PREFILL_PARTS, TARGETS

    sweep = parser.add_argument_group("sweep (diffulex bench sweep; see docs/benchmarks.md, Performance sweep)")
    sweep.add_argument("--targets", dest="tp__targets", nargs="+", type=str.lower, choices=TARGETS,
                       help=f"what to measure (default: {' '.join(DEFAULT_TARGETS)}; dp needs two devices)")
    sweep.add_argument("--prefill-parts", dest="tp__prefill_parts", nargs="+", type=str.lower,
                       choices=PREFILL_PARTS,
                       help="what the prefill target measures: ttft (time to first token, prefix-cache hit), beside "
                            "(decoders beside a chunked prefill, per chunk setting); default: both")
    sweep.add_argument("--total-seconds", dest="tp__total_seconds", type=float, metavar="S",
                       help="budget of the whole sweep: each target gets at most its share of what is left "
                            "(and at most --max-seconds)")


def add_canvas_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of ``diffulex bench canvas`` beyond the throughput flags it shares (--batch-sizes, --prompt-len,
    --out, --quick, --profile)."""
    from diffulex.bench.canvas_steps import FORCED_EXPERTS_IMPLS, GEOMETRIES

    group = parser.add_argument_group("canvas (diffulex bench canvas: DiffusionGemma ms per denoising step)")
    group.add_argument("--geometry", dest="cv__geometry", choices=GEOMETRIES,
                       help="random-weight geometry (default: 26b-a4b; sweep: the performance sweep's DiffusionGemma "
                            "layout; tiny checks the tool on a CPU)")
    group.add_argument("--layers", dest="cv__num_layers", type=int, metavar="N",
                       help="layers of the geometry (default: all, fewer only where they do not fit)")
    group.add_argument("--steps", dest="cv__steps", type=int, metavar="N",
                       help="denoising steps per canvas, steps - 2 of them timed (default: 12)")
    group.add_argument("--experts-impl", dest="cv__experts_impl", choices=FORCED_EXPERTS_IMPLS,
                       help="force the experts' path (default: each step's own choice: the fused Triton kernels "
                            "up to 8 canvases on CUDA at the 26B-A4B geometry, the grouped GEMM beyond)")


def canvas_options(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len("cv__"):]: v for k, v in vars(args).items() if k.startswith("cv__") and v is not None}


def throughput_options(args: argparse.Namespace) -> dict[str, Any]:
    return {k[len("tp__"):]: v for k, v in vars(args).items() if k.startswith("tp__") and v is not None}


def _engine_flag_overrides(args: argparse.Namespace) -> dict[str, Any]:
    from diffulex.cli import engine_overrides

    out = engine_overrides(args)
    if args.model_path is not None:
        out["model_path"] = args.model_path
    return out


def cmd_bench(args: argparse.Namespace) -> int:
    if args.action == "canvas":
        return cmd_canvas(args)
    if canvas_options(args):
        flags = ", ".join("--" + name.replace("_", "-") for name in canvas_options(args))
        raise ValueError(f"{flags}: only for 'diffulex bench canvas'")
    if args.action == "throughput":
        return cmd_throughput(args)
    if args.action == "sweep":
        return cmd_sweep(args)
    unused = throughput_options(args)
    if unused:
        flags = ", ".join("--" + name.replace("_", "-") for name in unused)
        raise ValueError(f"{flags}: only for 'diffulex bench throughput'")
    if args.action == "compare":
        return cmd_compare(args)
    if args.runs:
        raise ValueError(f"unexpected arguments {args.runs}: 'run' takes no positional arguments")
    return cmd_run(args)


def cmd_run(args: argparse.Namespace) -> int:
    from diffulex.bench.config import load_bench_config

    set_engine, set_eval = parse_set(args.set)
    flag_engine, flag_eval = _engine_flag_overrides(args), eval_overrides(args)
    engine = {**set_engine, **flag_engine}
    eval_ = {**set_eval, **flag_eval}
    if args.config is None and "model_path" not in engine:
        raise ValueError("diffulex bench needs --config FILE.yml (or at least --model-path); see docs/benchmarks.md")
    cfg = load_bench_config(args.config, engine, eval_, origins=_override_origins(args.set, flag_engine, flag_eval))
    from diffulex.bench.runner import load_tasks, require_lm_eval, run_benchmark, task_manager

    require_lm_eval()
    if args.check:
        tasks = load_tasks(cfg, task_manager(cfg))
        print(f"config OK: model {cfg.model}, tasks {', '.join(tasks)}")
        return 0
    result = run_benchmark(cfg)
    metrics = result.report["metrics"]
    for task, acc in result.report["accuracy"].items():
        print(f"{task}: {acc['metric']} = {acc['value']}  (n={acc['num_samples']})")
    print(
        f"{metrics['num_requests']} requests, {metrics['generated_tokens']} generated tokens in "
        f"{metrics['wall_time_s']:.2f} s: aggregate {_num(metrics['aggregate_tps'])} tok/s, decode-only "
        f"{_num(metrics['decode_tps'])} tok/s, TPF {_num(metrics['tpf'])}, "
        f"latency p50 {_num(metrics['latency_p50_s'])} s"
    )
    print(f"results: {result.run_dir}")
    return 0


def _override_origins(
    set_items: list[str] | None, flag_engine: dict[str, Any], flag_eval: dict[str, Any]
) -> dict[str, str]:
    """``"section.key"`` -> how the command line gave it (``--set ...`` or the flag; a flag wins over ``--set``),
    so an error in such a value blames the command line, not the config file."""
    origins = {}
    for item in set_items or []:
        origins[item.partition("=")[0].strip()] = f"--set {item}"
    for key in flag_engine:
        origins[f"engine.{key}"] = "--model-path" if key == "model_path" else "--" + key.replace("_", "-")
    for key in flag_eval:
        origins[f"eval.{key}"] = "--" + key.replace("_", "-")
    return origins


def cmd_throughput(args: argparse.Namespace) -> int:
    from diffulex.bench.throughput import ThroughputSettings, default_geometries, run

    if args.runs or args.config or args.set or args.check or args.json:
        raise ValueError("diffulex bench throughput takes no run directories, --config, --set, --check or --json")
    eval_ = eval_overrides(args)
    max_tokens = eval_.pop("max_tokens", None)
    if eval_:
        flags = ", ".join("--" + name.replace("_", "-") for name in eval_)
        raise ValueError(f"{flags}: eval keys are not used by 'diffulex bench throughput'")
    opts = throughput_options(args)
    for name in ("targets", "total_seconds", "prefill_parts"):
        if name in opts:
            raise ValueError(f"--{name.replace('_', '-')}: only for 'diffulex bench sweep'")
    engine = _engine_flag_overrides(args)
    model_dir = engine.pop("model_path", None)
    load_format = engine.pop("load_format", None)
    quick = bool(opts.get("quick"))
    strategy = opts.get("strategy", "multi_bd")
    block_cache = opts.get("block_cache")
    settings = ThroughputSettings(
        batch_sizes=opts.get("batch_sizes", [1, 8, 32, 128]),
        buffer_sizes=opts.get("buffer_sizes"),
        prompt_len=opts.get("prompt_len", 128),
        max_tokens=max_tokens if max_tokens is not None else (32 if quick else 256),
        block_size=engine.pop("block_size", None),
        strategy=strategy,
        block_cache=None if block_cache is None else [value == "on" for value in block_cache],
        seed=engine.get("seed", 0),
        max_seconds=opts.get("max_seconds", 10.0 if quick else 60.0),
        max_steps=opts.get("max_steps", 8 if quick else None),
        warmup_tokens=4 if quick else 16,
        profile_batch=opts.get("profile_batch", 1) if opts.get("profile") or "profile_batch" in opts else None,
        profile_steps=opts.get("profile_steps", 5 if quick else 20),
        roofline_batches=(
            opts.get("roofline_batches", [32, 128])
            if opts.get("linear_roofline") or "roofline_batches" in opts else None
        ),
        quick=quick,
        engine_overrides=engine,
    )
    sizes = opts.get("models", [] if model_dir else default_geometries(strategy))
    if "models" not in opts and sizes:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"diffulex bench throughput measures --models {' '.join(sizes)} unless --model DIR is given; these "
                "random-weight geometries need a CUDA device and none is available: run on a GPU machine, or "
                "measure a small checkpoint on this CPU with --model DIR"
            )
    report = run(settings, sizes, model_dir, load_format, opts.get("data_dir"), opts.get("out"), opts.get("plot"),
                 bool(opts.get("append")), log=lambda line: print(line, flush=True))
    return 1 if report["results"] and all(r["error"] for r in report["results"]) else 0


def cmd_canvas(args: argparse.Namespace) -> int:
    from diffulex.bench.canvas_steps import CanvasBenchSettings, run

    if args.runs or args.config or args.set or args.check or args.json or args.model_path:
        raise ValueError("diffulex bench canvas takes no run directories, --model, --config, --set, --check or --json")
    shared = throughput_options(args)
    unused = set(shared) - {"batch_sizes", "prompt_len", "out", "quick", "profile"}
    evals = eval_overrides(args)
    # --temperature: the canvases' (default 1.0, sampled; 0 greedy, as the performance sweep decodes)
    temperature = evals.pop("temperature", None)
    if unused or evals:
        flags = ", ".join("--" + name.replace("_", "-") for name in sorted(unused | set(evals)))
        raise ValueError(f"{flags}: not used by 'diffulex bench canvas'")
    settings = CanvasBenchSettings(
        batch_sizes=shared.get("batch_sizes", [1, 8]),
        prompt_len=shared.get("prompt_len", 512),
        quick=bool(shared.get("quick")),
        profile=bool(shared.get("profile")),
        engine_overrides=_engine_flag_overrides(args),
        **({} if temperature is None else {"temperature": temperature}),
        **canvas_options(args),
    )
    run(settings, shared.get("out"), log=lambda line: print(line, flush=True))
    return 0


SWEEP_OPTIONS = ("targets", "out", "quick", "max_seconds", "total_seconds", "data_dir", "prefill_parts")


def cmd_sweep(args: argparse.Namespace) -> int:
    from diffulex.bench.sweep import run
    from diffulex.bench.sweep_common import (
        DEFAULT_TARGET_SECONDS,
        DEFAULT_TARGETS,
        PREFILL_PARTS,
        QUICK_TARGET_SECONDS,
        SweepSettings,
    )

    if args.runs or args.config or args.set or args.check or args.json:
        raise ValueError("diffulex bench sweep takes no run directories, --config, --set, --check or --json")
    if eval_overrides(args):
        flags = ", ".join("--" + name.replace("_", "-") for name in eval_overrides(args))
        raise ValueError(f"{flags}: eval keys are not used by 'diffulex bench sweep'")
    opts = throughput_options(args)
    other = [name for name in opts if name not in SWEEP_OPTIONS]
    if other:
        flags = ", ".join("--" + name.replace("_", "-") for name in other)
        raise ValueError(f"{flags}: only for 'diffulex bench throughput'; the sweep sets its own configurations")
    engine = _engine_flag_overrides(args)
    for name in ("model_path", "load_format", "block_size", "buffer_size", "max_num_reqs", "max_model_len"):
        if name in engine:
            flag = "--" + name.replace("_", "-")
            raise ValueError(f"{flag}: the sweep sets it per configuration (docs/benchmarks.md, Performance sweep)")
    if "out" not in opts:
        raise ValueError("diffulex bench sweep needs --out DIR (its JSON, plots and tables.md go there)")
    quick = bool(opts.get("quick"))
    settings = SweepSettings(
        targets=opts.get("targets", list(DEFAULT_TARGETS)), out=opts["out"], quick=quick,
        max_seconds=opts.get("max_seconds", QUICK_TARGET_SECONDS if quick else DEFAULT_TARGET_SECONDS),
        total_seconds=opts.get("total_seconds"), data_dir=opts.get("data_dir"), engine_overrides=engine,
        prefill_parts=opts.get("prefill_parts", list(PREFILL_PARTS)),
    )
    reports = run(settings, log=lambda line: print(line, flush=True))
    failed = [name for name, report in reports.items()
              if report["error"] or (report["rows"] and all(r.get("error") for r in report["rows"]))]
    if failed:
        print(f"every configuration failed in: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def _num(value: Any) -> str:
    return "n/a" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def cmd_compare(args: argparse.Namespace) -> int:
    from diffulex.bench.report import compare_reports, format_comparison, load_report

    if len(args.runs) != 2:
        raise ValueError(f"compare needs two runs (directories or metrics.json files), got {len(args.runs)}")
    cmp = compare_reports(load_report(args.runs[0]), load_report(args.runs[1]))
    if args.json:
        print(json.dumps(cmp, indent=2, default=str))
    else:
        print(format_comparison(cmp))
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m diffulex.bench.cli ...`` (the same as ``diffulex bench ...``)."""
    from diffulex.cli import CommandParser, report_warnings_once, run_command

    report_warnings_once()
    parser = CommandParser(prog="diffulex")
    sub = parser.add_subparsers(dest="command", required=True)
    add_parser(sub)
    args = parser.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())

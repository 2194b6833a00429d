"""One benchmark run: check the config and tasks, build the engine, let lm-eval drive it, write the results.

Files of a run (in ``output_dir/run_<YYYYmmdd_HHMMSS>_<tasks>/``, or ``output_dir`` itself when
``use_run_subdirectory`` is false):

* ``config.yml``: the config as run (file values with command-line overrides applied);
* ``metrics.json``: accuracy per task, every throughput/latency metric, resolved engine settings, versions;
* ``report.md`` + ``report.png``: the same for people, with a plot of latencies and per-step throughput;
* with ``save_results`` (default): ``results.json`` (lm-eval's results), ``samples_<task>.jsonl`` (prompt,
  response, score and per-request numbers of every example) and ``trajectories.jsonl`` (every request's step
  records, enough to recompute all metrics).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import platform
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from diffulex.bench import TASKS_DIR
from diffulex.bench.config import BenchConfig
from diffulex.bench.metrics import compute_metrics, request_timing, step_clock
from diffulex.bench.report import METRICS_FILE, PLOT_FILE, REPORT_FILE, render_markdown, write_plot
from diffulex.bench.scoring import CODE_EXECUTION_ENV

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 1


@dataclass
class RunResult:
    run_dir: Path
    report: dict[str, Any]  # the content of metrics.json


def require_lm_eval() -> None:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError(
            "the benchmark needs lm-eval and matplotlib: pip install 'diffulex[bench]' "
            "(or pip install 'lm-eval>=0.4.5' matplotlib)"
        ) from None


@contextlib.contextmanager
def _environment(values: dict[str, str | None]) -> Iterator[None]:
    """Set environment variables for the duration of the block (None = unset), then restore them."""
    old = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def offline_environment(allow_code_execution: bool) -> contextlib.AbstractContextManager[None]:
    """No hub access during a run (datasets and models come from disk only); the code-execution switch."""
    return _environment(
        {
            "HF_DATASETS_OFFLINE": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            CODE_EXECUTION_ENV: "1" if allow_code_execution else None,
        }
    )


def _drop_custom_dataset_notice(record: logging.LogRecord) -> bool:
    """lm-eval logs a hint about ``--metadata`` for every task with a ``custom_dataset``: all of ours."""
    return "Custom kwargs can be passed" not in record.getMessage()


def task_manager(cfg: BenchConfig) -> Any:
    """lm-eval's TaskManager over the bundled tasks (+ ``include_path``), never lm-eval's own (hub) tasks."""
    from lm_eval.tasks import TaskManager

    task_logger = logging.getLogger("lm_eval.api.task")
    if _drop_custom_dataset_notice not in task_logger.filters:
        task_logger.addFilter(_drop_custom_dataset_notice)

    paths = [str(TASKS_DIR)]
    if cfg.eval.include_path:
        include = Path(cfg.eval.include_path).expanduser()
        if not include.is_dir():
            raise ValueError(f"eval.include_path={cfg.eval.include_path!r} is not an existing directory")
        paths.append(str(include.resolve()))
    metadata: dict[str, Any] = {"diffulex_dataset_split": cfg.eval.dataset_split}
    if cfg.eval.data_file:
        data_file = Path(cfg.eval.data_file).expanduser()
        metadata["diffulex_data_file"] = str(data_file.resolve()) if data_file.exists() else cfg.eval.data_file
    return TaskManager(include_path=paths, include_defaults=False, metadata=metadata)


def load_tasks(cfg: BenchConfig, manager: Any) -> dict[str, Any]:
    """The requested tasks, loaded (their data read); errors for unknown names and forbidden code execution."""
    names = cfg.eval.task_names
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ValueError(
            f"eval.dataset_name: unknown task {', '.join(map(repr, unknown))}; available: "
            f"{', '.join(manager.all_tasks)}"
        )
    for name in names:
        check_task_data(cfg, name, _task_yaml(manager, name))
    with offline_environment(cfg.eval.allow_code_execution):
        try:
            tasks = manager.load(names)["tasks"]
        except Exception as err:  # a template over a key the data lacks (data the check above could not read)
            if type(err).__name__ != "UndefinedError":
                raise
            raise ValueError(
                f"eval.dataset_name={cfg.eval.dataset_name!r}: a task's prompt template uses a key its data rows "
                f"lack: {err}"
            ) from None
    unsafe = sorted(name for name, task in tasks.items() if getattr(task.config, "unsafe_code", False))
    if unsafe and not cfg.eval.allow_code_execution:
        raise ValueError(
            f"tasks {', '.join(map(repr, unsafe))} execute generated code: set eval.allow_code_execution: true "
            "(or pass --allow-code-execution) to run them; the code runs in a subprocess with a timeout"
        )
    return tasks


class _TaskYamlLoader(yaml.SafeLoader):
    """A task YAML read for its plain keys: a tagged value (``!function ...``) is kept as its text."""


def _tag_as_text(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    return loader.construct_scalar(node) if isinstance(node, yaml.ScalarNode) else None


_TaskYamlLoader.add_multi_constructor("!", _tag_as_text)


def _read_task_yaml(path: Path, depth: int = 0) -> dict[str, Any]:
    """A task YAML's keys, over those of the file it ``include``s; {} where it cannot be read (lm-eval reports)."""
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_TaskYamlLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return {}
    if not isinstance(data, dict):
        return {}
    include = data.pop("include", None)
    if isinstance(include, str) and depth < 8:
        data = {**_read_task_yaml(path.parent / include, depth + 1), **data}
    return data


def _task_yaml(manager: Any, name: str) -> dict[str, Any]:
    entry = manager.task_index.get(name)
    path = entry.get("yaml_path") if isinstance(entry, dict) else getattr(entry, "yaml_path", None)
    return _read_task_yaml(Path(path)) if path else {}


def template_keys(task_config: dict[str, Any]) -> list[str]:
    """The row keys a task's prompt and target templates (``doc_to_text``, ``doc_to_target``, ``doc_to_choice``)
    read, in order of first use; a template that is a function is not looked into."""
    import jinja2
    import jinja2.meta

    env = jinja2.Environment()
    keys: dict[str, None] = {}
    for name in ("doc_to_text", "doc_to_target", "doc_to_choice"):
        template = task_config.get(name)
        if not isinstance(template, str) or ("{{" not in template and "{%" not in template):
            continue
        try:
            found = jinja2.meta.find_undeclared_variables(env.parse(template))
        except jinja2.TemplateSyntaxError:
            continue  # lm-eval reports it
        keys.update(dict.fromkeys(sorted(found, key=template.find)))
    return list(keys)


def check_task_data(cfg: BenchConfig, task: str, task_config: dict[str, Any]) -> None:
    """Every row the run evaluates (the first ``eval.dataset_limit``, else all) has each key the task's templates
    read; an error names the data file, the row and the key. Only tasks reading a local JSON file
    (`diffulex.bench.scoring.load_local_dataset`) are checked: their rows are read here, before any weight."""
    from diffulex.bench.scoring import read_split, resolve_data_file

    if not str(task_config.get("custom_dataset") or "").endswith("load_local_dataset"):
        return
    keys = template_keys(task_config)
    kwargs = task_config.get("dataset_kwargs")
    own = kwargs.get("data_file") if isinstance(kwargs, dict) else None
    path = cfg.eval.data_file or own
    if not keys or not isinstance(path, str):
        return
    rows = read_split(path, cfg.eval.dataset_split)
    where = (
        f"eval.data_file={cfg.eval.data_file!r}" if cfg.eval.data_file
        else f"the data file {str(resolve_data_file(path))!r} of task {task!r}"
    )
    for index, row in enumerate(rows[: cfg.eval.dataset_limit]):
        missing = [key for key in keys if key not in row]
        if missing:
            raise ValueError(
                f"{where}: row {index} (counting from 0) has no key {missing[0]!r}; task {task!r} reads "
                f"{', '.join(map(repr, keys))} from every row, and this row has "
                f"{', '.join(map(repr, row)) or 'no keys'}"
            )


def make_run_dir(cfg: BenchConfig, now: _dt.datetime | None = None) -> Path:
    out = Path(cfg.eval.output_dir).expanduser()
    if not cfg.eval.use_run_subdirectory:
        out.mkdir(parents=True, exist_ok=True)
        return out
    now = now or _dt.datetime.now()
    tasks = re.sub(r"[^A-Za-z0-9_.-]+", "_", "+".join(cfg.eval.task_names))[:80]
    base = f"run_{now:%Y%m%d_%H%M%S}_{tasks}"
    run_dir = out / base
    k = 2
    while run_dir.exists():
        run_dir = out / f"{base}_{k}"
        k += 1
    run_dir.mkdir(parents=True)
    return run_dir


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n", encoding="utf-8")


def _accuracy(results: dict[str, Any], tasks: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each task's first metric (``exact_match`` or ``pass@1``) with its stderr and sample count."""
    out = {}
    for name, task in tasks.items():
        res = results.get("results", {}).get(name, {})
        metric_list = getattr(task.config, "metric_list", None) or []
        metric = metric_list[0]["metric"] if metric_list else None
        value = stderr = None
        for key, v in res.items():
            base, _, _filter = key.partition(",")
            if base == metric:
                value = v
            elif base == f"{metric}_stderr":
                stderr = v
        n = results.get("n-samples", {}).get(name, {}).get("effective")
        out[name] = {"metric": metric, "value": value, "stderr": None if stderr == "N/A" else stderr,
                     "num_samples": n}
    return out


def _environment_info(llm: Any) -> dict[str, Any]:
    import importlib.metadata as md

    import torch

    import diffulex

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    device = str(llm.device)
    if llm.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(llm.device)})"
    return {
        "diffulex": diffulex.__version__,
        "torch": torch.__version__,
        "lm_eval": version("lm_eval"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": device,
        "dtype": str(llm.dtype).replace("torch.", ""),
    }


def run_benchmark(cfg: BenchConfig) -> RunResult:
    """Run the benchmark described by ``cfg`` and write its files; returns the run directory and metrics."""
    require_lm_eval()
    from lm_eval import evaluator

    from diffulex import Diffulex
    from diffulex.bench.lm_eval_model import DiffulexLM

    manager = task_manager(cfg)
    tasks = load_tasks(cfg, manager)
    run_dir = make_run_dir(cfg)
    created = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    logger.info("benchmark run %s: tasks %s", run_dir, ", ".join(tasks))
    llm = Diffulex(cfg.model, **cfg.engine)
    try:
        lm = DiffulexLM(
            engine=llm,
            temperature=cfg.eval.temperature,
            max_tokens=cfg.eval.max_tokens,
            max_nfe=cfg.eval.max_nfe,
            max_repetition_run=cfg.eval.max_repetition_run,
            ignore_eos=cfg.eval.ignore_eos,
            use_tqdm=cfg.eval.use_tqdm,
        )
        with offline_environment(cfg.eval.allow_code_execution):
            results = evaluator.simple_evaluate(
                model=lm,
                tasks=list(tasks.values()),
                task_manager=manager,
                limit=cfg.eval.dataset_limit,
                log_samples=True,
                apply_chat_template=cfg.eval.apply_chat_template,
                confirm_run_unsafe_code=cfg.eval.allow_code_execution,
                bootstrap_iters=0,
            )
        report = _build_report(cfg, run_dir, created, llm, lm, results, tasks)
        _write_files(cfg, run_dir, report, lm, results)
    finally:
        llm.exit()
    return RunResult(run_dir, report)


def _build_report(cfg, run_dir, created, llm, lm, results, tasks) -> dict[str, Any]:
    metrics = compute_metrics(lm.batches)
    return {
        "schema": SCHEMA_VERSION,
        "run_name": run_dir.name,
        "run_dir": str(run_dir),
        "created": created,
        "tasks": list(tasks),
        "config": cfg.to_dict(),
        "engine_resolved": llm.config.to_dict(),
        "environment": _environment_info(llm),
        "accuracy": _accuracy(results or {}, tasks),
        "metrics": metrics.to_dict(),
        "batches": [
            {"num_requests": len(b.trajectories), "wall_time_s": b.wall_time, "num_engine_steps": b.num_engine_steps}
            for b in lm.batches
        ],
    }


def _request_rows(lm: Any) -> dict[tuple[str | None, int | None], list[dict[str, Any]]]:
    """Per-request numbers keyed by (task, doc_id), on each batch's step clock."""
    timing_of: dict[int, Any] = {}
    for batch in lm.batches:
        ran = [t for t in batch.trajectories if t.error is None]
        clock = step_clock(ran)
        for traj in ran:
            timing_of[id(traj)] = request_timing(traj, clock)
    rows: dict[tuple[str | None, int | None], list[dict[str, Any]]] = {}
    for rec in lm.records:
        traj = rec.trajectory
        timing = timing_of.get(id(traj))
        rows.setdefault((rec.task, rec.doc_id), []).append(
            {
                "task": rec.task,
                "doc_id": rec.doc_id,
                "prompt_tokens": len(traj.prompt_token_ids),
                "generated_tokens": traj.num_generated_tokens,
                "nfe": traj.nfe,
                "tpf": traj.tpf,
                "latency_s": timing.latency_s if timing else None,
                "ttft_s": timing.ttft_s if timing else None,
                "completion_reason": traj.completion_reason,
                "error": traj.error,
                "steps": [[s.step, s.query_len, s.num_new_tokens, s.step_time] for s in traj.steps],
            }
        )
    return rows


def _write_files(cfg: BenchConfig, run_dir: Path, report: dict[str, Any], lm: Any, results: Any) -> None:
    import yaml

    (run_dir / "config.yml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False), encoding="utf-8")
    has_plot = write_plot(run_dir / PLOT_FILE, lm.batches, title=report["run_name"])
    report["files"] = sorted(
        ["config.yml", METRICS_FILE, REPORT_FILE]
        + ([PLOT_FILE] if has_plot else [])
        + (["results.json", "trajectories.jsonl"] + [f"samples_{t}.jsonl" for t in report["tasks"]]
           if cfg.eval.save_results else [])
    )
    _write_json(run_dir / METRICS_FILE, report)
    (run_dir / REPORT_FILE).write_text(render_markdown(report, PLOT_FILE if has_plot else None), encoding="utf-8")
    if not cfg.eval.save_results:
        return
    results = results or {}
    keep = ("results", "versions", "n-shot", "higher_is_better", "n-samples", "configs", "config", "date",
            "lm_eval_version")
    _write_json(run_dir / "results.json", {k: results[k] for k in keep if k in results})
    rows = _request_rows(lm)
    with (run_dir / "trajectories.jsonl").open("w", encoding="utf-8") as f:
        for entries in rows.values():
            for row in entries:
                f.write(json.dumps(row, default=_json_default) + "\n")
    for task in report["tasks"]:
        with (run_dir / f"samples_{task}.jsonl").open("w", encoding="utf-8") as f:
            for sample in results.get("samples", {}).get(task, []):
                per_request = rows.get((task, sample.get("doc_id")), [{}])[0]
                metric_names = [m for m in results.get("higher_is_better", {}).get(task, {})]
                out = {
                    "doc_id": sample.get("doc_id"),
                    "doc": sample.get("doc"),
                    "prompt": (sample.get("arguments") or [[None]])[0][0],
                    "response": (sample.get("resps") or [[None]])[0][0],
                    "target": sample.get("target"),
                    "scores": {m: sample[m] for m in metric_names if m in sample},
                    **{k: v for k, v in per_request.items() if k not in ("task", "doc_id", "steps")},
                }
                f.write(json.dumps(out, default=_json_default) + "\n")

"""How well a trained checkpoint generalises: exact match and tokens per forward (TPF) on arithmetic problems.

Three test sets, all from the held-out seed (`TEST_SEED`, whose questions `prepare` drops from the training
data):

* ``train-templates``: unseen problems told by the TRAINING templates (new numbers, names and objects);
* ``held-out-templates``: problems told by templates never used in training (new sentence structures);
* ``held-out-pieces``: composed problems (`diffulex.bench.composed_problems`) whose question form, and about
  half of whose clauses, are wordings held out of the composed training problems.

The built-in model's targets concern the first two.

Every setting of the sweep (``buffer_size`` x ``accept_threshold``) runs ``multi_bd`` greedily at the
checkpoint's own block size on both sets, in the chat format (the default) or the plain ``Question: ...
Answer:`` format, and scores the integer after ``####`` with the benchmark's scorer. Runs on a CPU or a GPU
(the engine picks the device).

    python -m diffulex.train eval --model runs/builtin/checkpoint --out eval.json --plot eval.png
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from diffulex.train.data import TEST_SEED, qa_prompt

TEST_SETS = ("train-templates", "held-out-templates", "held-out-pieces")
TARGET_SETS = ("train-templates", "held-out-templates")
PROMPT_FORMATS = ("chat", "qa")
# The built-in model's targets: accuracy on each test set, and TPF at buffer_size=1.
TARGETS = {"train-templates": 0.95, "held-out-templates": 0.80, "tpf_buffer_size_1": 2.5}


def evaluation_sets(n: int, seed: int = TEST_SEED) -> dict[str, list[dict[str, str]]]:
    """``n`` problems of each test set."""
    from diffulex.bench.arithmetic import generate_problems
    from diffulex.bench.composed_problems import compose_problems

    return {
        "train-templates": generate_problems(n, seed, "train"),
        "held-out-templates": generate_problems(n, seed, "held-out"),
        "held-out-pieces": compose_problems(n, seed, "held-out"),
    }


def evaluate_setting(
    model: str,
    sets: dict[str, list[dict[str, str]]],
    *,
    buffer_size: int,
    accept_threshold: float,
    prompt_format: str = "chat",
    max_tokens: int = 128,
) -> list[dict]:
    """One engine, one setting, every set: a row ``{"set", "accuracy", "tpf", "nfe", ...}`` per set."""
    from diffulex import Diffulex, SamplingParams
    from diffulex.bench.scoring import process_arithmetic

    if prompt_format not in PROMPT_FORMATS:
        raise ValueError(f"prompt_format={prompt_format!r} is invalid: must be one of {', '.join(PROMPT_FORMATS)}")
    # chat: the question is the user message of the model's own chat template (what generate applies);
    # qa: the plain `Question: ... Answer:` text, sent as it is
    chat = prompt_format == "chat"
    llm = Diffulex(model=model, decoding_strategy="multi_bd", buffer_size=buffer_size,
                   accept_threshold=accept_threshold)  # fmt: skip
    rows = []
    try:
        for name, problems in sets.items():
            start = time.time()
            prompts = [p["question"] if chat else qa_prompt(p["question"]) for p in problems]
            out = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False,
                               apply_chat_template=chat)  # fmt: skip
            seconds = time.time() - start
            correct = sum(
                process_arithmetic(p, [text])["exact_match"] for p, text in zip(problems, out.texts, strict=True)
            )
            rows.append({
                "set": name, "prompt_format": prompt_format, "block_size": llm.config.block_size,
                "buffer_size": buffer_size, "accept_threshold": accept_threshold, "n": len(problems),
                "correct": int(correct), "with_final_line": sum("####" in text for text in out.texts),
                "accuracy": correct / len(problems) if problems else 0.0,
                "tpf": round(out.tpf, 4), "nfe": round(out.nfe, 3), "seconds": round(seconds, 2),
            })  # fmt: skip
    finally:
        llm.exit()
    return rows


def sweep(
    model: str,
    n: int,
    buffer_sizes: list[int],
    thresholds: list[float],
    *,
    prompt_format: str = "chat",
    max_tokens: int = 128,
    seed: int = TEST_SEED,
    log: bool = False,
    out: Path | None = None,
) -> dict:
    """Every setting on both test sets, and whether the issue's targets are met (see `check_targets`).
    With `out`, the JSON is rewritten after every setting, so a run cut short keeps what it measured."""
    sets = evaluation_sets(n, seed)
    summary = {"model": model, "n": n, "seed": seed, "prompt_format": prompt_format, "max_tokens": max_tokens,
               "results": []}  # fmt: skip
    results = summary["results"]
    for k in buffer_sizes:
        for tau in thresholds:
            for row in evaluate_setting(model, sets, buffer_size=k, accept_threshold=tau,
                                        prompt_format=prompt_format, max_tokens=max_tokens):  # fmt: skip
                results.append(row)
                if log:
                    print(f"{row['set']:<19} buffer_size={k} accept_threshold={tau:<5g} "
                          f"accuracy {100 * row['accuracy']:5.1f}%  TPF {row['tpf']:.2f}  "
                          f"NFE {row['nfe']:.1f}  {row['seconds']:.1f}s", flush=True)  # fmt: skip
            summary["targets"] = check_targets(results)
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    summary["targets"] = check_targets(results)
    return summary


def check_targets(results: list[dict]) -> dict:
    """The issue's targets at the best setting with ``buffer_size=1``: the accuracy of each target set and the
    TPF must all hold at that one setting (the threshold with the highest held-out-template accuracy)."""
    by_setting: dict[tuple[int, float], dict[str, dict]] = {}
    for r in results:
        by_setting.setdefault((r["buffer_size"], r["accept_threshold"]), {})[r["set"]] = r
    candidates = [(tau, rows) for (k, tau), rows in by_setting.items() if k == 1 and set(TARGET_SETS) <= set(rows)]
    if not candidates:
        return {"checked": False, "reason": "no buffer_size=1 setting with both target sets"}
    tau, rows = max(candidates, key=lambda c: (c[1]["held-out-templates"]["accuracy"], c[0]))
    tpf = min(rows[name]["tpf"] for name in TARGET_SETS)
    met = {
        "train-templates": rows["train-templates"]["accuracy"] >= TARGETS["train-templates"],
        "held-out-templates": rows["held-out-templates"]["accuracy"] >= TARGETS["held-out-templates"],
        "tpf_buffer_size_1": tpf >= TARGETS["tpf_buffer_size_1"],
    }
    return {"checked": True, "buffer_size": 1, "accept_threshold": tau, "targets": TARGETS,
            "accuracy": {name: rows[name]["accuracy"] for name in TARGET_SETS}, "tpf": tpf, "met": met,
            "all_met": all(met.values())}  # fmt: skip


def plot(results: list[dict], path: Path, title: str) -> None:
    """Accuracy against TPF, one line per test set and buffer size (points: accept thresholds)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    styles = {"train-templates": "-", "held-out-templates": "--", "held-out-pieces": ":"}
    for name, style in styles.items():
        for k in sorted({r["buffer_size"] for r in results}):
            rows = sorted((r for r in results if r["buffer_size"] == k and r["set"] == name),
                          key=lambda r: r["accept_threshold"])  # fmt: skip
            if rows:
                ax.plot([r["tpf"] for r in rows], [100 * r["accuracy"] for r in rows], style, marker="o",
                        label=f"{name}, buffer_size={k}")  # fmt: skip
    ax.axhline(100 * TARGETS["train-templates"], color="grey", lw=0.8, ls=":")
    ax.axhline(100 * TARGETS["held-out-templates"], color="grey", lw=0.8, ls=":")
    ax.axvline(TARGETS["tpf_buffer_size_1"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("exact match (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _numbers(text: str, cast: type, flag: str) -> list:
    try:
        values = [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise argparse.ArgumentTypeError(f"{flag}={text!r} is invalid: must be a comma-separated list of numbers")
    return values


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in model)")
    parser.add_argument("--n", type=int, default=200, help="problems per test set (default 200)")
    parser.add_argument("--seed", type=int, default=TEST_SEED, help=f"test seed (default {TEST_SEED})")
    parser.add_argument("--buffer-sizes", default="1,2", help="comma-separated (default 1,2)")
    parser.add_argument("--thresholds", default="0.5,0.7,0.9", help="accept thresholds (default 0.5,0.7,0.9)")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="chat",
                        help="chat template or 'Question: ... Answer:' (default chat)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=128, help="default 128")
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--plot", default=None, help="PNG file: accuracy against TPF")


def run_eval(args: argparse.Namespace) -> int:
    """The ``eval`` command; exit status 0 whether or not the targets are met (they are reported)."""
    from diffulex import BUILTIN_MODEL

    if args.n < 1:
        print(f"error: --n={args.n} is invalid: must be at least 1", file=sys.stderr)
        return 2
    try:
        buffer_sizes = _numbers(args.buffer_sizes, int, "--buffer-sizes")
        thresholds = _numbers(args.thresholds, float, "--thresholds")
    except argparse.ArgumentTypeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    model = args.model or BUILTIN_MODEL
    summary = sweep(model, args.n, buffer_sizes, thresholds, prompt_format=args.prompt_format,
                    max_tokens=args.max_tokens, seed=args.seed, log=True,
                    out=Path(args.out) if args.out else None)  # fmt: skip
    t = summary["targets"]
    if t["checked"]:
        print(f"targets at buffer_size=1, accept_threshold={t['accept_threshold']:g}: "
              f"train-templates {100 * t['accuracy']['train-templates']:.1f}% (>= 95%), "
              f"held-out-templates {100 * t['accuracy']['held-out-templates']:.1f}% (>= 80%), "
              f"TPF {t['tpf']:.2f} (>= 2.5): {'all met' if t['all_met'] else 'NOT all met'}", flush=True)  # fmt: skip
    if args.plot:
        title = f"{Path(model).name}: {args.n} problems per set, {args.prompt_format} prompts, greedy"
        try:
            plot(summary["results"], Path(args.plot), title)
        except ImportError:
            print(f"no plot written to {args.plot}: matplotlib is not installed", file=sys.stderr)
    return 0

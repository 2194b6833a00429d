"""Accuracy against tokens-per-forward of a checkpoint on held-out arithmetic problems (greedy, CPU is fine).

    python tools/eval_builtin.py --n 200 --out docs/data/builtin_sweep.json --plot docs/images/builtin_sweep.png

For every ``buffer_size`` and ``accept_threshold`` it runs ``multi_bd`` at the checkpoint's own block size (the
engine takes it from ``config.json``) on the chat-templated questions of
``diffulex.bench.arithmetic.generate_problems(n, 1234)`` (the held-out seed: no training problem has one of these
questions) and scores the integer after ``####`` against the reference answer.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ANSWER_RE = re.compile(r"####\s*(-?[\d,]+)")


def extract_answer(text: str) -> str | None:
    m = ANSWER_RE.search(text)
    return m.group(1).replace(",", "") if m else None


def reference_answer(solution: str) -> str:
    return solution.rsplit("####", 1)[-1].strip()


def evaluate(
    model: str,
    problems: list[dict[str, str]],
    *,
    buffer_size: int,
    accept_threshold: float,
    max_tokens: int = 128,
) -> dict:
    """One setting: ``{"block_size", "accuracy", "tpf", "nfe", "seconds", "correct", "n"}``."""
    from diffulex import Diffulex, SamplingParams

    llm = Diffulex(
        model=model,
        decoding_strategy="multi_bd",
        buffer_size=buffer_size,
        accept_threshold=accept_threshold,
    )
    prompts = [p["question"] for p in problems]  # generate asks a chat model through its template
    start = time.time()
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    seconds = time.time() - start
    correct = sum(
        extract_answer(text) == reference_answer(p["answer"]) for p, text in zip(problems, outputs.texts, strict=True)
    )
    block_size = llm.config.block_size
    close = getattr(llm, "exit", None) or getattr(llm, "close", None)
    if callable(close):
        close()
    return {
        "block_size": block_size,
        "buffer_size": buffer_size,
        "accept_threshold": accept_threshold,
        "n": len(problems),
        "correct": correct,
        "accuracy": correct / len(problems),
        "tpf": outputs.tpf,
        "nfe": outputs.nfe,
        "seconds": round(seconds, 2),
    }


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k in sorted({r["buffer_size"] for r in results}):
        rows = sorted((r for r in results if r["buffer_size"] == k), key=lambda r: r["accept_threshold"])
        ax.plot([r["tpf"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=f"buffer_size={k}")
        lo, hi = rows[0], rows[-1]
        label = f"τ {lo['accept_threshold']:g}–{hi['accept_threshold']:g}"
        ax.annotate(label, (hi["tpf"], 100 * hi["accuracy"]), xytext=(0, -12 - 10 * (k % 2)),
                    textcoords="offset points", fontsize=7, ha="center", alpha=0.8)  # fmt: skip
    ax.set_xlabel("tokens per forward (TPF)")
    ax.set_ylabel("exact match (%)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from diffulex.bench.arithmetic import generate_problems

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: the built-in model)")
    parser.add_argument("--n", type=int, default=200, help="held-out problems (seed 1234)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--buffer-sizes", default="1,2,3,4")
    parser.add_argument("--thresholds", default="0.5,0.6,0.7,0.8,0.9,0.95")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", default=None, help="JSON file for the results")
    parser.add_argument("--plot", default=None, help="PNG file for accuracy against TPF")
    parser.add_argument("--replot", default=None, help="only redraw --plot from this results JSON")
    args = parser.parse_args(argv)
    if args.replot:
        summary = json.loads(Path(args.replot).read_text(encoding="utf-8"))
        title = f"built-in model, {summary['n']} held-out arithmetic problems (greedy)"
        plot(summary["results"], Path(args.plot or "builtin_sweep.png"), title)
        return 0
    model = args.model
    if model is None:
        model = str(Path(__file__).resolve().parents[1] / "diffulex" / "builtin_model")
    problems = generate_problems(args.n, args.seed)
    results = []
    for k in (int(x) for x in args.buffer_sizes.split(",")):
        for tau in (float(x) for x in args.thresholds.split(",")):
            r = evaluate(model, problems, buffer_size=k, accept_threshold=tau, max_tokens=args.max_tokens)
            results.append(r)
            print(
                f"buffer_size={k} accept_threshold={tau:<5g} accuracy {100 * r['accuracy']:5.1f}%  "
                f"TPF {r['tpf']:.2f}  NFE {r['nfe']:.1f}  {r['seconds']:.1f}s",
                flush=True,
            )
    shown = model if not Path(model).is_absolute() else os.path.relpath(model)
    summary = {"model": shown, "n": args.n, "seed": args.seed, "max_tokens": args.max_tokens, "results": results}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(results, Path(args.plot), f"built-in model, {args.n} held-out arithmetic problems (greedy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

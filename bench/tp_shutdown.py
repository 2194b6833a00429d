"""Tensor-parallel shutdown on two GPUs (NCCL): each TP=2 engine's exit lets its worker stop by itself.

    PYTHONPATH=. python bench/tp_shutdown.py OUT_DIR [--engines 2]

Builds ``--engines`` TP=2 engines one after the other (float32, a small random SDAR checkpoint, CUDA graphs), each
generating a few tokens, then times its ``exit()`` and reads its worker's exit code, and whether the engine logged
"did not stop; killing it" (rank 0 giving up on a worker, `TensorParallelWorkers.shutdown`). A clean shutdown:
exit code 0, no such warning, and ``exit()`` well under `SHUTDOWN_WAIT_S`. With Ray installed (``import ray``) the
same runs once more with ``distributed_executor_backend="ray"`` (the workers as Ray actors on a local instance).

Prints one line per engine and writes ``OUT_DIR/tp_shutdown.json``; exits non-zero when a shutdown was not clean.
Needs two CUDA devices; fails at once with a message without them.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from diffulex import Diffulex, SamplingParams
from diffulex.engine.tensor_parallel import SHUTDOWN_WAIT_S
from diffulex.testing.checkpoints import write_tiny_checkpoint
from diffulex.testing.distributed import free_port

GEOMETRY = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                intermediate_size=1024)  # fmt: skip
CLEAN_EXIT_S = SHUTDOWN_WAIT_S / 3  # an exit that waited out most of the wait was not clean


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def one_engine(path: Path, backend: str, index: int) -> dict:
    warnings = Warnings()
    logging.getLogger("diffulex").addHandler(warnings)
    row: dict = {"backend": backend, "engine": index, "error": None}
    try:
        llm = Diffulex(str(path), tensor_parallel_size=2, distributed_executor_backend=backend, dtype="float32",
                       block_size=4, max_model_len=256, max_num_reqs=4, master_addr="127.0.0.1",
                       master_port=free_port())  # fmt: skip
        (worker,) = llm.workers.workers
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
        row["tokens"] = len(out.trajectories[0].token_ids)
        started = time.perf_counter()
        llm.exit()
        row["exit_s"] = round(time.perf_counter() - started, 3)
        row["worker_exitcode"] = worker.process.exitcode
    except Exception:  # noqa: BLE001  (recorded; the other runs go on)
        row["error"] = traceback.format_exc()
    finally:
        logging.getLogger("diffulex").removeHandler(warnings)
    row["terminated_warnings"] = [m for m in warnings.messages if "did not stop" in m]
    row["clean"] = (row["error"] is None and row.get("worker_exitcode") == 0 and not row["terminated_warnings"]
                    and row["exit_s"] < CLEAN_EXIT_S)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory for tp_shutdown.json")
    parser.add_argument("--engines", type=int, default=2, help="TP=2 engines built one after the other (default 2)")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        print(f"error: bench/tp_shutdown.py needs two CUDA devices, this machine has {count}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    backends = ["mp"] + (["ray"] if importlib.util.find_spec("ray") is not None else [])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_checkpoint(Path(tmp) / "sdar", "sdar", seed=1, init_std=1.0, dtype=torch.float32,
                                     **GEOMETRY)
        for backend in backends:
            for index in range(args.engines):
                row = one_engine(path, backend, index)
                rows.append(row)
                print(f"{backend} engine {index}: exit {row.get('exit_s')} s, worker exit code "
                      f"{row.get('worker_exitcode')}, terminated: {bool(row['terminated_warnings'])}, clean: "
                      f"{row['clean']}" + (f"\n{row['error']}" if row["error"] else ""), flush=True)
                (out / "tp_shutdown.json").write_text(json.dumps(
                    {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                     "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
                     "rows": rows}, indent=2) + "\n", encoding="utf-8")
    return 0 if all(r["clean"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

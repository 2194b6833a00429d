"""(experiment) Timestamps inside the attention launch of the batch-1 graph replay.

    patch -p1 < bench/patches/attention_stamps.patch      # the stamps, and switches for the A/B runs below
    PYTHONPATH=. python bench/attention_trace.py
    patch -p1 -R < bench/patches/attention_stamps.patch

The patch adds the stamps (on when ``DIFFULEX_ATTN_TRACE=1``, which this script sets) and switches for session
10's experiments: ``DIFFULEX_ATTN_RELEASE`` (start / loops / publish: where attention lets the next kernel
start), ``DIFFULEX_ATTN_COMBINE`` (full / nocombine / noatomic: upper bounds of the split combine),
``DIFFULEX_ATTN_WARPS``, ``DIFFULEX_ATTN_STAGES``, ``DIFFULEX_ATTN_BLOCK_N``, ``DIFFULEX_ATTN_MIN_SPLIT`` and
``DIFFULEX_ATTN_PREFETCH_KEYS``.

Each attention program records %globaltimer at entry, before and after its PDL wait, when q has arrived, after
its cached-key and new-key loops, after publishing its partial, and (the combining split) after the merge; the
q/k-norm + rotary launch before it records when each of its programs ends. Every layer overwrites the same
buffer, so one replay leaves the last layer's record. Times print relative to the rotary launch's last end.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

os.environ["DIFFULEX_ATTN_TRACE"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402
from step_anatomy import smallest_graph  # noqa: E402
from what_if import decoding_engine  # noqa: E402

from diffulex.kernels import paged_attention as pa  # noqa: E402

NAMES = ["entry", "pre_wait", "waited", "q", "cached", "new", "published", "combined"]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        engine = decoding_engine(Path(tmp), "1.7b", "tests/data/sdar-4b-chat")
        graph = smallest_graph(engine)
        buf = pa.trace_buffer(torch.device("cuda", torch.cuda.current_device()))
        summary = {n: [] for n in NAMES}
        for rep in range(int(os.environ.get("REPS", "10"))):
            with torch.inference_mode():
                buf.zero_()
            graph.replay()
            torch.cuda.synchronize()
            b = buf.cpu().numpy()
            rope = b[-4096:]
            rope = rope[rope > 0]
            att = b[: 7000 * pa.TRACE_SLOTS].reshape(-1, pa.TRACE_SLOTS)
            att = att[att[:, 0] > 0]
            t0 = rope.max()
            active = att[(att[:, 1] > 0) & (att[:, 5] > 0)]  # programs that had keys to fold
            if rep == 0:
                print(f"rope programs {len(rope)}: ends from {(rope.min() - t0) / 1e3:.2f} to 0 us")
                print(f"attention programs {len(att)}, active {len(active)}; entries from "
                      f"{(att[:, 0].min() - t0) / 1e3:.2f} to {(att[:, 0].max() - t0) / 1e3:.2f} us")
                for row in active[np.argsort(active[:, 0])]:
                    cells = " ".join(f"{(row[i] - t0) / 1e3:6.2f}" if row[i] > 0 else "     -" for i in range(8))
                    print(f"TRACE sm={row[8]:3d} pid0={row[9]:3d} active={row[10]} done={row[11]} {cells}")
            for i, n in enumerate(NAMES):
                vals = active[:, i][active[:, i] > 0]
                if len(vals):
                    summary[n].append(((vals.min() - t0) / 1e3, np.median(vals - t0) / 1e3, (vals.max() - t0) / 1e3))
        print("event      min    median   max   (us after the rotary launch's last end, mean over replays)")
        for n in NAMES:
            if summary[n]:
                a = np.array(summary[n]).mean(axis=0)
                print(f"SUMMARY {n:10s} {a[0]:7.2f} {a[1]:7.2f} {a[2]:7.2f}")
        engine.exit()


if __name__ == "__main__":
    main()

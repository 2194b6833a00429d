"""What a replica's per-step message costs the engine (encode, pickle) and the server (unpickle, rebuild), per step.

    CUDA_VISIBLE_DEVICES= PYTHONPATH=. python bench/replica_message_cost.py [--requests 128] [--interest commits]

A tiny SDAR engine (its forward a zero stand-in, so only host work runs) steps ``--requests`` requests of 64-255
answer tokens through their whole lives, finishes included, as streamed text would be read (``--interest``). Each
step's updates go through the replica's `UpdateEncoder`, a pickle round trip and the parent's `UpdateDecoder`,
timed apart from the step itself. Deterministic enough to compare two trees on a busy CPU, unlike a whole server.
"""

from __future__ import annotations

import argparse
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from server_step_rate import PROMPT_WORDS, build_sleeping_engine, engine_fields  # noqa: E402

from diffulex import SamplingParams  # noqa: E402
from diffulex.bench.load import make_prompt  # noqa: E402
from diffulex.engine.replica_process import UpdateDecoder, UpdateEncoder  # noqa: E402
from diffulex.testing.checkpoints import write_tiny_checkpoint  # noqa: E402

MIN_TOKENS, TOKEN_SPREAD = 64, 192


def run(engine: Any, requests: int, interest: str) -> tuple[int, int, int, float, float]:
    """Steps, updates sent, bytes sent, seconds encoding and seconds decoding over the requests' whole lives."""
    encoder, decoder = UpdateEncoder(), UpdateDecoder()
    for i in range(requests):
        params = SamplingParams(temperature=0.0, max_tokens=MIN_TOKENS + (i * 37) % TOKEN_SPREAD, ignore_eos=True)
        rid = engine.add_request(make_prompt(i, PROMPT_WORDS), params)
        if hasattr(encoder, "add"):  # a tree whose replicas are told what the server reads
            encoder.add(rid, False, interest)
    encode_s = decode_s = 0.0
    steps = sent = size = 0
    while not engine.is_finished():
        updates = engine.step()
        t0 = time.perf_counter()
        messages = [m for u in updates if (m := encoder.encode(u, u.req_id)) is not None]
        data = pickle.dumps(("updates", messages, engine.load(), None), protocol=pickle.HIGHEST_PROTOCOL)
        t1 = time.perf_counter()
        for message in pickle.loads(data)[1]:
            decoder.decode(message)
        decode_s += time.perf_counter() - t1
        encode_s += t1 - t0
        steps, sent, size = steps + 1, sent + len(messages), size + len(data)
    return steps, sent, size, encode_s, decode_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--interest", default="commits", choices=["steps", "commits", "end"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(Path(tmp) / "tiny", family="sdar", seed=0))
        engine = build_sleeping_engine(model, engine_fields(args.requests, 0.0))
        try:
            steps, sent, size, encode_s, decode_s = run(engine, args.requests, args.interest)
        finally:
            engine.exit()
    print(f"{args.requests} requests, {steps} steps; per step: engine {1e3 * encode_s / steps:.3f} ms, server "
          f"{1e3 * decode_s / steps:.3f} ms, {size / steps / 1e3:.1f} kB, {sent / steps:.1f} updates")


if __name__ == "__main__":
    main()

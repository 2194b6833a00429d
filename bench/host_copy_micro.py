"""Host cost of the small operations a decode step does around its graph replay (timed one by one on CUDA)."""

from __future__ import annotations

import time

import torch


def timed(label: str, fn, n: int = 200) -> None:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    samples.sort()
    print(f"{label:55s} median {1e6 * samples[n // 2]:7.1f} us   p90 {1e6 * samples[9 * n // 10]:7.1f} us")


def main() -> None:
    dev = torch.device("cuda")
    host = torch.zeros(12, dtype=torch.int64, pin_memory=True)
    dst = torch.zeros(12, dtype=torch.int64, device=dev)
    lay_host = torch.zeros(4 + 64, dtype=torch.int32, pin_memory=True)
    lay = torch.zeros_like(lay_host, device=dev)
    ev = torch.cuda.Event()
    ev.record()
    np_view = host.numpy()
    big_host = torch.zeros(3 * 512 * 8, dtype=torch.int64, pin_memory=True)
    big = torch.zeros_like(big_host, device=dev)
    timed("event.synchronize (completed)", ev.synchronize)
    timed("event.record", ev.record)
    timed("numpy slice write from list (4)", lambda: np_view.__setitem__(slice(0, 4), [1, 2, 3, 4]))
    timed("copy_ pinned->dev 96 B non_blocking", lambda: dst.copy_(host, non_blocking=True))
    timed("copy_ pinned slice->dev non_blocking", lambda: lay[:5].copy_(lay_host[:5], non_blocking=True))
    timed("copy_ pinned->dev 96 KB non_blocking", lambda: big.copy_(big_host, non_blocking=True))
    timed("torch.tensor(list, pin_memory=True)", lambda: torch.tensor([1, 2, 3, 4, 5], pin_memory=True))
    timed("torch.tensor(list, pin).to(dev, non_blocking)",
          lambda: torch.tensor([1, 2, 3, 4, 5], pin_memory=True).to(dev, non_blocking=True))
    timed("torch.tensor(list).to(dev) pageable", lambda: torch.tensor([1, 2, 3, 4, 5]).to(dev))
    x = torch.zeros(2, 4, dtype=torch.int64, device=dev)
    timed("tolist of [2,4] cuda tensor", x.tolist)
    timed("torch.empty on cuda", lambda: torch.empty(16, device=dev))
    a = torch.zeros(4, 2048, device=dev, dtype=torch.bfloat16)
    idx = torch.zeros(4, dtype=torch.int64, device=dev)
    timed("index_select [4,2048]", lambda: a.index_select(0, idx))



def fill_breakdown(model_size: str = "1.7b", steps: int = 40) -> None:
    """Time each statement group of `DecodeGraphs._fill` inside real decode steps."""
    import tempfile
    from pathlib import Path

    from diffulex import Diffulex
    from diffulex.bench.throughput import _admit_until_decoding, _greedy, random_prompts, write_sdar_checkpoint

    marks: dict[str, list[float]] = {}

    def mark(label: str, t0: float) -> float:
        now = time.perf_counter()
        marks.setdefault(label, []).append(now - t0)
        return now

    with tempfile.TemporaryDirectory() as tmp:
        path = write_sdar_checkpoint(Path(tmp) / model_size, model_size, "tests/data/sdar-4b-chat")
        engine = Diffulex(str(path), block_size=4, buffer_size=1, max_num_reqs=1, max_model_len=1024,
                          load_format="dummy")
        graphs = engine.runner.graphs

        def fill(step, bucket):
            s, R, T = graphs.shape, graphs.shape.max_requests, graphs.shape.max_tokens
            t = time.perf_counter()
            graphs._copied.synchronize()
            t = mark("event sync", t)
            n_tok, r = step.num_tokens, step.num_requests
            n = bucket * s.max_query_len
            tok = graphs._tokens_np
            tok[:n_tok] = step.input_ids
            tok[n_tok:n] = 0
            tok[T : T + n_tok] = step.positions
            tok[T + n_tok : T + n] = 0
            tok[2 * T : 2 * T + n_tok] = step.slot_mapping
            tok[2 * T + n_tok : 2 * T + n] = -1
            t = mark("token numpy writes", t)
            lay = graphs._layout_np
            lay[: r + 1] = step.cu_seqlens_q
            lay[r + 1 : bucket + 1] = n_tok
            lay[R + 1 : R + 1 + r] = step.context_lens
            lay[R + 1 + r : R + 1 + bucket] = 0
            lay[2 * R + 1 : 2 * R + 1 + r] = step.prefix_lens
            lay[2 * R + 1 + r : 2 * R + 1 + bucket] = 0
            t = mark("layout numpy writes", t)
            tables = lay[graphs._head_len : graphs._head_len + bucket * s.max_pages].reshape(bucket, s.max_pages)
            tables.fill(-1)
            for i, table in enumerate(step.page_tables):
                tables[i, : len(table)] = table
            t = mark("page tables", t)
            graphs._tokens.copy_(graphs._tokens_host, non_blocking=True)
            t = mark("tokens copy", t)
            end = graphs._head_len + bucket * s.max_pages
            graphs._layout[:end].copy_(graphs._layout_host[:end], non_blocking=True)
            t = mark("layout copy", t)
            graphs._copied.record()
            mark("event record", t)

        graphs._fill = fill
        prompts = random_prompts(engine.vocab_limit, engine.mask_token_id, 1, 128, 0)
        engine.add_request(prompts[0], _greedy(800))
        _admit_until_decoding(engine, list(engine.scheduler.waiting), 20)
        for _ in range(steps):
            engine.step()
        engine.exit()
    for label, values in marks.items():
        values = sorted(values[5:])
        print(f"fill: {label:25s} median {1e6 * values[len(values) // 2]:7.1f} us")


def after_wait(wait_us: float = 3000.0, n: int = 100) -> None:
    """Host cost of the same small operations right after waiting for ~`wait_us` of GPU work, by wait style."""
    dev = torch.device("cuda")
    host = torch.zeros(12, dtype=torch.int64, pin_memory=True)
    dst = torch.zeros(12, dtype=torch.int64, device=dev)
    out = torch.zeros(2, 4, dtype=torch.int64, device=dev)
    ev = torch.cuda.Event()
    done = torch.cuda.Event()
    cycles = int(wait_us * 1.7e3)  # ~1.7 GHz SM clock

    def wait_tolist() -> None:
        out.tolist()

    def wait_poll() -> None:
        done.record()
        while not done.query():
            pass
        out.tolist()

    def wait_event_sync() -> None:
        done.record()
        done.synchronize()
        out.tolist()

    styles = (("tolist", wait_tolist), ("poll event.query", wait_poll), ("event.synchronize", wait_event_sync))
    for label, wait in styles:
        samples = []
        for i in range(n + 5):
            torch.cuda._sleep(cycles)
            wait()
            t0 = time.perf_counter()
            dst.copy_(host, non_blocking=True)
            ev.record()
            host.numpy()[:4] = [1, 2, 3, 4]
            dst.copy_(host, non_blocking=True)
            if i >= 5:
                samples.append(time.perf_counter() - t0)
        samples.sort()
        median = 1e6 * samples[n // 2]
        print(f"after {wait_us:.0f} us GPU wait via {label:18s}: copy+record+write+copy median {median:6.1f} us")


if __name__ == "__main__":
    main()
    after_wait()
    after_wait(300.0)
    fill_breakdown()

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

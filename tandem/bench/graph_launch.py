"""What a decode graph's launch costs the host, pattern by pattern (CUDA only).

Inside the engine's loop `cudaGraphLaunch` took 0.2-0.4 ms of host a step on the H200 at
a14d1c1 (torch.profiler), against 0.011 ms for 20 replays of one graph back to back. The loop
differs in two ways: it alternates between the staging ring slots' graphs, and each replay
follows a cross-stream wait for the staged inputs. Each pattern below isolates one of them,
with one step in flight as in the loop (the host waits for replay i - 1 after queueing i):

    python3 -m tandem.bench.graph_launch --preset qwen3-0.6b --bucket 1 --bucket 256
"""
import argparse
import time
from typing import Callable

import torch

from tandem.bench.presets import preset_dir
from tandem.config import EngineConfig
from tandem.entrypoints.ranks import build_engine


def launch_us(replay: Callable[[int], None], before: Callable[[int], None] | None = None,
              n: int = 41, in_flight: int = 1) -> float:
    """Median host microseconds of `replay(i)`, `in_flight` replays queued ahead of the host."""
    torch.cuda.synchronize()
    times, done = [], []
    for i in range(n):
        if before is not None:
            before(i)
        start = time.perf_counter()
        replay(i)
        times.append(time.perf_counter() - start)
        event = torch.cuda.Event()
        event.record()
        done.append(event)
        if len(done) > in_flight:
            done.pop(0).synchronize()
    torch.cuda.synchronize()
    return sorted(times)[n // 2] * 1e6


def patterns(engine, bucket: int) -> dict[str, float]:
    graphs, streams = engine.runner.graphs, engine.streams
    forward, schedule = streams.forward, streams.schedule
    depth = engine.stager.depth
    host = torch.zeros(4 * bucket + 64, dtype=torch.int64, pin_memory=True)
    ring = [torch.zeros_like(host, device=streams.device) for _ in range(depth)]
    static = torch.zeros_like(ring[0])

    def graph(ring_slot: int):
        return graphs.graphs[(bucket, ring_slot, False)][0]

    def staged(i: int) -> None:  # the loop's staging: H2D on the schedule stream, the forward waits
        with torch.cuda.stream(schedule):
            ring[i % depth].copy_(host, non_blocking=True)
        forward.wait_stream(schedule)

    def copy_then_replay(i: int) -> None:  # one graph a bucket, fed from the ring slot on the forward stream
        static.copy_(ring[i % depth], non_blocking=True)
        graph(0).replay()

    with torch.cuda.stream(forward):
        return {
            "same graph": launch_us(lambda i: graph(0).replay()),
            "same graph, 8 queued": launch_us(lambda i: graph(0).replay(), in_flight=8),
            "alternating ring slots": launch_us(lambda i: graph(i % depth).replay()),
            "same graph, staged copy + wait": launch_us(lambda i: graph(0).replay(), before=staged),
            "alternating, staged copy + wait (the loop)": launch_us(lambda i: graph(i % depth).replay(), before=staged),
            "one graph + device copy, staged copy + wait": launch_us(copy_then_replay, before=staged),
        }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tandem.bench.graph_launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-0.6b")
    ap.add_argument("--bucket", type=int, action="append", help="decode graph bucket (repeatable; default 1 and 256)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch: needs a CUDA device")
    buckets = args.bucket or [1, 256]
    engine = build_engine(EngineConfig(model=preset_dir(args.preset), dummy_weights=True,
                                       max_running_requests=max(buckets)))
    try:
        if engine.runner.graphs is None:
            raise SystemExit("graph_launch: the engine captured no decode graphs")
        print("| pattern | " + " | ".join(f"bucket {b}, host us" for b in buckets) + " |")
        print("|---|" + "---:|" * len(buckets))
        rows = {b: patterns(engine, engine.runner.graphs.bucket(b)) for b in buckets}
        for name in rows[buckets[0]]:
            print(f"| {name} | " + " | ".join(f"{rows[b][name]:.0f}" for b in buckets) + " |")
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

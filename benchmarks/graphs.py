"""CUDA-graph capture and replay timing shared by the benchmark suites.

``capture(fn)`` warms ``fn`` up on a side stream (autotuning, allocator) and
captures it; ``replay_us(graph)`` is the median device time of a replay
between two events, divided by the calls the graph holds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["capture", "median", "replay_us"]


def median(values):
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def capture(fn: Callable[[], object], warmups: int = 2,
            warmup: Callable[[], object] | None = None) -> torch.cuda.CUDAGraph:
    """``fn`` in a CUDA graph, after ``warmups`` runs of ``warmup`` (default
    ``fn``) on a side stream."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            (warmup or fn)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, replays: int, calls: int = 1,
              warm_replays: int = 1) -> float:
    """Median µs per call of ``graph`` (holding ``calls`` calls) over ``replays``
    replays, each between two device events, after ``warm_replays`` untimed."""
    for _ in range(warm_replays):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return median(times)

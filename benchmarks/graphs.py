"""CUDA-graph capture and replay timing shared by the benchmark suites, and
the suites' host timer.

``capture(fn)`` warms ``fn`` up on a side stream (autotuning, allocator) and
captures it; ``replay_us(graph)`` is the median device time of a replay
between two events, divided by the calls the graph holds.  ``host_rounds``
times calls on the host, rounds interleaved across them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

__all__ = ["capture", "host_rounds", "median", "replay_us"]


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


def host_rounds(calls: dict[str, Callable[[], object]], repeats: int, rounds: int,
                around: Callable[[str], contextlib.AbstractContextManager] | None = None,
                ) -> dict[str, list[float]]:
    """Host µs per call of each of ``calls``, one sample per round: ``repeats``
    calls back to back with no synchronisation inside, ``rounds`` rounds
    interleaved across the calls (a host that slows down slows them alike).
    The GPU, if any, is drained before and after each timed run;
    ``around(name)`` is entered around each (e.g. a launch-path switch)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            with around(name) if around else contextlib.nullcontext():
                sync()
                t0 = time.perf_counter()
                for _ in range(repeats):
                    fn()
                samples[name].append((time.perf_counter() - t0) / repeats * 1e6)
                sync()
    return samples

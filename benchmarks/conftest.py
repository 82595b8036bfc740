"""Kernel benchmark harness (pytest-benchmark).

Every case measures, in the same process:

  * ``ours``      -- the series' kernel,
  * ``baseline``  -- what upstream vLLM runs today for the same job,
  * ``copy``      -- a device-to-device ``copy_`` of the same number of bytes
                     (added here), the physical ceiling for a data-movement op,

plus any extra named variants a suite passes.

Cold cache (the headline for bandwidth-bound cases).  A suite that passes
``buffer_sets=make_sets`` (``make_sets(n)`` returns ``n`` dicts of the same
implementations, each on its own buffers) is timed over a rotation of buffer
sets holding at least 4x the device's L2 (benchmarks/timing.py), so that every
call reads and writes HBM; the copy gets the same rotation.  The same case is
also timed on set 0 alone (``results_warm``, labelled warm) unless
``BENCH_WARM=0``.  Cases too small to rotate, and suites that pass plain
``impls``, are timed warm.  Every case records ``mode`` (cold / warm),
``buffer_sets``, ``buffer_set_bytes`` (their total) and ``l2_bytes``.

Timing: launch-bound and mid-sized cases (``graph=True``) are CUDA-graph
replays (the rotation captured in the graph; per-call time = replay time /
calls); large ones (``graph=False``) are device events around each call of the
rotation, host-enqueued back to back.  Neither uses ``do_bench``'s L2 flush:
its flush kernel runs between calls, so a wrapper's host time shows up as
device idle time.  (``time_us`` keeps ``do_bench`` for other callers.)
pytest-benchmark's own host timer runs ``ours`` a few times so its table is
not empty, but the numbers that matter are in ``extra_info``:

  results[impl] = {"us": median µs, "gbps": nbytes / time}   (headline mode)
  results_warm[impl]                                         (cold cases)
  speedup       = baseline µs / ours µs     (speedup_warm from results_warm)
  frac_copy     = copy µs / ours µs   (fraction of same-bytes copy bandwidth)

``nbytes`` is what the operation must read plus write, each byte counted once.
``scripts/bench_report.py`` turns the JSON files into the README table.
"""

from __future__ import annotations

import functools
import math
import os
import platform
import sys
from collections.abc import Callable, Sequence

import pytest

torch = pytest.importorskip("torch")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # benchmarks import shared helpers as ``benchmarks.x``
    sys.path.insert(0, _REPO)

from benchmarks import graphs, provenance, timing  # noqa: E402

# A CUDA graph holds this many back-to-back calls (rounded up to whole rounds
# over the buffer sets); replay time / calls is the per-call time with launch
# gaps removed (what a decode step sees in vLLM).
GRAPH_CALLS_PER_REPLAY = timing.GRAPH_CALLS_PER_REPLAY
GRAPH_REPLAYS = 50
DO_BENCH_WARMUP_MS = 25
DO_BENCH_REP_MS = 100
# Event-timed (graph=False) cases: calls timed per implementation, at least one
# round over the sets, about this long in all, at most EVENT_MAX_CALLS calls.
EVENT_REP_MS = 100
EVENT_MAX_CALLS = 200


def series_state() -> dict:
    """Commit and state of what was benchmarked (benchmarks/provenance.py).

    SERIES_COMMIT / SERIES_DIRTY, when set (scripts/run_bench.py passes them
    on), win over git: the GPU machine gets a copy of the working tree whose
    .git, if any, can be an older snapshot than the files beside it.
    """
    return provenance.series_state()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm GPU")


def pytest_benchmark_update_machine_info(config, machine_info):
    import triton

    info = {
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "cuda": torch.version.cuda,
        "hip": torch.version.hip,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["device"] = props.name
        info["sm_count"] = props.multi_processor_count
        info["l2_bytes"], info["l2_bytes_from"] = timing.device_cache_bytes(props)
    else:  # host-side suites: name the processor they ran on
        model = next((line.split(":", 1)[1].strip() for line in
                      open("/proc/cpuinfo", encoding="utf-8") if line.startswith("model name")),
                     platform.processor() or "unknown") if os.path.exists("/proc/cpuinfo") \
            else (platform.processor() or "unknown")
        info["device"] = f"CPU {model} ({os.cpu_count()} cores)"
    machine_info["series"] = {**series_state(), **info}


def _as_list(fns) -> list[Callable[[], object]]:
    return list(fns) if isinstance(fns, Sequence) else [fns]


def time_graph_us(fn: Callable[[], object] | Sequence[Callable[[], object]]) -> float:
    """Median per-call µs of ``fn`` replayed inside a CUDA graph.

    ``fn`` may be a list of callables, one per buffer set: the graph then
    holds whole rounds over them (set 0, 1, ..., n-1, 0, ...).
    """
    fns = _as_list(fn)
    calls = timing.rotation(fns, timing.calls_per_replay(len(fns), GRAPH_CALLS_PER_REPLAY))
    # Warm-up outside capture (autotune, allocator): three rounds over the sets.
    graph = graphs.capture(lambda: [f() for f in calls], warmups=3,
                           warmup=lambda: [f() for f in fns])
    us = graphs.replay_us(graph, GRAPH_REPLAYS, calls=len(calls), warm_replays=3)
    del graph
    return us


def time_events_us(fn: Callable[[], object] | Sequence[Callable[[], object]]) -> float:
    """Median µs of single calls, device events around each, over the buffer sets in turn.

    For calls long enough that the host runs ahead (no flush between calls,
    so the host time of a wrapper stays hidden as it is in a real step).
    """
    fns = _as_list(fn)
    for f in fns:  # warm-up: compile, autotune, allocator
        f()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for f in fns:
        f()
    end.record()
    end.synchronize()
    estimate_ms = max(start.elapsed_time(end) / len(fns), 1e-3)
    wanted = min(EVENT_MAX_CALLS, math.ceil(EVENT_REP_MS / estimate_ms))
    calls = timing.rotation(fns, timing.rounds(len(fns), wanted))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in calls]
    for f, (a, b) in zip(calls, events):
        a.record()
        f()
        b.record()
    torch.cuda.synchronize()
    return graphs.median([a.elapsed_time(b) * 1e3 for a, b in events])


def time_rotation_us(fns: Sequence[Callable[[], object]], graph: bool) -> float:
    """Median per-call µs of the buffer sets' callables called in turn (cold when they
    hold enough bytes: benchmarks/timing.py)."""
    return time_graph_us(fns) if graph else time_events_us(fns)


def time_us(fn: Callable[[], object], graph: bool) -> float:
    if graph:
        return time_graph_us(fn)
    import triton.testing

    return triton.testing.do_bench(fn, warmup=DO_BENCH_WARMUP_MS, rep=DO_BENCH_REP_MS,
                                   return_mode="median") * 1e3


def same_bytes_copy(nbytes: int) -> Callable[[], object]:
    """A device copy that reads nbytes/2 and writes nbytes/2 (nbytes moved)."""
    n = max(nbytes // 2, 16)
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)


def same_bytes_copies(nbytes: int, sets: int) -> list[Callable[[], object]]:
    """One same-bytes copy per buffer set, each on its own source and destination."""
    return [same_bytes_copy(nbytes) for _ in range(sets)]


def device_cache_bytes() -> int:
    """The L2 bytes a cold rotation must defeat (BENCH_L2_BYTES overrides)."""
    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    return timing.device_cache_bytes(props)[0]


def run_case(benchmark, module, *, kernel: str, case: str, shapes: dict, nbytes: int,
             impls: dict[str, Callable[[], object] | None] | None = None, graph: bool = False,
             notes: str = "", copy_ceiling: bool = True,
             buffer_sets: Callable[[int], list[dict]] | None = None) -> dict:
    """One case (what ``kernel_bench`` runs): plan the rotation, build the sets, time, record.

    ``impls``: one set of implementations, timed warm.  ``buffer_sets(n)``: ``n``
    dicts of the same implementations on their own buffers, timed cold over
    a rotation when the case can rotate (benchmarks/timing.py).
    """
    if (impls is None) == (buffer_sets is None):
        raise ValueError("kernel_bench takes impls (one set, timed warm) or buffer_sets")
    cache_bytes = device_cache_bytes()
    if buffer_sets is not None:
        plan = timing.plan_rotation(nbytes, cache_bytes)
        allocated = torch.cuda.memory_allocated()
        sets = [dict(s) for s in buffer_sets(plan.sets)]
    else:
        plan = timing.Rotation(timing.WARM, 1, nbytes, cache_bytes,
                               "the suite passes one buffer set")
        allocated = torch.cuda.memory_allocated()
        sets = [dict(impls)]
    if copy_ceiling:  # else: not a data-movement op, a copy bounds nothing
        for impl_set, copy in zip(sets, same_bytes_copies(nbytes, len(sets)), strict=True):
            impl_set["copy"] = copy
    alloc_bytes = torch.cuda.memory_allocated() - allocated
    measured = timing.measure(sets, nbytes=nbytes, plan=plan, graph=graph,
                              timer=time_rotation_us,
                              warm_too=os.environ.get("BENCH_WARM", "1") != "0",
                              sync=torch.cuda.synchronize, notes=notes)
    extra = {
        "kernel": kernel,
        "case": case,
        "shapes": shapes,
        "nbytes": nbytes,
        "graph": graph,
        **measured,
        "alloc_bytes": alloc_bytes,
    }
    if not copy_ceiling:
        extra["frac_copy"] = None
        extra["copy_ceiling"] = False
    if notes:
        extra["notes"] = notes
    baseline_desc = getattr(module, "BASELINE", None)
    if baseline_desc:  # what "baseline" means for this suite, for the report
        extra["baseline_desc"] = baseline_desc
    benchmark.extra_info.update(extra)
    benchmark.group = kernel
    ours = sets[0]["ours"]

    def ours_synced():
        ours()
        torch.cuda.synchronize()

    benchmark.pedantic(ours_synced, rounds=5, iterations=1, warmup_rounds=1)
    line = "  ".join(f"{k}={v.get('us', 'n/a')}us" for k, v in extra["results"].items())
    warm = (f" (warm: speedup={extra.get('speedup_warm')} frac_copy={extra.get('frac_copy_warm')})"
            if "results_warm" in extra else "")
    print(f"\n[bench] {kernel}/{case} [{plan.mode}, {plan.sets} set(s), "
          f"{plan.total_bytes / 2**20:.0f} MiB]: {line} speedup={extra['speedup']} "
          f"frac_copy={extra['frac_copy']}{warm}", flush=True)
    return extra


@pytest.fixture
def kernel_bench(benchmark, request):
    """Measure ours / baseline / copy for one case: ``run_case`` (see the module docstring)."""
    if not torch.cuda.is_available():
        pytest.skip("kernel benchmarks need a GPU")
    return functools.partial(run_case, benchmark, request.module)

"""Kernel benchmark harness (pytest-benchmark).

Every case measures, in the same process and on the same buffers:

  * ``ours``      -- the series' kernel,
  * ``baseline``  -- what upstream vLLM runs today for the same job,
  * ``copy``      -- a device-to-device ``copy_`` of the same number of bytes
                     (added here), the physical ceiling for a data-movement op,

plus any extra named variants a suite passes.  Timing is the median of
``triton.testing.do_bench`` (device events), or, for launch-bound
decode-sized cases (``graph=True``), the median per-call time of CUDA-graph
replays.  pytest-benchmark's own host timer runs ``ours`` a few times so its
table is not empty, but the numbers that matter are in ``extra_info``:

  results[impl] = {"us": median µs, "gbps": nbytes / time}
  speedup       = baseline µs / ours µs
  frac_copy     = copy µs / ours µs   (fraction of same-bytes copy bandwidth)

``nbytes`` is what the operation must read plus write, each byte counted once.
``scripts/bench_report.py`` turns the JSON files into the README table.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # benchmarks import shared helpers as ``benchmarks.x``
    sys.path.insert(0, _REPO)

# A CUDA graph holds this many back-to-back calls; replay time / calls is the
# per-call time with launch gaps removed (what a decode step sees in vLLM).
GRAPH_CALLS_PER_REPLAY = 20
GRAPH_REPLAYS = 50
DO_BENCH_WARMUP_MS = 25
DO_BENCH_REP_MS = 100


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", "-C", _REPO, *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def series_state() -> dict:
    """Commit and state of what was benchmarked.

    SERIES_COMMIT / SERIES_DIRTY, when set (scripts/run_bench.py passes them
    on), win over git: the GPU machine gets a copy of the working tree whose
    .git, if any, can be an older snapshot than the files beside it.
    """
    commit = os.environ.get("SERIES_COMMIT") or _git("rev-parse", "HEAD") or "unknown"
    if os.environ.get("SERIES_COMMIT"):
        dirty = os.environ.get("SERIES_DIRTY", "unknown")
        return {"commit": commit, "dirty": {"0": False, "1": True}.get(dirty, dirty)}
    dirty = _git("status", "--porcelain", "--", "patches", "vllm_overlay", "benchmarks")
    return {"commit": commit, "dirty": bool(dirty) if dirty is not None else "unknown"}


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
    else:  # host-side suites: name the processor they ran on
        model = next((line.split(":", 1)[1].strip() for line in
                      open("/proc/cpuinfo", encoding="utf-8") if line.startswith("model name")),
                     platform.processor() or "unknown") if os.path.exists("/proc/cpuinfo") \
            else (platform.processor() or "unknown")
        info["device"] = f"CPU {model} ({os.cpu_count()} cores)"
    machine_info["series"] = {**series_state(), **info}


def _median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def time_graph_us(fn: Callable[[], object]) -> float:
    """Median per-call µs of ``fn`` replayed inside a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture (autotune, allocator)
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS_PER_REPLAY):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(GRAPH_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / GRAPH_CALLS_PER_REPLAY)
    del graph
    return _median(times)


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


@pytest.fixture
def kernel_bench(benchmark, request):
    """Measure ours / baseline / copy for one case; see the module docstring."""
    if not torch.cuda.is_available():
        pytest.skip("kernel benchmarks need a GPU")

    def run(*, kernel: str, case: str, shapes: dict, nbytes: int,
            impls: dict[str, Callable[[], object] | None], graph: bool = False,
            notes: str = "", copy_ceiling: bool = True) -> dict:
        if "ours" not in impls or impls["ours"] is None:
            raise ValueError("kernel_bench needs an 'ours' implementation")
        candidates = dict(impls)
        if copy_ceiling:  # else: not a data-movement op, a copy bounds nothing
            candidates["copy"] = same_bytes_copy(nbytes)
        results: dict[str, dict] = {}
        for name, fn in candidates.items():
            if fn is None:
                results[name] = {"unavailable": notes or "not available on this machine"}
                continue
            try:
                fn()
                torch.cuda.synchronize()
                us = time_us(fn, graph)
            except Exception as exc:  # a broken baseline must not lose the case
                if name == "ours":
                    raise
                results[name] = {"unavailable": f"{type(exc).__name__}: {exc}"[:500]}
                continue
            results[name] = {"us": round(us, 3), "gbps": round(nbytes / (us * 1e-6) / 1e9, 1)}
        ours_us = results["ours"]["us"]
        base = results.get("baseline", {})
        extra = {
            "kernel": kernel,
            "case": case,
            "shapes": shapes,
            "nbytes": nbytes,
            "graph": graph,
            "results": results,
            "speedup": round(base["us"] / ours_us, 3) if "us" in base else None,
            "frac_copy": round(results["copy"]["us"] / ours_us, 3) if copy_ceiling else None,
        }
        if not copy_ceiling:
            extra["copy_ceiling"] = False
        if notes:
            extra["notes"] = notes
        baseline_desc = getattr(request.module, "BASELINE", None)
        if baseline_desc:  # what "baseline" means for this suite, for the report
            extra["baseline_desc"] = baseline_desc
        benchmark.extra_info.update(extra)
        benchmark.group = kernel
        ours = candidates["ours"]

        def ours_synced():
            ours()
            torch.cuda.synchronize()

        benchmark.pedantic(ours_synced, rounds=5, iterations=1, warmup_rounds=1)
        line = "  ".join(f"{k}={v.get('us', 'n/a')}us" for k, v in results.items())
        print(f"\n[bench] {kernel}/{case}: {line} speedup={extra['speedup']} "
              f"frac_copy={extra['frac_copy']}", flush=True)
        return extra

    return run

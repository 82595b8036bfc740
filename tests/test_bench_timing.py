"""Cold-cache rotation of the kernel benchmarks (benchmarks/timing.py), on CPU.

The GPU is not here: what is tested is that the sizing and the call order give
every call a reuse distance of at least 4x the cache (checked with a simulated
LRU cache over the real call sequence), that the harness times cold, warm and
the copy as it says and records it, and that the suites' buffer sets share no
bytes.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import OrderedDict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _load_timing():
    spec = importlib.util.spec_from_file_location("_series_bench_timing", REPO / "benchmarks" / "timing.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


timing = _load_timing()

MiB = 1 << 20
H200_L2 = 60 * MiB


# --- sizing ----------------------------------------------------------------------

@pytest.mark.parametrize("set_bytes,sets", [
    (16 * MiB, 15),          # fetch_kv H_kv 1 at 32K: inside the L2 alone
    (60 * MiB, 4),
    (100 * MiB, 3),
    (240 * MiB, 1),          # one call already streams 4x the L2
    (2 * MiB, 120),
])
def test_rotation_holds_four_times_the_cache(set_bytes, sets):
    plan = timing.plan_rotation(set_bytes, H200_L2)
    assert plan.mode == timing.COLD and plan.sets == sets
    assert plan.total_bytes >= 4 * H200_L2
    # ... and no more sets than needed: one fewer would not reach 4x.
    assert sets == 1 or (sets - 1) * set_bytes < 4 * H200_L2
    assert plan.record() == {"mode": "cold", "buffer_sets": sets,
                             "buffer_set_bytes": sets * set_bytes, "l2_bytes": H200_L2}


def test_calls_too_small_to_rotate_are_timed_warm_and_say_why():
    plan = timing.plan_rotation(300_000, H200_L2)  # a decode step of a few hundred KB
    assert (plan.mode, plan.sets) == (timing.WARM, 1)
    assert "839 buffer sets, more than 128" in plan.reason
    assert plan.record()["warm_reason"] == plan.reason


# --- the call order, through simulated caches ---------------------------------------

LINE = 128  # bytes a cache line holds (the H200's L2 line)


def _trace(set_bytes: int, sets: int, calls: int) -> list[tuple[int, int]]:
    """(set, line) of every line the rotation's calls touch, in order."""
    lines = set_bytes // LINE
    fns = [lambda s=s: s for s in range(sets)]
    order = [fn() for fn in timing.rotation(fns, calls)]
    return [(s, line) for s in order for line in range(lines)]


def _lru_hits(trace, capacity_lines: int, skip: int) -> float:
    cache: OrderedDict = OrderedDict()
    hits = counted = 0
    for i, key in enumerate(trace):
        hit = key in cache
        if hit:
            cache.move_to_end(key)
        else:
            cache[key] = None
            if len(cache) > capacity_lines:
                cache.popitem(last=False)
        if i >= skip:
            counted += 1
            hits += hit
    return hits / counted


@pytest.mark.parametrize("set_kib", [64, 200, 512, 1200])
def test_every_call_of_the_rotation_misses_a_cache_a_quarter_its_size(set_kib):
    """Scaled down (a 1 MiB cache, 128-byte lines): the plan's rotation has no LRU hit
    after the first round."""
    cache = 1 * MiB
    set_bytes = set_kib * 1024
    plan = timing.plan_rotation(set_bytes, cache)
    assert plan.mode == timing.COLD
    calls = timing.calls_per_replay(plan.sets)
    trace = _trace(set_bytes, plan.sets, 3 * calls)
    first_round = plan.sets * (set_bytes // LINE)
    assert _lru_hits(trace, cache // LINE, skip=first_round) == 0.0


def test_one_set_inside_the_cache_would_be_timed_from_the_cache():
    """What the rotation prevents: the same small buffers call after call all hit."""
    cache, set_bytes = 1 * MiB, 200 * 1024
    trace = _trace(set_bytes, 1, 20)
    assert _lru_hits(trace, cache // LINE, skip=set_bytes // LINE) == 1.0


@pytest.mark.parametrize("sets,calls", [(1, 20), (3, 21), (7, 21), (15, 30), (20, 20), (60, 60), (128, 128)])
def test_a_graph_holds_whole_rounds(sets, calls):
    assert timing.calls_per_replay(sets) == calls
    order = timing.rotation(list(range(sets)), calls)
    assert order == [i % sets for i in range(calls)]
    assert timing.rounds(sets, 7) % sets == 0 and timing.rounds(sets, 7) >= max(sets, 7)


# --- the harness's measurement, with a fake timer -------------------------------------

def _impl_sets(sets: int, calls: list, names=("ours", "baseline", "copy")) -> list[dict]:
    return [{name: (lambda n=name, s=s: calls.append((n, s))) for name in names} for s in range(sets)]


def _fake_timer(us_of):
    """timer(fns, graph): runs the rotation once and returns us_of(number of sets)."""
    seen = []

    def timer(fns, graph):
        for fn in timing.rotation(fns, timing.calls_per_replay(len(fns))):
            fn()
        seen.append((len(fns), graph))
        return us_of(len(fns))

    return timer, seen


def test_measure_times_cold_over_every_set_and_warm_on_set_zero():
    calls: list = []
    plan = timing.plan_rotation(16 * MiB, H200_L2)
    sets = _impl_sets(plan.sets, calls)
    timer, seen = _fake_timer(lambda n: 10.0 if n > 1 else 8.0)
    out = timing.measure(sets, nbytes=16 * MiB, plan=plan, graph=True, timer=timer, warm_too=True)
    assert out["mode"] == "cold" and out["buffer_sets"] == 15 and out["timing"] == "graph"
    assert out["buffer_set_bytes"] == 15 * 16 * MiB and out["l2_bytes"] == H200_L2
    assert seen == [(15, True), (1, True)] * 3  # ours, baseline, copy: cold then warm
    for name in ("ours", "baseline", "copy"):  # each impl called on every set, in turn
        cold = [s for n, s in calls if n == name][1:31]  # after the sanity call on set 0
        assert cold == [i % 15 for i in range(30)]
    assert out["results"]["ours"]["us"] == 10.0 and out["results_warm"]["ours"]["us"] == 8.0
    assert out["results"]["ours"]["gbps"] == round(16 * MiB / 10e-6 / 1e9, 1)
    assert out["speedup"] == 1.0 and out["frac_copy"] == 1.0 and out["speedup_warm"] == 1.0


def test_measure_records_a_broken_baseline_but_not_a_broken_ours():
    plan = timing.plan_rotation(100 * MiB, H200_L2)  # 3 sets
    sets = _impl_sets(plan.sets, [], names=("ours", "copy"))
    for s in sets:
        s["baseline"] = lambda: 1 / 0
    timer, _ = _fake_timer(lambda n: 5.0)
    out = timing.measure(sets, nbytes=100 * MiB, plan=plan, graph=True, timer=timer, warm_too=True)
    assert out["results"]["baseline"]["unavailable"].startswith("ZeroDivisionError")
    assert out["speedup"] is None
    sets[1]["ours"] = lambda: 1 / 0
    with pytest.raises(ZeroDivisionError):
        timing.measure(sets, nbytes=100 * MiB, plan=plan, graph=True, timer=timer, warm_too=True)
    with pytest.raises(ValueError, match="built 2 buffer sets, the plan has 3"):
        timing.measure(sets[:2], nbytes=100 * MiB, plan=plan, graph=True, timer=timer, warm_too=True)


# --- the suites' buffer sets share no bytes (CPU, small shapes) ------------------------

torch = pytest.importorskip("torch")


def test_paged_context_sets_take_disjoint_blocks(bench_pkg):
    pytest.importorskip("triton")
    paged = bench_pkg("bench_paged_context")
    reqs, context, new = 2, 256, 32
    blocks = [set(paged.step_inputs(4096, reqs, context, new, "cpu", i)["block_table"].flatten().tolist())
              for i in range(5)]
    assert all(len(b) == reqs * (context + new) // paged.BLOCK_SIZE for b in blocks)
    assert len(set().union(*blocks)) == sum(map(len, blocks)) and 0 not in set().union(*blocks)
    with pytest.raises(ValueError, match="needs 1153 cache blocks, the cache has 1000"):
        paged.step_inputs(1000, reqs, context, new, "cpu", 31)
    # The suite's cache holds the rotation of every case at the H200's L2.
    need = paged.rotation_blocks(paged.CASES, H200_L2)
    assert need <= paged.MAX_CONTEXT_TOKENS // paged.BLOCK_SIZE + 64
    assert paged.step_bytes(1, 8192, 128) == 8192 * 4 * 2 * 128 * 2 + 2 * 128 * 32 * 128 * 2

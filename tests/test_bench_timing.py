"""Cold-cache rotation of the kernel benchmarks (benchmarks/timing.py), on CPU.

The GPU is not here: what is tested is that the sizing and the call order give
every call a reuse distance of at least 4x the cache (checked with a simulated
LRU and a random-replacement cache over the real call sequence), that the
harness times cold, warm and the copy as it says and records it, and that the
suites' buffer sets share no bytes.
"""

from __future__ import annotations

import importlib
import importlib.util
import random
import sys
import types
from collections import OrderedDict
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def bench_pkg(monkeypatch):
    """The series' benchmarks/ as the package ``benchmarks`` (the patched vLLM tree on
    PYTHONPATH has its own ``benchmarks`` package); sys.modules restored afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "benchmarks" or k.startswith("benchmarks.")}
    monkeypatch.setattr(sys, "path", list(sys.path))  # benchmarks/conftest.py prepends the repo
    for key in saved:
        del sys.modules[key]
    pkg = types.ModuleType("benchmarks")
    pkg.__path__ = [str(REPO / "benchmarks")]
    sys.modules["benchmarks"] = pkg
    try:
        yield lambda name: importlib.import_module(f"benchmarks.{name}")
    finally:
        for key in [k for k in sys.modules if k == "benchmarks" or k.startswith("benchmarks.")]:
            del sys.modules[key]
        sys.modules.update(saved)


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
    (61 * MiB, 4),
    (100 * MiB, 3),
    (240 * MiB, 1),          # one call already streams 4x the L2
    (512 * MiB, 1),
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


def test_rotation_total_is_capped():
    plan = timing.plan_rotation(3 << 30, 1 << 30, max_bytes=8 << 30)  # 2 sets of 3 GiB: 6 GiB ok
    assert (plan.mode, plan.sets) == (timing.COLD, 2)
    plan = timing.plan_rotation(3 << 30, 2 << 30, max_bytes=8 << 30)  # 3 sets: 9 GiB > cap
    assert plan.mode == timing.WARM and "exceed the 8589934592-byte cap" in plan.reason


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        timing.plan_rotation(0, H200_L2)
    with pytest.raises(ValueError):
        timing.plan_rotation(MiB, 0)


def test_cache_size_comes_from_the_device_then_the_override(monkeypatch):
    monkeypatch.delenv("BENCH_L2_BYTES", raising=False)
    assert timing.device_cache_bytes(SimpleNamespace(L2_cache_size=H200_L2)) == (H200_L2, "L2_cache_size")
    assert timing.device_cache_bytes(SimpleNamespace()) == (timing.FALLBACK_CACHE_BYTES, "fallback")
    assert timing.device_cache_bytes(SimpleNamespace(L2_cache_size=0))[1] == "fallback"
    assert timing.device_cache_bytes(None)[1] == "fallback"
    monkeypatch.setenv("BENCH_L2_BYTES", str(256 * MiB))
    assert timing.device_cache_bytes(SimpleNamespace(L2_cache_size=H200_L2)) == (256 * MiB, "BENCH_L2_BYTES")
    monkeypatch.setenv("BENCH_L2_BYTES", "-1")
    with pytest.raises(ValueError):
        timing.device_cache_bytes(None)


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


def _random_hits(trace, capacity_lines: int, skip: int, seed: int = 0) -> float:
    rng = random.Random(seed)
    slots: list = []
    where: dict = {}
    hits = counted = 0
    for i, key in enumerate(trace):
        hit = key in where
        if not hit:
            if len(slots) < capacity_lines:
                where[key] = len(slots)
                slots.append(key)
            else:
                victim = rng.randrange(capacity_lines)
                del where[slots[victim]]
                slots[victim] = key
                where[key] = victim
        if i >= skip:
            counted += 1
            hits += hit
    return hits / counted


@pytest.mark.parametrize("set_kib", [64, 200, 512, 1200])
def test_every_call_of_the_rotation_misses_a_cache_a_quarter_its_size(set_kib):
    """Scaled down (a 1 MiB cache, 128-byte lines): the plan's rotation has no LRU hit
    after the first round, and under random replacement keeps only a few percent."""
    cache = 1 * MiB
    set_bytes = set_kib * 1024
    plan = timing.plan_rotation(set_bytes, cache)
    assert plan.mode == timing.COLD
    calls = timing.calls_per_replay(plan.sets)
    trace = _trace(set_bytes, plan.sets, 3 * calls)
    first_round = plan.sets * (set_bytes // LINE)
    assert _lru_hits(trace, cache // LINE, skip=first_round) == 0.0
    assert _random_hits(trace, cache // LINE, skip=first_round) < 0.05


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


def test_measure_warm_plan_and_no_warm_beside():
    calls: list = []
    plan = timing.plan_rotation(300_000, H200_L2)
    timer, seen = _fake_timer(lambda n: 2.0)
    out = timing.measure(_impl_sets(1, calls), nbytes=300_000, plan=plan, graph=True, timer=timer,
                         warm_too=True)
    assert out["mode"] == "warm" and out["buffer_sets"] == 1 and "warm_reason" in out
    assert "results_warm" not in out and seen == [(1, True)] * 3
    cold = timing.plan_rotation(16 * MiB, H200_L2)
    out = timing.measure(_impl_sets(cold.sets, []), nbytes=16 * MiB, plan=cold, graph=False,
                         timer=_fake_timer(lambda n: 3.0)[0], warm_too=False)
    assert out["mode"] == "cold" and out["timing"] == "events" and "results_warm" not in out


def test_measure_records_unavailable_and_broken_baselines_but_not_a_broken_ours():
    plan = timing.plan_rotation(100 * MiB, H200_L2)  # 3 sets
    sets = _impl_sets(plan.sets, [], names=("ours", "copy"))
    for s in sets:
        s["baseline"] = None
        s["other"] = lambda: 1 / 0
    timer, _ = _fake_timer(lambda n: 5.0)
    out = timing.measure(sets, nbytes=100 * MiB, plan=plan, graph=True, timer=timer, warm_too=True,
                         notes="baseline skipped: no pinned tree")
    assert out["results"]["baseline"] == {"unavailable": "baseline skipped: no pinned tree"}
    assert out["results"]["other"]["unavailable"].startswith("ZeroDivisionError")
    assert "other" not in out["results_warm"] and out["speedup"] is None
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


def test_mla_sets_write_disjoint_slots_and_read_their_own_rope_rows(bench_pkg):
    mla = bench_pkg("bench_mla_rope_cache")
    for decode in (True, False):
        sets = mla.make_input_sets(128, 2, "auto", decode, sets=4, device="cpu",
                                   cos_sin=torch.zeros(1))
        slots = [set(x["slots"].tolist()) for x in sets]
        assert len(set().union(*slots)) == 4 * 128  # no slot written by two sets
        assert all(x["kv_cache"] is sets[0]["kv_cache"] for x in sets)
        assert len({x["q"].data_ptr() for x in sets} | {x["q_out"].data_ptr() for x in sets}) == 8
        if not decode:
            rows = [set(x["positions"].tolist()) for x in sets]
            assert len(set().union(*rows)) == 4 * 128


def test_fetch_kv_sets_gather_their_own_blocks_into_their_own_outputs(monkeypatch, bench_pkg):
    pytest.importorskip("triton")  # tests/conftest.py runs Triton under TRITON_INTERPRET=1 here
    fkv = bench_pkg("bench_fetch_kv")
    monkeypatch.setattr(fkv, "_DEVICE", "cpu")
    monkeypatch.setattr(fkv, "SPARE_BLOCKS", 16)
    monkeypatch.setattr(fkv, "_UPSTREAM", None)
    layout, dtype, h, d, bs, tokens = "NHD", torch.float16, 1, 64, 16, 512
    shapes: dict = {}
    buffers: list = []
    sets = fkv._setup_sets(layout, dtype, dtype, h, d, bs, tokens, sets=3, shapes=shapes,
                           buffers=buffers)
    assert len(sets) == 3 == len(buffers) and sets[0]["baseline"] is None
    assert shapes["num_blocks"] == 1 + 3 * sum(-(-(s + n) // bs) for s, n in
                                               zip(fkv.REQ_STARTS, shapes["req_lens"])) + 16
    used = [set(b["table"].flatten().tolist()) - {0} for b in buffers]
    assert len(set().union(*used)) == sum(map(len, used))  # no block in two sets
    assert len({b["key_out"].data_ptr() for b in buffers}) == 3
    # Each set's call writes its own outputs from its own blocks (closures bound per set).
    starts, lens = fkv.REQ_STARTS, shapes["req_lens"]
    pos = torch.cat([torch.arange(st, st + n) for st, n in zip(starts, lens)])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    for impls, b in zip(sets, buffers):
        for name in ("ours", "ours_noplan"):
            b["key_out"].zero_()
            b["value_out"].zero_()
            impls[name]()
            blocks = b["table"][req, pos // bs].long()
            for out, cache in ((b["key_out"], b["key_cache"]), (b["value_out"], b["value_cache"])):
                # bit-exact (random bytes: some fp16 values are NaN)
                assert torch.equal(out.view(torch.int16), cache[blocks, pos % bs].view(torch.int16))


def test_run_case_builds_the_planned_sets_adds_a_copy_to_each_and_records_the_mode(
        monkeypatch, bench_pkg):
    """benchmarks/conftest.run_case (the kernel_bench fixture) with the device faked."""
    harness = bench_pkg("conftest")
    allocated = iter([1000, 1000 + 5 * MiB])
    monkeypatch.setattr(harness.torch.cuda, "memory_allocated", lambda: next(allocated))
    monkeypatch.setattr(harness.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(harness, "device_cache_bytes", lambda: 1 * MiB)
    copies: list = []
    monkeypatch.setattr(harness, "same_bytes_copies",
                        lambda nbytes, n: [lambda i=i: copies.append((nbytes, i)) for i in range(n)])
    timed: list = []

    def timer(fns, graph):
        for fn in timing.rotation(fns, timing.calls_per_replay(len(fns))):
            fn()
        timed.append(len(fns))
        return 4.0 if len(fns) > 1 else 2.0

    monkeypatch.setattr(harness, "time_rotation_us", timer)
    asked: list = []

    def buffer_sets(n):
        asked.append(n)
        return [{"ours": lambda: None, "baseline": lambda: None} for _ in range(n)]

    bench = SimpleNamespace(extra_info={}, group=None,
                            pedantic=lambda fn, **kw: [fn() for _ in range(kw["rounds"])])
    module = SimpleNamespace(BASELINE="upstream's kernel")
    extra = harness.run_case(bench, module, kernel="k", case="c", shapes={"T": 1},
                             nbytes=100 * 1024, buffer_sets=buffer_sets, graph=True)
    assert asked == [41]  # ceil(4 MiB / 100 KiB)
    assert sorted({i for _, i in copies}) == list(range(41)) and {b for b, _ in copies} == {100 * 1024}
    assert timed == [41, 1] * 3
    assert extra["mode"] == "cold" and extra["buffer_sets"] == 41
    assert extra["buffer_set_bytes"] == 41 * 100 * 1024 and extra["l2_bytes"] == MiB
    assert extra["alloc_bytes"] == 5 * MiB and extra["baseline_desc"] == "upstream's kernel"
    assert extra["results"]["copy"]["us"] == 4.0 and extra["results_warm"]["copy"]["us"] == 2.0
    assert bench.extra_info == extra and bench.group == "k"

    # One set passed as impls: warm, and no copy when the copy bounds nothing.
    allocated = iter([0, 0])
    extra = harness.run_case(bench, module, kernel="k", case="plan", shapes={}, nbytes=64,
                             impls={"ours": lambda: None, "baseline": None}, graph=True,
                             copy_ceiling=False)
    assert extra["mode"] == "warm" and extra["buffer_sets"] == 1 and "copy" not in extra["results"]
    assert extra["frac_copy"] is None and extra["copy_ceiling"] is False
    with pytest.raises(ValueError, match="impls .* or buffer_sets"):
        harness.run_case(bench, module, kernel="k", case="c", shapes={}, nbytes=1, graph=True)


# --- CUDA-graph capture and replay timing (benchmarks/graphs.py), with a fake torch.cuda ---


class _FakeCuda:
    """What graphs.py uses of torch.cuda, recording the order of events."""

    def __init__(self, replay_ms):
        self.log, self.replay_ms, self.capturing = [], list(replay_ms), False
        cuda = self

        class Stream:
            def wait_stream(self, other):
                cuda.log.append("wait")

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = len(cuda.log)
                cuda.log.append("event")

            def synchronize(self):
                pass

            def elapsed_time(self, end):
                return cuda.replay_ms.pop(0)

        class CUDAGraph:
            def replay(self):
                cuda.log.append("replay")

        class _Graph:
            def __init__(self, graph):
                pass

            def __enter__(self):
                cuda.capturing = True
                cuda.log.append("capture")

            def __exit__(self, *exc):
                cuda.capturing = False
                cuda.log.append("end capture")

        class _StreamCtx:
            def __init__(self, stream):
                pass

            def __enter__(self):
                cuda.log.append("side stream")

            def __exit__(self, *exc):
                pass

        self.Stream, self.Event, self.CUDAGraph = Stream, Event, CUDAGraph
        self.graph, self.stream = _Graph, _StreamCtx
        self.current_stream = lambda: Stream()
        self.synchronize = lambda: self.log.append("sync")


def test_graphs_capture_warms_up_on_a_side_stream_then_captures_once(bench_pkg, monkeypatch):
    graphs = bench_pkg("graphs")
    cuda = _FakeCuda([])
    monkeypatch.setattr(graphs.torch, "cuda", cuda)
    runs = []
    graphs.capture(lambda: runs.append("fn capturing" if cuda.capturing else "fn"), warmups=3,
                   warmup=lambda: runs.append("warmup"))
    assert runs == ["warmup"] * 3 + ["fn capturing"]
    assert cuda.log.index("side stream") < cuda.log.index("capture")


def test_graphs_replay_us_is_the_median_per_call_of_the_timed_replays(bench_pkg, monkeypatch):
    graphs = bench_pkg("graphs")
    cuda = _FakeCuda([1.0, 3.0, 2.0, 100.0, 2.5])  # ms per replay
    monkeypatch.setattr(graphs.torch, "cuda", cuda)
    graph = cuda.CUDAGraph()
    us = graphs.replay_us(graph, replays=5, calls=10, warm_replays=2)
    assert us == pytest.approx(250.0)  # median 2.5 ms / 10 calls, in µs
    assert cuda.log[:3] == ["replay", "replay", "sync"], "warm replays are untimed"
    assert cuda.log.count("replay") == 7 and not cuda.replay_ms
    assert graphs.median([4, 1, 3, 2]) == 2.5

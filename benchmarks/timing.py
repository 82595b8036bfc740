"""Cold-cache timing for the kernel benchmarks: how many buffer sets, and in which order.

A bandwidth-bound kernel timed call after call on the same buffers reads them
from the device's last-level cache once they fit in it (the H200's L2 holds
60 MB): a 16 MB gather then "runs" above HBM bandwidth, and so does its
same-bytes copy.  A real layer does not see that: between two calls of one
layer's kernel, the other layers' weights and caches pass through the cache.

So a case that can rotate gets ``n`` buffer sets (each with its own inputs and
outputs, disjoint memory), and every timed sequence calls them in turn::

    set 0, set 1, ..., set n-1, set 0, set 1, ...

Between two calls on one set, the other ``n - 1`` sets are touched: every byte
a call reads or writes has a reuse distance of ``n * set_bytes`` bytes.  With
``n = ceil(COLD_CACHE_MULTIPLE * cache_bytes / set_bytes)`` that distance is at
least ``COLD_CACHE_MULTIPLE`` (4) times the cache, so an LRU cache has evicted
the set before it comes back, and a cache with any other replacement policy
keeps at most a small share of it.  A call that alone touches 4x the cache
needs no second set (``n = 1``).  The same rotation serves ours, the upstream
baseline and the same-bytes copy of a case.

Cases whose calls are so small that they would need more than
``COLD_MAX_SETS`` sets (decode-sized calls of a few hundred KB: launch- and
latency-bound, and in a real step their inputs were just written by the
previous kernel) are timed warm, and the result says so.  ``COLD_MAX_BYTES``
caps the rotation's total so that the largest cases (32K tokens and more)
still fit next to their own allocations.

This module is plain Python (no torch at import): the sizing and the order
are unit-tested on CPU (tests/test_bench_timing.py); benchmarks/conftest.py
runs them on the GPU.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# The rotation holds at least this many times the device's cache.
COLD_CACHE_MULTIPLE = 4
# A case needing more sets than this is too small to rotate: timed warm.
COLD_MAX_SETS = 128
# The rotation's total (sets x bytes a call touches) never exceeds this.
COLD_MAX_BYTES = 16 << 30
# When the device reports no L2 size (and BENCH_L2_BYTES is not set): assume a
# large cache, so that the rotation errs on the cold side.
FALLBACK_CACHE_BYTES = 256 << 20
# A CUDA graph holds at least this many calls (a multiple of the set count).
GRAPH_CALLS_PER_REPLAY = 20

COLD, WARM = "cold", "warm"


def device_cache_bytes(props: object | None) -> tuple[int, str]:
    """(bytes, where the number came from) of the cache a rotation must defeat.

    ``BENCH_L2_BYTES`` wins (e.g. a device whose memory-side cache is larger
    than the L2 it reports, as AMD's Infinity Cache), then the device's
    ``L2_cache_size`` (torch.cuda.get_device_properties), then
    ``FALLBACK_CACHE_BYTES``.
    """
    env = os.environ.get("BENCH_L2_BYTES", "").strip()
    if env:
        value = int(env)
        if value <= 0:
            raise ValueError(f"BENCH_L2_BYTES must be a positive byte count, got {env!r}")
        return value, "BENCH_L2_BYTES"
    size = getattr(props, "L2_cache_size", 0) if props is not None else 0
    if isinstance(size, int) and size > 0:
        return size, "L2_cache_size"
    return FALLBACK_CACHE_BYTES, "fallback"


@dataclass(frozen=True)
class Rotation:
    """How one case is timed: ``sets`` buffer sets of ``set_bytes`` each, in turn."""

    mode: str          # COLD or WARM
    sets: int
    set_bytes: int     # what one call reads + writes (the case's nbytes)
    cache_bytes: int   # the cache the rotation defeats
    reason: str = ""   # why a case is timed warm

    @property
    def total_bytes(self) -> int:
        return self.sets * self.set_bytes

    def record(self) -> dict:
        """The fields every result case carries (benchmarks/conftest.py)."""
        out = {"mode": self.mode, "buffer_sets": self.sets, "buffer_set_bytes": self.total_bytes,
               "l2_bytes": self.cache_bytes}
        if self.reason:
            out["warm_reason"] = self.reason
        return out


def plan_rotation(set_bytes: int, cache_bytes: int, *, multiple: int = COLD_CACHE_MULTIPLE,
                  max_sets: int = COLD_MAX_SETS, max_bytes: int = COLD_MAX_BYTES) -> Rotation:
    """The rotation for a call touching ``set_bytes`` bytes (see the module docstring)."""
    if set_bytes <= 0 or cache_bytes <= 0:
        raise ValueError(f"set_bytes and cache_bytes must be positive (got {set_bytes}, {cache_bytes})")
    sets = max(1, math.ceil(multiple * cache_bytes / set_bytes))
    if sets > max_sets:
        return Rotation(WARM, 1, set_bytes, cache_bytes,
                        f"a call touches {set_bytes} bytes: {multiple}x the {cache_bytes}-byte cache "
                        f"needs {sets} buffer sets, more than {max_sets}")
    if sets * set_bytes > max_bytes:
        return Rotation(WARM, 1, set_bytes, cache_bytes,
                        f"{sets} buffer sets of {set_bytes} bytes exceed the {max_bytes}-byte cap")
    return Rotation(COLD, sets, set_bytes, cache_bytes)


def calls_per_replay(sets: int, min_calls: int = GRAPH_CALLS_PER_REPLAY) -> int:
    """Calls a graph holds: at least ``min_calls``, a whole number of rounds over the sets."""
    return math.ceil(min_calls / sets) * sets


def rotation(fns: Sequence[Callable[[], object]], calls: int) -> list[Callable[[], object]]:
    """The call sequence: set 0, 1, ..., n-1, 0, 1, ... (``calls`` entries)."""
    if not fns:
        raise ValueError("a rotation needs at least one buffer set")
    return [fns[i % len(fns)] for i in range(calls)]


def rounds(sets: int, calls: int) -> int:
    """Calls needed so that a timed sequence of at least ``calls`` covers whole rounds."""
    return max(sets, math.ceil(calls / sets) * sets)


Timer = Callable[[Sequence[Callable[[], object]], bool], float]


def measure(impl_sets: Sequence[dict[str, Callable[[], object] | None]], *, nbytes: int,
            plan: Rotation, graph: bool, timer: Timer, warm_too: bool,
            sync: Callable[[], None] = lambda: None, notes: str = "") -> dict:
    """Time every implementation of a case over its buffer sets.

    ``impl_sets[i]`` maps implementation names to the callables of buffer set
    ``i`` (``None``: not available); ``timer(fns, graph)`` returns the median
    per-call µs of ``fns`` called in turn.  Returns the result fields:
    ``results`` (the headline: cold when ``plan`` is cold), and with
    ``warm_too`` on a cold plan ``results_warm`` (set 0 alone).  ``ours`` must
    run; another implementation that raises is recorded as unavailable.
    """
    if len(impl_sets) != plan.sets:
        raise ValueError(f"the case built {len(impl_sets)} buffer sets, the plan has {plan.sets}")
    names = list(dict.fromkeys(name for impls in impl_sets for name in impls))
    if "ours" not in names or any(impls.get("ours") is None for impls in impl_sets):
        raise ValueError("every buffer set needs an 'ours' implementation")
    results: dict[str, dict] = {}
    warm: dict[str, dict] = {}

    def entry(us: float) -> dict:
        return {"us": round(us, 3), "gbps": round(nbytes / (us * 1e-6) / 1e9, 1)}

    for name in names:
        fns = [impls.get(name) for impls in impl_sets]
        if any(fn is None for fn in fns):
            results[name] = {"unavailable": notes or "not available on this machine"}
            continue
        try:
            fns[0]()
            sync()
            results[name] = entry(timer(fns, graph))
            if plan.mode == COLD and warm_too:
                warm[name] = entry(timer(fns[:1], graph))
        except Exception as exc:  # a broken baseline must not lose the case
            if name == "ours":
                raise
            results[name] = {"unavailable": f"{type(exc).__name__}: {exc}"[:500]}
            warm.pop(name, None)
    out = {"results": results, **plan.record(), "timing": "graph" if graph else "events"}
    out.update(ratios(results))
    if warm:
        out["results_warm"] = warm
        out.update({f"{k}_warm": v for k, v in ratios(warm).items()})
    return out


def ratios(results: dict[str, dict]) -> dict:
    """speedup = baseline µs / ours µs; frac_copy = copy µs / ours µs (None where absent)."""
    ours = results.get("ours", {}).get("us")

    def over(name: str):
        us = results.get(name, {}).get("us")
        return round(us / ours, 3) if ours and us else None

    return {"speedup": over("baseline"), "frac_copy": over("copy")}

"""Run the compile workers: every target in its own process, ``jobs`` compiles at a time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .targets import TARGETS

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def cache_dir() -> Path:
    """``$SERIES_CACHE/compile`` (default ``~/.cache/vllm-aiter-series/compile``)."""
    sys.path.insert(0, str(SCRIPTS))
    from seriestool.sdist import cache_dir as series_cache

    return series_cache() / "compile"


def run(targets=None, jobs: int = 2, cache: Path | None = None,
        kernels_root: Path | None = None, timeout_s: float = 1800,
        candidates: bool = False) -> dict:
    """Compile (or read from the cache) every spec of ``targets``.

    One worker process per target, all started at once (the imports overlap);
    between them they compile at most ``jobs`` kernels at a time (lock-file
    slots), so ``jobs`` cores stay busy until the last compile.  Returns
    ``{"records": [...], "seconds": wall time, "unique": {target: n},
    "compiled": {target: n}}``; records are sorted by target, kernel, case.
    ``kernels_root``: the directory holding the ``vllm`` package of the
    kernels (default: the checkout's vllm_overlay).  ``candidates``: compile
    the candidate tiles of paged_context_attention instead
    (``cases.TILE_CANDIDATES``).
    """
    targets = list(targets or TARGETS)
    cache = cache or cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    kernels_root = kernels_root or ROOT / "vllm_overlay"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # tests/without_vllm: the vLLM names the kernel files import (no vLLM here).
    env["PYTHONPATH"] = os.pathsep.join([str(kernels_root), str(ROOT / "tests" / "without_vllm"),
                                         str(SCRIPTS)])
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="compile-tier-") as tmp:
        tmp = Path(tmp)
        # Triton's own cache goes to a scratch directory: the facts cache is
        # the one that persists, so a cold run compiles everything it claims to.
        env["TRITON_CACHE_DIR"] = str(tmp / "triton")
        env["TRITON_ALWAYS_COMPILE"] = "1"  # ptxas -v runs (and logs) for every compile
        running = []
        for target in targets:
            out, log = tmp / f"{target}.json", open(tmp / f"{target}.log", "w")
            cmd = [sys.executable, "-m", "compile_tier.worker", "--target", target,
                   "--cache", str(cache), "--slots", str(tmp), "--jobs", str(jobs),
                   "--out", str(out), *(["--candidates"] if candidates else [])]
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, target, out, log))
        failed = []
        for proc, target, out, log in running:
            try:
                proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            if proc.returncode != 0:
                failed.append(f"compile worker {target} exited {proc.returncode}:\n"
                              f"{Path(log.name).read_text()[-4000:]}")
        if failed:
            raise RuntimeError("\n".join(failed))
        records = [r for _, _, out, _ in running for r in json.loads(out.read_text())]
    records.sort(key=lambda r: (r["target"], r["kernel"], r["case"]))
    unique = {t: len({r["key"] for r in records if r["target"] == t}) for t in targets}
    compiled = {t: len({r["key"] for r in records if r["target"] == t and not r["cached"]})
                for t in targets}
    return dict(records=records, seconds=round(time.perf_counter() - start, 1),
                unique=unique, compiled=compiled)

"""Run the compile workers: every target in its own process, ``jobs`` compiles at a time."""

from __future__ import annotations

import json
import os
import shutil
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


SCRATCH_PREFIX = "compile-tier-"
TICK_S = 15.0


def say(text: str) -> None:
    print(f"[compile-tier] {text}", file=sys.stderr, flush=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_scratch(tmp_root: Path | None = None) -> list[Path]:
    """Scratch folders (``compile-tier-<pid>-*``) of runs whose process is gone: a run killed
    by SIGKILL cleans nothing up; the next one removes what it left (Triton's cache, 100+ MB)."""
    removed = []
    for path in Path(tmp_root or tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _progress(tmp: Path, target: str) -> str:
    try:
        done, total, compiled = (tmp / f"{target}.progress").read_text().split()
    except (OSError, ValueError):
        return f"{target} starting"
    return f"{target} {done}/{total} ({compiled} compiled)"


def run(targets=None, jobs: int = 2, cache: Path | None = None,
        kernels_root: Path | None = None, timeout_s: float = 1800,
        candidates: bool = False, tick_s: float = TICK_S) -> dict:
    """Compile (or read from the cache) every spec of ``targets``.

    One worker process per target, all started at once (the imports overlap);
    between them they compile at most ``jobs`` kernels at a time (lock-file
    slots), so ``jobs`` cores stay busy until the last compile.  Returns
    ``{"records": [...], "seconds": wall time, "unique": {target: n},
    "compiled": {target: n}}``; records are sorted by target, kernel, case.
    ``kernels_root``: the directory holding the ``vllm`` package of the
    kernels (default: the checkout's vllm_overlay).  ``candidates``: compile
    the candidate tiles of paged_context_attention instead
    (``cases.TILE_CANDIDATES``).  Progress goes to stderr every ``tick_s``
    seconds.  The scratch folder (Triton's cache, the workers' logs) is
    removed however the run ends: an exception or an interrupt (SIGINT, or
    SIGTERM turned into KeyboardInterrupt by the caller) stops the workers
    first; a SIGKILLed run's folder goes with the next run.
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
    for stale in remove_stale_scratch():
        say(f"removed {stale}, left by a killed run")
    what = "candidate tiles" if candidates else "kernels"
    say(f"{what} for {', '.join(targets)}: facts cached in {cache} (a cold cache compiles every "
        f"spec, {jobs} at a time: minutes)")
    tmp = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
    running = []
    try:
        # Triton's own cache goes to a scratch directory: the facts cache is
        # the one that persists, so a cold run compiles everything it claims to.
        env["TRITON_CACHE_DIR"] = str(tmp / "triton")
        env["TRITON_ALWAYS_COMPILE"] = "1"  # ptxas -v runs (and logs) for every compile
        # The workers' temporary files (ptxas inputs and logs) too: a worker
        # stopped mid-compile cannot remove its own, the scratch folder goes.
        (tmp / "tmp").mkdir()
        env["TMPDIR"] = str(tmp / "tmp")
        for target in targets:
            out, log = tmp / f"{target}.json", open(tmp / f"{target}.log", "w")
            cmd = [sys.executable, "-m", "compile_tier.worker", "--target", target,
                   "--cache", str(cache), "--slots", str(tmp), "--jobs", str(jobs),
                   "--out", str(out), "--progress", str(tmp / f"{target}.progress"),
                   *(["--candidates"] if candidates else [])]
            proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, target, out, log))
        last_tick = time.perf_counter()
        pending = list(running)
        while pending:
            time.sleep(0.2)
            now = time.perf_counter()
            for item in list(pending):
                proc, target = item[0], item[1]
                if proc.poll() is not None:
                    pending.remove(item)
                    say(f"{target} done (exit {proc.returncode}), {now - start:.0f} s")
                elif now - start > timeout_s:
                    proc.kill()
                    proc.wait()
            if pending and now - last_tick >= tick_s:
                last_tick = now
                say(", ".join(_progress(tmp, t) for _, t, _, _ in pending) + f"; {now - start:.0f} s")
        failed = []
        for proc, target, out, log in running:
            log.close()
            if proc.returncode != 0:
                failed.append(f"compile worker {target} exited {proc.returncode}:\n"
                              f"{Path(log.name).read_text()[-4000:]}")
        if failed:
            raise RuntimeError("\n".join(failed))
        records = [r for _, _, out, _ in running for r in json.loads(out.read_text())]
    finally:
        for proc, _, _, log in running:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    records.sort(key=lambda r: (r["target"], r["kernel"], r["case"]))
    unique = {t: len({r["key"] for r in records if r["target"] == t}) for t in targets}
    compiled = {t: len({r["key"] for r in records if r["target"] == t and not r["cached"]})
                for t in targets}
    return dict(records=records, seconds=round(time.perf_counter() - start, 1),
                unique=unique, compiled=compiled)

"""``python3 scripts/compile_tier.py report``: the worker processes and the command line."""

from __future__ import annotations

import argparse
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


def say(text: str) -> None:
    print(f"[compile-tier] {text}", file=sys.stderr, flush=True)


def run(targets=None, cache: Path | None = None) -> dict:
    """Compile (or read from the cache) every spec of ``targets``, one worker process per
    target, all at once.  Returns ``{"records": [...] sorted by target, kernel, case,
    "seconds", "unique": {target: n}, "compiled": {target: n}}``.  Triton's own cache and the
    workers' files go to a scratch folder, removed however the run ends."""
    targets = list(targets or TARGETS)
    cache = cache or cache_dir()
    start = time.perf_counter()
    say(f"kernels for {', '.join(targets)}: facts cached in {cache} (a cold cache compiles "
        "every spec: minutes)")
    records = []
    with tempfile.TemporaryDirectory(prefix="compile-tier-") as tmp:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        # The kernels from vllm_overlay and the vLLM names they import from tests/without_vllm.
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "vllm_overlay"),
                                             str(ROOT / "tests" / "without_vllm"), str(SCRIPTS)])
        env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton")  # a cold run compiles everything
        running = []
        try:
            for target in targets:
                out = Path(tmp) / f"{target}.json"
                cmd = [sys.executable, "-m", "compile_tier.worker", target, str(cache), str(out)]
                running.append((subprocess.Popen(cmd, env=env, cwd=ROOT), target, out))
            for proc, target, out in running:
                if proc.wait():
                    raise RuntimeError(f"compile worker {target} exited {proc.returncode}")
                say(f"{target} done, {time.perf_counter() - start:.0f} s")
                records += json.loads(out.read_text())
        finally:
            for proc, _, _ in running:
                proc.kill()
                proc.wait()
    records.sort(key=lambda r: (r["target"], r["kernel"], r["case"]))
    unique = {t: len({r["key"] for r in records if r["target"] == t}) for t in targets}
    compiled = {t: len({r["key"] for r in records if r["target"] == t and not r["cached"]})
                for t in targets}
    return dict(records=records, seconds=round(time.perf_counter() - start, 1),
                unique=unique, compiled=compiled)


def main(argv=None) -> int:
    from . import report, roofline

    p = argparse.ArgumentParser(prog="compile_tier")
    p.add_argument("cmd", choices=["report"], help="compile (or read cached facts), then write "
                   "benchmarks/results/compile/*.json, docs/compile-tier.md's table and "
                   "docs/roofline-amd.md")
    p.add_argument("--cache", type=Path)
    args = p.parse_args(argv)
    result = run(cache=args.cache)
    # Everything is rendered before anything is written: a failure leaves the checkout as it was.
    files = {**report.render(result, ROOT), **roofline.render(ROOT)}
    for path, text in files.items():
        state = "unchanged"
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            state = "wrote"
        print(f"[compile-report] {state} {path.relative_to(ROOT)}")
    print(f"{len(result['records'])} specs, unique {result['unique']}, "
          f"compiled {result['compiled']}, {result['seconds']} s")
    return 0

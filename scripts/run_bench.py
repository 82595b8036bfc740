#!/usr/bin/env python3
"""make bench: run the kernel benchmark suites on the GPU at hand, one JSON per run.

Writes ``<out>/<YYYYmmdd-HHMM>-<device>-<commit>.json`` (pytest-benchmark's format;
per-case numbers in ``extra_info``, device, versions, commit, dirty and the run's exit
status in ``machine_info.series``), sealed (seriestool/results.py) so ``make report`` can
tell it from an edited one, and the run's output in ``<out>/logs/<name>.bench.log``.
``--suite NAME`` (repeatable) runs only benchmarks/bench_NAME.py; other arguments go to
pytest.  On a machine with a copy of the tree and no git, pass the state read where the
git is: ``SERIES_COMMIT=$(git rev-parse HEAD) SERIES_DIRTY=0 make bench``; without
SERIES_DIRTY the state is "unknown" and ``make report`` does not use the file.
The baselines read upstream files from the pinned tree (``VLLM_PINNED_TREE``, default
build/vllm); for a GPU machine without build/, ``python3 benchmarks/upstream_kernels.py stage
build/vllm DIR`` copies them to DIR.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmarks import provenance  # noqa: E402
from seriestool import results  # noqa: E402  (stdlib only)

def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "cpu"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--suite", action="append", default=[],
                        help="run benchmarks/bench_SUITE.py only (repeatable)")
    args, pytest_args = parser.parse_known_args(argv)
    state = provenance.series_state(ROOT, os.environ)
    env = dict(os.environ, SERIES_COMMIT=state["commit"],
               SERIES_DIRTY={True: "1", False: "0"}.get(state["dirty"], "unknown"))
    if state["dirty"] is not False:
        print(f"[bench] WARNING: the tree's state is {state['dirty']} (dirty or unknown): "
              "make report will not use this file", flush=True)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    slug = re.sub(r"[^a-z0-9]+", "-", _device().lower()).strip("-")
    commit = re.sub(r"[^0-9a-zA-Z]+", "", state["commit"])[:10] or "unknown"
    path = out / f"{stamp}-{slug}-{commit}.json"
    log = out / "logs" / f"{path.stem}.bench.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    suites = [str(ROOT / "benchmarks" / f"bench_{name}.py") for name in args.suite]
    cmd = [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
           *(suites or [str(ROOT / "benchmarks")]), f"--benchmark-json={path}",
           "--benchmark-columns=median,rounds", *pytest_args]
    print(f"[bench] device: {_device()}; commit {state['commit']} (dirty: {state['dirty']}); "
          f"results -> {path}", flush=True)
    started = time.monotonic()
    with open(log, "w", encoding="utf-8") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
        rc = proc.wait()
    seconds = round(time.monotonic() - started, 1)
    if not path.exists():
        print(f"[bench] no results written (pytest exit {rc}); log: {log}", flush=True)
        return rc or 1
    data = json.loads(path.read_text())
    series = data.setdefault("machine_info", {}).setdefault("series", {})
    series["run"] = {"pytest_exit": rc, "seconds": seconds, "suites": args.suite,
                     "pytest_args": pytest_args, "log": f"logs/{log.name}"}
    path.write_text(json.dumps(results.seal(data), indent=4) + "\n")
    print(f"[bench] wrote {path} and {log} ({seconds} s, pytest exit {rc})", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

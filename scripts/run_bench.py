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
``--stage DIR`` (where build/vllm is) copies the upstream files the baselines load at run
time to DIR; on the GPU machine ``VLLM_PINNED_TREE=DIR``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmarks import provenance  # noqa: E402
from seriestool import results  # noqa: E402  (stdlib only)

# What the baselines read from the pinned tree (benchmarks/upstream_kernels.py,
# bench_mla_rope_cache.build_cuda_fused).
PINNED_FILES = (
    "vllm/v1/attention/backends/rocm_aiter_fa.py",
    # The eager-step baseline's merge when its CUDA build fails.
    "vllm/v1/attention/ops/triton_merge_attn_states.py",
)
# csrc files the baselines compile, each with its include closure.
PINNED_CSRC = ("attention/merge_attn_states.cu",)


def _device() -> str:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return "cpu"


def stage_pinned(tree: Path, dest: Path) -> list[str]:
    """Copy PINNED_FILES, the CUDA MLA kernel's and PINNED_CSRC's csrc closures
    from ``tree`` to ``dest``."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bench_mla_rope_cache import csrc_closure, stage_csrc

    for rel in PINNED_FILES:
        if not (tree / rel).is_file():
            raise SystemExit(f"{tree / rel} not found: run `make apply` first (or pass --tree)")
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(tree / rel, dest / rel)
    stage_csrc(tree / "csrc", dest / "csrc")
    staged = [*PINNED_FILES, *(f"csrc/{rel}" for rel in csrc_closure(dest / "csrc"))]
    for start in PINNED_CSRC:
        stage_csrc(tree / "csrc", dest / "csrc", start)
        staged += [f"csrc/{rel}" for rel in csrc_closure(dest / "csrc", start)]
    return staged


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--suite", action="append", default=[],
                        help="run benchmarks/bench_SUITE.py only (repeatable)")
    parser.add_argument("--stage", type=Path, default=None, metavar="DIR",
                        help="copy the upstream files the baselines need to DIR, then exit")
    parser.add_argument("--tree", type=Path, default=ROOT / "build" / "vllm",
                        help="the pinned tree --stage reads (default build/vllm)")
    args, pytest_args = parser.parse_known_args(argv)
    if args.stage:
        for rel in stage_pinned(args.tree, args.stage):
            print(f"[bench] staged {args.stage / rel}")
        print(f"[bench] on the GPU machine: VLLM_PINNED_TREE={args.stage}")
        return 0

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

"""``python3 scripts/compile_tier.py run|report``."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from . import report, roofline
from .run import ROOT, run
from .targets import TARGETS


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="compile_tier")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="compile (or read cached facts) and print a summary")
    r.add_argument("--target", action="append", choices=sorted(TARGETS))
    r.add_argument("--jobs", type=int, default=2)
    r.add_argument("--cache", type=Path)
    r.add_argument("--json", type=Path, help="write all records here")
    w = sub.add_parser("report", help="run, then write benchmarks/results/compile/*.json, "
                       "docs/compile-tier.md's table and docs/roofline-amd.md")
    w.add_argument("--jobs", type=int, default=2)
    w.add_argument("--cache", type=Path)
    w.add_argument("--no-candidates", action="store_true",
                   help="skip the candidate tiles (their files and table stay as committed)")
    args = p.parse_args(argv)
    # SIGTERM/SIGHUP unwind like Ctrl-C: the workers are stopped and the scratch folder removed.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    try:
        return _main(args)
    except KeyboardInterrupt:
        print(f"[compile-{args.cmd}] interrupted; nothing written, scratch folder removed",
              file=sys.stderr)
        return 130


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _main(args) -> int:
    if args.cmd == "run":
        result = run(args.target, jobs=args.jobs, cache=args.cache)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        print(f"{len(result['records'])} specs, unique {result['unique']}, "
              f"compiled {result['compiled']}, {result['seconds']} s")
    elif args.cmd == "report":
        result = run(jobs=args.jobs, cache=args.cache)
        candidates = None if args.no_candidates else run(jobs=args.jobs, cache=args.cache,
                                                         candidates=True)
        # Everything is rendered before anything is written: a failure leaves the checkout as it was.
        files = {**report.render(result, ROOT, candidates), **roofline.render(ROOT)}
        stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        signal.pthread_sigmask(signal.SIG_BLOCK, stops)   # all files or none of them
        try:
            changed = set(report.write_all(files))
        finally:
            for sig in stops:   # a signal that came while writing: the work is done, let it go
                signal.signal(sig, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)
        for path in files:
            state = "wrote" if path in changed else "unchanged"
            print(f"[compile-report] {state} {path.relative_to(ROOT)}")
        print(f"[compile-report] {len(result['records'])} specs, unique {result['unique']}, "
              f"compiled {result['compiled']}, {result['seconds']} s")
    return 0

"""``python3 scripts/compile_tier.py run|report``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from . import roofline
from .report import write
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
    args = p.parse_args(argv)
    if args.cmd == "run":
        result = run(args.target, jobs=args.jobs, cache=args.cache)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1))
        print(f"{len(result['records'])} specs, unique {result['unique']}, "
              f"compiled {result['compiled']}, {result['seconds']} s")
    elif args.cmd == "report":
        result = run(jobs=args.jobs, cache=args.cache)
        candidates = run(jobs=args.jobs, cache=args.cache, candidates=True)
        for path in [*write(result, ROOT, candidates), roofline.write(ROOT)]:
            print(f"[compile-report] wrote {path.relative_to(ROOT)}")
        print(f"[compile-report] {len(result['records'])} specs, unique {result['unique']}, "
              f"compiled {result['compiled']}, {result['seconds']} s")
    return 0

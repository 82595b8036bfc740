#!/usr/bin/env python3
"""python3 scripts/sweep.py run CONFIG [--address A] [--out DIR] [--force] | report DIR

``run``: each cell of CONFIG without an ``ok`` record in DIR runs as one Ray task asking for
its GPUs and CPUs, on a cluster (``--address``) or a local Ray; each record is written as its
task returns, then DIR/REPORT.md (``report`` rewrites and prints it).  docs/sweeps-and-e2e.md.
Exit status: 0 all cells ok, 1 some cell failed, 2 a config or usage error.
"""

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep import config, run  # noqa: E402
from sweep.config import SweepError  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sweep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("verb", choices=("run", "report"))
    parser.add_argument("path", type=Path, help="run: a config; report: a results folder")
    parser.add_argument("--out", type=Path, help="results folder (default: the config's `out`, "
                                                 "else benchmarks/results/sweeps/NAME)")
    parser.add_argument("--address", help="Ray cluster: auto, HOST:6379 or ray://HOST:10001")
    parser.add_argument("--force", action="store_true", help="run every cell again")
    args = parser.parse_args(argv)
    try:
        if args.verb == "report":
            if not (args.path / "sweep.json").is_file():
                raise SweepError(f"{args.path} is not a sweep's results folder (no sweep.json)")
            (args.path / "REPORT.md").write_text(run.render(args.path))
            print((args.path / "REPORT.md").read_text(), end="")
            return 0
        data, cells = config.load(args.path)
        default = run.ROOT / "benchmarks" / "results" / "sweeps" / data["name"]
        out = args.out or Path(data.get("out") or default)
        counts = run.run(data, cells, out.resolve(), address=args.address, force=args.force)
        return 1 if counts["error"] else 0
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

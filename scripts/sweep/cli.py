"""Command line: python3 scripts/sweep.py {run,list,report} ...

  run CONFIG      run every cell without a successful result (Ray: --address, or a local Ray)
  list CONFIG     the cells, their keys and whether each is done, failed or to run (no Ray)
  report PATH     rewrite and print the merged report of a results folder (or of a config's)

Exit status: 0 all cells ok, 1 some cell failed, 2 a config or usage error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import SweepError
from . import config as config_mod
from .driver import ROOT, default_out, run_sweep
from .report import write_report
from .results import index


def _out(cfg: config_mod.SweepConfig, override: Path | None) -> Path:
    return (override or cfg.out or default_out(ROOT, cfg.name)).resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sweep.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="verb", required=True)
    run_p = sub.add_parser("run", help="run the sweep's cells on Ray")
    run_p.add_argument("config", type=Path)
    run_p.add_argument("--address", default=None,
                       help="Ray cluster: 'auto' (the cluster this node joined), HOST:6379, or "
                            "ray://HOST:10001; default: RAY_ADDRESS, else a new local Ray")
    run_p.add_argument("--out", type=Path, default=None,
                       help="results folder (default: the config's `out`, else "
                            "benchmarks/results/sweeps/<name>/)")
    run_p.add_argument("--force", action="store_true", help="run every cell, even finished ones")
    run_p.add_argument("--no-ship", action="store_true",
                       help="do not upload this checkout as Ray's working_dir (every node must see "
                            "it at the same path)")
    run_p.add_argument("--wait-infeasible", action="store_true",
                       help="submit cells no current node can hold (autoscaling clusters)")
    list_p = sub.add_parser("list", help="list the cells and their state")
    list_p.add_argument("config", type=Path)
    list_p.add_argument("--out", type=Path, default=None)
    rep_p = sub.add_parser("report", help="write REPORT.md of a results folder and print it")
    rep_p.add_argument("path", type=Path, help="a results folder, or a config file")
    rep_p.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        if args.verb == "run":
            cfg = config_mod.load(args.config)
            summary = run_sweep(cfg, _out(cfg, args.out), address=args.address, force=args.force,
                                ship=not args.no_ship, wait_infeasible=args.wait_infeasible)
            return 1 if summary["error"] else 0
        if args.verb == "list":
            cfg = config_mod.load(args.config)
            found = index(_out(cfg, args.out))
            for cell in cfg.cells:
                state = found[cell.key][1]["status"] if cell.key in found else "todo"
                state = {"ok": "done", "error": "failed"}.get(state, state)
                print(f"{cell.key}  {state:<6}  gpus={cell.gpus:<3g} {cell.label}")
            print(f"{len(cfg.cells)} cell(s); results folder {_out(cfg, args.out)}")
            return 0
        path = args.path
        out = _out(config_mod.load(path), args.out) if path.is_file() else path.resolve()
        if not out.is_dir():
            raise SweepError(f"{out} is not a results folder")
        report = write_report(out)
        print(report.read_text(), end="")
        print(f"[sweep] wrote {report}", file=sys.stderr)
        return 0
    except SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130

"""Command line: python3 scripts/series.py {apply,check,refresh,fetch,readme,pr,pr-stack,topics,rebase}."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import Interrupted, SeriesError, buildtree, export, lint, patchfile, progress, prstack, readme, rebase, sdist
from .pins import load_pins


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="series.py", description=__doc__)
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the series repository (default: this checkout)")
    parser.add_argument("--build", type=Path, default=None,
                        help="the build tree (default: ROOT/build/vllm)")
    sub = parser.add_subparsers(dest="verb", required=True)
    sub.add_parser("fetch", help="download and verify the pinned sdist into the cache")
    apply_p = sub.add_parser("apply", help="build the patched tree")
    apply_p.add_argument("--force", action="store_true",
                         help="discard uncommitted edits and unsaved commits in the build tree")
    sub.add_parser("check", help="lint the series")
    sub.add_parser("refresh", help="regenerate patches/ and vllm_overlay/ from the build tree")
    sub.add_parser("readme", help="rewrite README.md's series table from the patch headers")
    pr_p = sub.add_parser("pr", help="export one topic as an upstream PR: branch pr/<topic>, dist/<topic>/")
    pr_p.add_argument("--topic", required=True, help="one of the patch header topics")
    stack_p = sub.add_parser("pr-stack", help="git am each exported PR alone and all stacked on pristine "
                             "upstream; with --python, run the PRs' tests there")
    stack_p.add_argument("--python", default=None, help="the Python that runs the PRs' tests (CPU)")
    sub.add_parser("topics", help="print the topics, in series order")
    reb = sub.add_parser("rebase", help="port the series to another vLLM release (git's three-way merges)")
    reb.add_argument("--version", default=None, help="the vLLM release to port to (VLLM_VERSION)")
    reb.add_argument("--sha256", default=None, help="its sdist's sha256 (VLLM_SDIST_SHA256)")
    how = reb.add_mutually_exclusive_group()
    how.add_argument("--continue", dest="resume", action="store_true", help="go on after resolving a conflict")
    how.add_argument("--abort", action="store_true", help="drop the rebase in progress")
    args = parser.parse_args(argv)
    progress.interrupts_raise()
    root = args.root.resolve()
    layout = buildtree.Layout(root=root, build=(args.build or root / "build" / "vllm").resolve())
    try:
        if args.verb == "fetch":
            print(sdist.fetch(load_pins(root), sdist.cache_dir()))
        elif args.verb == "apply":
            buildtree.apply(layout, force=args.force)
        elif args.verb == "check":
            findings = lint.lint(layout)
            print("\n".join([*findings, f"make check: {lint.summary(layout, findings)}"]))
            return 1 if findings else 0
        elif args.verb == "refresh":
            report = buildtree.refresh(layout)
            print("\n".join(report) if report else "refresh: nothing changed")
        elif args.verb == "pr":
            print("\n".join(export.export(layout, args.topic, root / "dist")))
        elif args.verb == "pr-stack":
            print("\n".join(prstack.check_stack(layout, root / "dist", args.python)))
        elif args.verb == "topics":
            print("\n".join(patchfile.TOPICS))
        elif args.verb == "rebase" and args.abort:
            print(rebase.abort(layout))
        elif args.verb == "rebase":
            code, text = rebase.resume(layout) if args.resume else rebase.start(layout, args.version, args.sha256)
            print(text)
            return code
        elif args.verb == "readme":
            changed = readme.update(root)
            print("README.md: series table " + ("rewritten" if changed else "already current"))
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:   # Ctrl-C, or SIGTERM/SIGHUP (progress.interrupts_raise)
        what = str(exc) if isinstance(exc, Interrupted) else "a plain rerun cleans up and starts again"
        print(f"{args.verb}: interrupted; {what}", file=sys.stderr)
        return 130
    return 0

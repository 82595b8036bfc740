"""``python3 scripts/validate_rocm.py [--parts a,b] [--allow-cuda] [--model DIR] ...``

Checks the prerequisites of the parts asked for (all by default) and stops
with exit status 2 and one line per missing thing; else runs each part in
order (its output in ``<out>/<part>.log``), judges every claim of
claims.toml and writes ``<out>/results.json`` and ``<out>/REPORT.md``.
Exit status: 0 every part that ran passed and no claim failed, 1 otherwise,
2 a prerequisite is missing (nothing ran).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import claims, environment, prereqs, report
from .parts import ORDER, PARTS, Context, facts_target

ROOT = Path(__file__).resolve().parents[2]

Runner = Callable[[list[str], dict, Path, Path], int]


def run_command(cmd: list[str], env: dict, cwd: Path, log: Path) -> int:
    """Run ``cmd``, its output to the terminal and to ``log``; its exit status."""
    with open(log, "w", encoding="utf-8") as sink:
        sink.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            sink.write(line)
        return proc.wait()


def _parts(text: str | None) -> list[str]:
    names = [p.strip() for p in (text or "").split(",") if p.strip()] or list(ORDER)
    unknown = [p for p in names if p not in PARTS]
    if unknown:
        raise SystemExit(f"error: unknown part(s) {', '.join(unknown)}; parts: {', '.join(ORDER)}")
    return [p for p in ORDER if p in names]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="validate_rocm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", help=f"comma-separated, of: {', '.join(ORDER)} (default: all)")
    p.add_argument("--allow-cuda", action="store_true",
                   help="on a CUDA GPU: skip the ROCm-only parts with a reason, run the rest")
    p.add_argument("--model", help="local model directory for the e2e part (never downloaded)")
    p.add_argument("--upstream", default=os.environ.get("E2E_UPSTREAM"),
                   help="command running the upstream install's Python (e2e)")
    p.add_argument("--patched", default=os.environ.get("E2E_PATCHED"),
                   help="command running the patched install's Python (e2e)")
    p.add_argument("--out", type=Path, help="default build/validate-rocm/<date>-<device>-<commit>")
    return p


def _default_out(env: dict) -> Path:
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M")
    slug = re.sub(r"[^a-z0-9]+", "-", str(env.get("device") or "no-gpu").lower()).strip("-")
    commit = re.sub(r"[^0-9a-zA-Z]+", "", str(env.get("commit") or ""))[:10] or "unknown"
    return ROOT / "build" / "validate-rocm" / f"{stamp}-{slug}-{commit}"


def _child_env(base: dict, extra: dict) -> dict:
    env = dict(base)
    for key, value in extra.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


def main(argv: list[str] | None = None, *, probe: Callable[[Path], dict] = environment.probe,
         runner: Runner = run_command, root: Path = ROOT) -> int:
    args = build_parser().parse_args(argv)
    parts = _parts(args.parts)
    sys.path.insert(0, str(root / "scripts"))
    from seriestool.pins import load_pins

    env = probe(root)
    opts = prereqs.Options(root=root, pins=load_pins(root), allow_cuda=args.allow_cuda,
                           model=args.model, upstream=args.upstream, patched=args.patched)
    to_run, skipped, missing = prereqs.plan(parts, env, opts)
    if missing:
        print(f"validate-rocm: cannot run {', '.join(p for p in parts if p not in skipped)}; "
              "missing:", file=sys.stderr)
        for line in missing:
            print(f"  - {line}", file=sys.stderr)
        print("Nothing was run. docs/rocm.md says what each part needs.", file=sys.stderr)
        return 2
    if "facts" in to_run and facts_target(env.get("arch")) is None:
        to_run.remove("facts")
        skipped["facts"] = f"the compile tier has no target for {env.get('arch')}"
    out = (args.out or _default_out(env)).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ctx = Context(root=root, out=out, python=sys.executable, env=env, opts=opts)
    results_parts: dict[str, dict] = {}
    for name in parts:
        if name in skipped:
            results_parts[name] = {"status": "skipped", "reason": skipped[name]}
            continue
        part = PARTS[name]
        cmd = part.command(ctx)
        log = out / f"{name}.log"
        print(f"[validate-rocm] {name}: {part.title}\n[validate-rocm] $ {' '.join(cmd)}",
              flush=True)
        started = time.monotonic()
        rc = runner(cmd, _child_env(ctx.base_env, part.env(ctx)), root, log)
        collected = part.collect(ctx, rc)
        results_parts[name] = {**collected, "command": cmd, "log": log.name,
                               "seconds": round(time.monotonic() - started, 1)}
        print(f"[validate-rocm] {name}: {collected['status']}", flush=True)
    judged = [claims.judge(c, results_parts) for c in claims.load()]
    summary = {v: sum(c["verdict"] == v for c in judged) for v in ("held", "failed", "not run")}
    results = {
        "format": "validate-rocm/1",
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": {k: env.get(k) for k in report.ENV_KEYS},
        "pins": {k: opts.pins.get(k) for k in ("VLLM_VERSION", "AITER_REF", "TRITON_VERSION")},
        "options": {"parts": parts, "allow_cuda": args.allow_cuda, "model": args.model,
                    "upstream": args.upstream, "patched": args.patched},
        "parts": results_parts, "claims": judged, "summary": summary,
    }
    data, page = report.write(results, out)
    print(f"[validate-rocm] {summary['held']} held, {summary['failed']} failed, "
          f"{summary['not run']} not run; wrote {data} and {page}")
    failed = summary["failed"] or any(p.get("status") == "failed" for p in results_parts.values())
    return 1 if failed else 0

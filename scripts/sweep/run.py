"""Run a sweep's cells as Ray tasks (``run``), one record per cell, and its REPORT.md."""

from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .config import SweepError

ROOT = Path(__file__).resolve().parents[2]
# Every node runs this checkout (Ray's working_dir, without build outputs and results) and
# the sweep package (a py_module: the tasks' code).
RUNTIME_ENV = {"working_dir": str(ROOT), "py_modules": [str(ROOT / "scripts" / "sweep")],
               "excludes": ["/build/", "/.venv/", "/.git/", "/benchmarks/results/", "__pycache__/"]}


def records(out: Path) -> dict[str, dict]:
    """key -> record of every cell file in ``out``."""
    found = (json.loads(path.read_text()) for path in sorted(out.glob("*.json")))
    return {r["key"]: r for r in found if r.get("format") == "sweep-cell/1"}


def write_json(path: Path, data: dict) -> None:
    """Through a temporary file: a half-written record is never read as finished."""
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def run_fake(params: dict) -> dict:
    """Tests and dry runs: sleep, raise or kill the worker as configured; ``numbers`` are the
    metrics."""
    time.sleep(float(params.get("sleep_s", 0)))
    if params.get("crash"):
        os._exit(3)
    if params.get("raise"):
        raise RuntimeError(str(params["raise"]))
    return {"device": "fake", "metrics": params.get("numbers") or {}}


def run_e2e(cell: dict, installs: dict, commit: str, out: Path) -> dict:
    """``scripts/e2e.py RECIPE`` (from Ray's copy of the checkout, the task's working
    directory) with both installs; every other parameter is an e2e.py option."""
    params = dict(cell["params"])
    cmd = [sys.executable, "scripts/e2e.py", params.pop("recipe"), "--out", str(out),
           "--work", str(out / "work"), "--upstream", installs["upstream"],
           "--patched", installs["patched"]]
    if cell["timeout_s"]:
        cmd += ["--timeout-s", str(cell["timeout_s"])]
    for name, value in cell["env"].items():
        cmd += ["--env", f"{name}={value}"]
    for name, value in params.items():
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        cmd += [f"--{name.replace('_', '-')}", text]
    proc = subprocess.run(cmd, capture_output=True, text=True,  # e2e.py applies the timeout
                          env={**os.environ, "SERIES_COMMIT": commit})  # Ray's copy has no .git
    files = sorted(out.glob("*.json"))
    if proc.returncode not in (0, 1) or not files:  # 1: a run or a gate failed, recorded
        raise RuntimeError(f"exit {proc.returncode}: {shlex.join(cmd)}\n"
                           f"{(proc.stdout + proc.stderr)[-8000:]}")
    doc = json.loads(files[-1].read_text())
    failed = [f for f in doc["failed"] or [] if not f.startswith("gate failed")]
    if failed:  # a run that failed; a failed gate is a result (gate_passed: false)
        raise RuntimeError("\n".join(failed))
    metrics = {f"{row['case']} {row['metric']} ratio": row["ratio"] for row in doc["comparison"]}
    if doc["gate"]:
        metrics["gate_passed"] = doc["gate"]["passed"]
    return {"device": doc["machine_info"]["series"]["device"], "metrics": metrics, "e2e": doc}


def run_cell(cell: dict, commit: str, installs: dict | None) -> dict:
    """What one Ray task runs: the record of the cell's result or of its error."""
    t0 = time.monotonic()
    record = {"format": "sweep-cell/1", "key": cell["key"], "label": cell["label"],
              "status": "error", "cell": cell, "commit": commit,
              "datetime": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "node": socket.gethostname(), "metrics": {}}
    try:
        with tempfile.TemporaryDirectory(prefix="sweep-") as tmp:
            if cell["kind"] == "fake":
                record.update(run_fake(cell["params"]))
            else:
                record.update(run_e2e(cell, installs, commit, Path(tmp)))
        record["status"] = "ok"
    except Exception as exc:
        record["error"] = {"type": type(exc).__name__, "message": str(exc),
                           "traceback": traceback.format_exc()}
    record["duration_s"] = round(time.monotonic() - t0, 3)
    return record


def failure(cell: dict, commit: str, exc: Exception) -> dict:
    """The record of a cell whose task returned none (worker died, node lost, no node fits)."""
    return {"format": "sweep-cell/1", "key": cell["key"], "label": cell["label"],
            "status": "error", "cell": cell, "commit": commit, "metrics": {},
            "error": {"type": type(exc).__name__, "message": str(exc)[:4000]}}


def run(data: dict, cells: list, out: Path, *, address=None, force=False, log=print) -> dict:
    """Run the cells without an ok record in ``out`` on Ray; write REPORT.md; the counts."""
    import ray
    from ray.util import as_completed

    out.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    planned = [{"key": cell["key"], "label": cell["label"]} for cell in cells]
    write_json(out / "sweep.json", {"name": data["name"], "config": data, "commit": commit,
                                    "cells": planned})
    done = set() if force else {k for k, r in records(out).items() if r["status"] == "ok"}
    todo = [c for c in cells if c["key"] not in done]
    counts = {"cells": len(cells), "skipped": len(cells) - len(todo), "ok": 0, "error": 0}
    log(f"[sweep] {data['name']}: {len(todo)} of {len(cells)} cell(s) to run; results in {out}")
    if todo and not ray.is_initialized():
        ray.init(address=address, runtime_env=RUNTIME_ENV)
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]] if todo else []
    task = ray.remote(run_cell)

    def save(record: dict) -> None:
        name = re.sub(r"[^A-Za-z0-9.=_-]+", "-", record["label"])[:80]
        write_json(out / f"{name}-{record['key']}.json", record)
        counts[record["status"]] += 1
        log(f"[sweep] {counts['ok'] + counts['error']}/{len(todo)} {record['status']}: "
            f"{record['label']}")

    submitted = {}
    for cell in todo:
        if any(n.get("GPU", 0) >= cell["gpus"] and n.get("CPU", 0) >= cell["cpus"] for n in nodes):
            ref = task.options(num_gpus=cell["gpus"], num_cpus=cell["cpus"],
                               max_retries=cell["retries"], name=f"sweep:{cell['label']}"[:200])
            submitted[ref.remote(cell, commit, data.get("installs"))] = cell
        else:  # Ray would keep it queued, waiting for a node that may never join
            save(failure(cell, commit, SweepError(f"no node of the cluster has {cell['gpus']:g} "
                                                  f"GPU(s) and {cell['cpus']:g} CPU(s)")))
    for ref in as_completed(list(submitted), chunk_size=1, yield_obj_refs=True):
        try:
            save(ray.get(ref))
        except Exception as exc:  # the worker died, a node was lost, ...
            save(failure(submitted[ref], commit, exc))
    (out / "REPORT.md").write_text(render(out))
    log(f"[sweep] {counts['ok']} ok, {counts['error']} failed, {counts['skipped']} done before; "
        f"{out / 'REPORT.md'}")
    return counts


def _fmt(value) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def render(out: Path) -> str:
    """REPORT.md: one row per planned cell, with its numbers (e2e: patched / upstream) or error."""
    manifest = json.loads((out / "sweep.json").read_text())
    found = records(out)
    lines = [f"# Sweep `{manifest['name']}`", "",
             "Generated by `scripts/sweep.py report` from the cell files of this folder (which "
             "also hold the tracebacks); every number is copied from the cell file of its row.", "",
             "| cell | status | metrics, or the error | device | s |", "|---|---|---|---|---:|"]
    for cell in manifest["cells"]:
        r = found.get(cell["key"], {"label": cell["label"], "status": "not run", "metrics": {}})
        if r["status"] == "error":
            text = f"{r['error']['type']}: {r['error']['message'].strip()[:300]}"
        else:
            text = ", ".join(f"{k}={_fmt(v)}" for k, v in r["metrics"].items())
        lines.append(f"| {r['label']} | {r['status']} | {_fmt(text)} | {r.get('device', '')} | "
                     f"{r.get('duration_s', 0):.1f} |")
    return "\n".join(lines) + "\n"

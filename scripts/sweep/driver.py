"""Submit a sweep's cells to Ray and record each result the moment it finishes.

No scheduling here: every cell is one ``ray.remote`` task with ``num_gpus`` /
``num_cpus`` from the cell, all submitted at once; Ray decides where and when
each runs.  The driver only waits (``ray.wait``), writes each finished record
and prints progress.

Code reaches the workers through Ray's runtime environment: ``scripts/sweep``
and ``scripts/e2e`` as ``py_modules``, and (``ship=True``, the default) this
checkout as ``working_dir`` without build outputs, virtual environments, git
data or results -- so a kernel cell on any node runs the same benchmarks.  With
``ship=False`` every node must see this checkout at the same path.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from . import SweepError
from .cells import run_cell
from .config import SweepConfig
from .report import write_report
from .results import MANIFEST, finished_keys, write_json, write_record

ROOT = Path(__file__).resolve().parents[2]
HEARTBEAT_S = 60.0
SHIP_EXCLUDES = ["/build/", "/dist/", "/.venv/", "/.git/", "/.pinned/", "/.whl/", "/.benchmarks/",
                 "/.pytest_cache/", "/.ruff_cache/", "/benchmarks/results/", "__pycache__/",
                 "*.pyc"]


def default_out(root: Path, name: str) -> Path:
    return root / "benchmarks" / "results" / "sweeps" / name


def series_state(root: Path) -> dict:
    """Commit of the checkout the sweep runs (SERIES_COMMIT when there is no .git)."""
    def git(*args: str) -> str | None:
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                                  text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None

    commit = git("rev-parse", "HEAD") or os.environ.get("SERIES_COMMIT", "unknown")
    dirty = git("status", "--porcelain", "--", "patches", "vllm_overlay", "benchmarks", "scripts")
    return {"commit": commit, "dirty": bool(dirty) if dirty is not None else "unknown"}


def runtime_env(root: Path, ship: bool) -> dict:
    env: dict = {"py_modules": [str(root / "scripts" / "sweep"), str(root / "scripts" / "e2e")]}
    if ship:
        env["working_dir"] = str(root)
        env["excludes"] = list(SHIP_EXCLUDES)
    return env


def connect(address: str | None = None, *, root: Path = ROOT, ship: bool = True,
            **init_kwargs) -> None:
    """``ray.init`` with the sweep's runtime environment (job level: Ray uploads local
    directories only there).  Callers that start Ray themselves (tests) use this too."""
    import ray

    ray.init(address=address, runtime_env=runtime_env(root, ship), **init_kwargs)


def _largest_node() -> dict[str, float]:
    import ray

    largest = {"GPU": 0.0, "CPU": 0.0}
    for node in ray.nodes():
        if node.get("Alive"):
            for name, most in largest.items():
                largest[name] = max(most, float(node.get("Resources", {}).get(name, 0)))
    return largest


def _lost_record(spec: dict, exc: BaseException, seconds: float) -> dict:
    """The record of a cell whose task never returned (worker died, node lost, ...)."""
    import traceback

    return {"format": "sweep-cell/1", "sweep": spec["sweep"], "key": spec["key"],
            "label": spec["label"], "status": "error", "cell": spec["cell"],
            "install": spec.get("install"),
            "datetime": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "duration_s": round(seconds, 3),
            "machine_info": {"series": dict(spec["series"])}, "benchmarks": [], "metrics": {},
            "error": {"type": type(exc).__name__, "message": str(exc)[:4000],
                      "traceback": "".join(traceback.format_exception(exc))[-8000:]}}


def write_manifest(out_dir: Path, config: SweepConfig, series: dict) -> None:
    write_json(out_dir / MANIFEST, {
        "format": "sweep-manifest/1", "name": config.name,
        "config": str(config.path) if config.path else None, "config_data": config.raw,
        "series": series,
        "updated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cells": [{"key": c.key, "label": c.label, **c.to_dict()} for c in config.cells],
    })


def run_sweep(config: SweepConfig, out_dir: Path, *, root: Path = ROOT, address: str | None = None,
              force: bool = False, ship: bool = True, wait_infeasible: bool = False,
              ray_init_kwargs: dict | None = None, heartbeat_s: float = HEARTBEAT_S,
              log: Callable[[str], None] = print) -> dict:
    """Run every cell without a successful result in ``out_dir``; return a summary.

    Uses the Ray connection of the caller when ``ray.is_initialized()`` (made with
    :func:`connect`, so the workers can import the sweep), else connects to
    ``address`` (``None``: RAY_ADDRESS, else a new local Ray) and disconnects at the end.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    series = series_state(root)
    write_manifest(out_dir, config, series)
    done = set() if force else finished_keys(out_dir)
    todo = [c for c in config.cells if c.key not in done]
    summary = {"cells": len(config.cells), "skipped": len(config.cells) - len(todo), "ok": 0,
               "error": 0, "out": str(out_dir)}
    log(f"[sweep] {config.name}: {len(config.cells)} cell(s), {summary['skipped']} already done "
        f"(skipped), {len(todo)} to run; results -> {out_dir}")
    if todo:
        _run_cells(config, todo, out_dir, series, summary, root=root, address=address, ship=ship,
                   wait_infeasible=wait_infeasible, ray_init_kwargs=ray_init_kwargs or {},
                   heartbeat_s=heartbeat_s, log=log)
    report = write_report(out_dir)
    log(f"[sweep] {summary['ok']} ok, {summary['error']} failed, {summary['skipped']} skipped; "
        f"report -> {report}")
    return summary


def _run_cells(config: SweepConfig, todo: list, out_dir: Path, series: dict, summary: dict, *,
               root: Path, address: str | None, ship: bool, wait_infeasible: bool,
               ray_init_kwargs: dict, heartbeat_s: float, log: Callable[[str], None]) -> None:
    try:
        import ray
    except ImportError as exc:
        raise SweepError("the sweep needs Ray on the driver and every node "
                         "(pip install ray)") from exc

    started_ray = not ray.is_initialized()
    if started_ray:
        connect(address, root=root, ship=ship, **ray_init_kwargs)
    pending: dict = {}
    try:
        largest = _largest_node()
        task = ray.remote(run_cell)
        for cell in todo:
            spec = {"sweep": config.name, "key": cell.key, "label": cell.label,
                    "cell": cell.to_dict(), "series": series,
                    "install": config.installs[cell.install].to_dict()
                    if cell.install in config.installs else None,
                    "repo": None if ship else str(root)}
            asks = {"GPU": cell.gpus, "CPU": cell.cpus}
            short = [f"{n} {asks[n]:g} > {largest[n]:g}" for n in asks if asks[n] > largest[n]]
            if short and not wait_infeasible:
                exc = SweepError(f"no node of this cluster has the resources the cell asks for "
                                 f"({', '.join(short)} on the largest node); pass "
                                 f"--wait-infeasible to submit it anyway (autoscaling clusters)")
                _record(out_dir, _lost_record(spec, exc, 0.0), summary, log)
                continue
            ref = task.options(num_gpus=cell.gpus, num_cpus=cell.cpus, max_retries=cell.retries,
                               retry_exceptions=False,
                               name=f"sweep:{cell.label}"[:200]).remote(spec)
            pending[ref] = (spec, time.monotonic())
        log(f"[sweep] submitted {len(pending)} task(s) to Ray "
            f"({ray.cluster_resources().get('GPU', 0):g} GPU(s) in the cluster)")
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=heartbeat_s)
            if not ready:
                log(f"[sweep] waiting on {len(pending)} cell(s) (running or queued for resources)")
                continue
            for ref in ready:
                spec, t0 = pending.pop(ref)
                try:
                    record = ray.get(ref)
                except (KeyboardInterrupt, SystemExit):
                    raise
                except BaseException as exc:  # worker died, node lost, runtime env failed, ...
                    record = _lost_record(spec, exc, time.monotonic() - t0)
                _record(out_dir, record, summary, log)
    except KeyboardInterrupt:
        for ref in pending:
            ray.cancel(ref, force=True)
        log("[sweep] interrupted: unfinished cells were cancelled and not recorded; "
            "run the same command again to resume")
        raise
    finally:
        if started_ray:
            ray.shutdown()


def _record(out_dir: Path, record: dict, summary: dict, log: Callable[[str], None]) -> None:
    path = write_record(out_dir, record)
    summary[record["status"]] = summary.get(record["status"], 0) + 1
    done = summary["ok"] + summary["error"] + summary["skipped"]
    line = f"[sweep] {done}/{summary['cells']} {record['status']:<5} {record['label']} " \
           f"({record.get('duration_s', 0):.1f} s) -> {path.name}"
    if record["status"] != "ok":
        message = record.get("error", {}).get("message", "").strip().splitlines()
        line += f"\n        {record['error']['type']}: {message[0] if message else ''}"
    log(line)
    sys.stdout.flush()

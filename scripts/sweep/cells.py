"""What one Ray task runs: a cell, by kind, turned into a result record.

Runs inside a Ray worker (on whichever node Ray placed it) and never raises:
an exception in the cell becomes ``status: "error"`` with its type, message and
traceback, so the driver records it and the other cells go on.  A worker that
dies outright (killed, out of memory, ``os._exit``) is caught by the driver.

Kinds:
  * ``fake``   -- for tests and dry runs: sleeps ``sleep_s``, appends a line to
                  ``touch`` (counts runs), raises ``raise`` (a message), fails while
                  the file ``raise_unless_exists`` is missing, kills its worker with
                  ``crash``, and returns ``numbers`` as its metrics (or
                  ``numbers[install]`` when keyed by install);
  * ``kernel`` -- the ``make bench`` runner (scripts/run_bench.py) on the GPUs Ray
                  gave the task; params ``select`` (pytest ``-k``), ``pytest_args``,
                  ``python`` (the GPU machine's Python, default ``python3``);
  * ``e2e``    -- one recipe of scripts/e2e for one install; params are the
                  recipe's options (``recipe``, ``model``, ``input_len``, ...).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from .results import FORMAT

LOG_TAIL_CHARS = 8000
VISIBLE_DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


class CellFailure(Exception):
    """A cell that ran and failed; carries the tail of its output."""

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


def _tail(text: str, limit: int = LOG_TAIL_CHARS) -> str:
    return text if len(text) <= limit else "...\n" + text[-limit:]


def _gpu_ids() -> list:
    try:
        import ray

        if ray.is_initialized():
            return [str(g) for g in ray.get_gpu_ids()]
    except Exception:  # outside a Ray worker (direct calls in tests)
        pass
    return []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_fake(cell: dict, spec: dict) -> dict:
    params = cell["params"]
    if params.get("touch"):
        with open(params["touch"], "a") as fh:
            fh.write(f"{spec['label']}\n")
    time.sleep(float(params.get("sleep_s", 0)))
    if params.get("crash"):
        os._exit(int(params["crash"]) if str(params["crash"]).isdigit() else 3)
    if params.get("raise"):
        raise RuntimeError(str(params["raise"]))
    marker = params.get("raise_unless_exists")
    if marker and not Path(marker).exists():
        raise FileNotFoundError(f"fake cell: {marker} does not exist yet")
    numbers = dict(params.get("numbers") or {})
    if isinstance(numbers.get(cell.get("install")), dict):  # {upstream: {...}, patched: {...}}
        numbers = dict(numbers[cell["install"]])
    return {
        "series": {"device": "fake"},
        "benchmarks": [{"name": f"fake[{spec['label']}]", "group": "fake",
                        "extra_info": {"kernel": "fake", "case": spec["label"],
                                       "shapes": {k: v for k, v in params.items()
                                                  if k != "numbers"},
                                       "results": numbers}}],
        "metrics": numbers,
    }


def run_kernel(cell: dict, spec: dict) -> dict:
    params = cell["params"]
    repo = Path(spec.get("repo") or os.getcwd())
    runner = repo / "scripts" / "run_bench.py"
    if not runner.is_file():
        raise CellFailure(f"{runner} not found: the kernel cell needs the series checkout "
                          "(shipped by the sweep as Ray's working_dir)")
    select = params.get("select")
    extra = params.get("pytest_args") or []
    if isinstance(extra, str):
        extra = shlex.split(extra)
    env = {**os.environ, **cell["env"],
           "PYTHONPATH": os.pathsep.join(filter(None, [str(repo / "vllm_overlay"),
                                                       str(repo / "tests" / "without_vllm"), str(repo),
                                                       os.environ.get("PYTHONPATH")])),
           "SERIES_COMMIT": spec["series"].get("commit", "unknown")}
    with tempfile.TemporaryDirectory(prefix="sweep-kernel-") as tmp:
        cmd = [*shlex.split(str(params.get("python", "python3"))), str(runner), "--out", tmp,
               *(["-k", str(select)] if select else []), *map(str, extra)]
        try:
            proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True,
                                  timeout=cell["timeout_s"] or None, check=False)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) \
                else (exc.stdout or "")
            raise CellFailure(f"kernel bench timed out after {cell['timeout_s']} s", _tail(out))
        log = proc.stdout + proc.stderr
        files = sorted(Path(tmp).glob("*.json"))
        if proc.returncode != 0 or not files:
            raise CellFailure(f"kernel bench failed (exit {proc.returncode}): {shlex.join(cmd)}",
                              _tail(log))
        data = json.loads(files[0].read_text())
    benchmarks = [{"name": b.get("name"), "group": b.get("group"), "extra_info": b["extra_info"]}
                  for b in data.get("benchmarks", []) if "results" in b.get("extra_info", {})]
    if not benchmarks:
        raise CellFailure("no benchmark case ran (all skipped: no GPU here, or -k matched nothing)",
                          _tail(log))
    speedups = [b["extra_info"]["speedup"] for b in benchmarks
                if isinstance(b["extra_info"].get("speedup"), (int, float))]
    metrics: dict[str, Any] = {"cases": len(benchmarks)}
    if speedups:
        metrics.update(speedup_min=min(speedups), speedup_max=max(speedups))
    return {"series": data.get("machine_info", {}).get("series", {}), "benchmarks": benchmarks,
            "metrics": metrics, "log_tail": _tail(log, 2000)}


def run_e2e(cell: dict, spec: dict) -> dict:
    scripts = str(Path(spec.get("repo") or os.getcwd()) / "scripts")
    if scripts not in sys.path:  # normally Ray ships e2e as a py_module; this is the fallback
        sys.path.append(scripts)
    from e2e import recipes
    from e2e.installs import Install

    inst = spec["install"]
    install = Install.parse(inst["name"], inst["python"], inst.get("env") or {})
    params = dict(cell["params"])
    recipe = params.pop("recipe")
    if recipe == "serve" and "port" not in params:
        params["port"] = _free_port()  # cells sharing a node must not share a server port
    with tempfile.TemporaryDirectory(prefix="sweep-e2e-") as tmp:
        try:
            doc = recipes.run_recipe(recipe, [install], recipes.options_from_params(params),
                                     out_dir=Path(tmp), env=cell["env"],
                                     timeout_s=cell["timeout_s"] or None, echo=False)
        except recipes.RecipeError as exc:
            raise CellFailure(str(exc), _tail(getattr(exc, "log_tail", ""))) from exc
        tails = []  # the working folder goes away with the task: keep the failures' log tails
        for bench in doc.get("benchmarks", []):
            log = bench["extra_info"].get("log")
            if bench["extra_info"].get("error") and log and Path(log).is_file():
                tails.append(f"==> {Path(log).name} <==\n{_tail(Path(log).read_text(), 4000)}")
    metrics: dict[str, Any] = {}
    benches = doc.get("benchmarks", [])
    for bench in benches:  # one case: its results; several: prefixed with the case
        prefix = "" if len(benches) == 1 else f"{bench['extra_info']['case']} "
        for name, value in bench["extra_info"].get("results", {}).items():
            if isinstance(value, (int, float, bool, str)):
                metrics[prefix + name] = value
    for name, value in (doc.get("gate") or {}).items():
        if name not in ("rule", "metric") and isinstance(value, (int, float, bool, str)):
            metrics[f"gate_{name}"] = value
    return {"series": doc.get("machine_info", {}).get("series", {}),
            "benchmarks": doc.get("benchmarks", []), "metrics": metrics,
            "installs": doc.get("installs"), "env_recorded": doc.get("env"),
            # A failed run is a failed cell; a failed gate is a result (gate_passed: false).
            "failed": [f for f in doc.get("failed") or [] if not f.startswith("gate failed")],
            "log_tail": "\n".join(tails) or None}


RUNNERS = {"fake": run_fake, "kernel": run_kernel, "e2e": run_e2e}


def run_cell(spec: dict) -> dict:
    """Run one cell; ``spec`` = {sweep, key, label, cell, install, series, repo}."""
    cell = spec["cell"]
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.monotonic()
    record: dict[str, Any] = {
        "format": FORMAT, "sweep": spec["sweep"], "key": spec["key"], "label": spec["label"],
        "status": "error", "cell": cell, "install": spec.get("install"),
        "datetime": started.isoformat(timespec="seconds"),
        "machine_info": {"node": socket.gethostname(), "gpu_ids": _gpu_ids(),
                         "visible_devices": {v: os.environ[v] for v in VISIBLE_DEVICE_VARS
                                             if v in os.environ},
                         "python": sys.version.split()[0],
                         "series": dict(spec.get("series") or {})},
        "benchmarks": [], "metrics": {},
    }
    try:
        outcome = RUNNERS[cell["kind"]](cell, spec)
    except Exception as exc:
        record["error"] = {"type": type(exc).__name__, "message": str(exc),
                           "traceback": traceback.format_exc()}
        if getattr(exc, "log_tail", ""):
            record["log_tail"] = exc.log_tail
    else:
        series = record["machine_info"]["series"]
        for name, value in (outcome.get("series") or {}).items():
            if value not in (None, "unknown") or name not in series:  # the driver's commit wins
                series[name] = value
        for name in ("benchmarks", "metrics", "log_tail", "installs", "env_recorded"):
            if outcome.get(name) is not None:
                record[name] = outcome[name]
        if outcome.get("failed"):
            record["error"] = {"type": "RecipeFailed", "message": "\n".join(outcome["failed"]),
                               "traceback": ""}
        else:
            record["status"] = "ok"
    record["duration_s"] = round(time.monotonic() - t0, 3)
    return record

"""What one Ray task runs: a cell, as its record (an error is recorded, never raised).

  * ``fake``   -- tests and dry runs: sleeps ``sleep_s``, raises ``raise``, fails while
                  ``raise_unless_exists`` is missing, kills its worker with ``crash``;
                  ``numbers`` are its metrics;
  * ``e2e``    -- ``scripts/e2e.py RECIPE``, upstream then patched on the same GPUs; every
                  other parameter is an e2e.py option (``lengths: 2048/16`` -> ``--lengths
                  2048/16``); the metrics are the patched / upstream ratios and the gate.
The checkout is Ray's copy of it (the task's working directory).
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


class CellFailure(Exception):
    def __init__(self, message: str, output: str = ""):
        super().__init__(message)
        self.output = output


def run_fake(params: dict) -> dict:
    time.sleep(float(params.get("sleep_s", 0)))
    if params.get("crash"):
        os._exit(3)
    if params.get("raise"):
        raise RuntimeError(str(params["raise"]))
    if params.get("raise_unless_exists") and not Path(params["raise_unless_exists"]).exists():
        raise FileNotFoundError(f"{params['raise_unless_exists']} does not exist yet")
    return {"device": "fake", "metrics": params.get("numbers") or {}}


def run_e2e(cell: dict, installs: dict, out: Path) -> dict:
    params = dict(cell["params"])
    cmd = [sys.executable, "scripts/e2e.py", params.pop("recipe"), "--out", str(out),
           "--work", str(out / "work")]
    for name, python in installs.items():
        cmd += [f"--{name}", python]
    if cell["timeout_s"]:
        cmd += ["--timeout-s", str(cell["timeout_s"])]
    for name, value in cell["env"].items():
        cmd += ["--env", f"{name}={value}"]
    for name, value in params.items():
        text = ",".join(map(str, value)) if isinstance(value, list) else str(value)
        cmd += [f"--{name.replace('_', '-')}", text]
    proc = subprocess.run(cmd, capture_output=True, text=True)  # e2e.py applies the timeout
    files = sorted(out.glob("*.json"))
    if proc.returncode not in (0, 1) or not files:  # 1: a run or a gate failed, recorded
        raise CellFailure(f"exit {proc.returncode}: {shlex.join(cmd)}",
                          (proc.stdout + proc.stderr)[-8000:])
    doc = json.loads(files[-1].read_text())
    failed = [f for f in doc["failed"] or [] if not f.startswith("gate failed")]
    if failed:  # a run that failed; a failed gate is a result (gate_passed: false)
        raise CellFailure("\n".join(failed))
    metrics = {f"{row['case']} {row['metric']} ratio": row["ratio"] for row in doc["comparison"]}
    if doc["gate"]:
        metrics["gate_passed"] = doc["gate"]["passed"]
    return {"device": doc["machine_info"]["series"]["device"], "metrics": metrics, "e2e": doc}


def run_cell(cell: dict, commit: str, installs: dict | None) -> dict:
    """Run ``cell``: the record of its result or of its error."""
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
                record.update(run_e2e(cell, installs, Path(tmp)))
        record["status"] = "ok"
    except Exception as exc:
        record["error"] = {"type": type(exc).__name__, "message": str(exc),
                           "traceback": traceback.format_exc(),
                           "output": getattr(exc, "output", "")}
    record["duration_s"] = round(time.monotonic() - t0, 3)
    return record

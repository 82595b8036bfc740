"""The results folder of a sweep: one JSON per cell, a manifest, the report.

A cell file (``<label slug>-<key>.json``) has the shape of a kernel bench file
where that makes sense (``machine_info.series`` with commit and device,
``benchmarks[].extra_info`` with the case and its numbers) plus the cell::

    {"format": "sweep-cell/1", "sweep": NAME, "key": KEY, "label": LABEL,
     "status": "ok" | "error", "cell": {kind, install, gpus, env, params, ...},
     "install": {name, python, env} | null, "datetime": START (UTC ISO), "duration_s": S,
     "machine_info": {"node", "gpu_ids", "visible_devices", "series": {commit, device, ...}},
     "benchmarks": [{"name", "group", "extra_info": {...}}], "metrics": {NAME: number},
     "error": {"type", "message", "traceback"},   # status "error" only
     "log_tail": "last lines of the cell's output"}

Files are written atomically (temporary file + rename), so an interrupted sweep
never leaves a half-written file that resume would take as finished.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

FORMAT = "sweep-cell/1"
MANIFEST = "sweep.json"
REPORT = "REPORT.md"


def slug(text: str, limit: int = 80) -> str:
    return re.sub(r"[^A-Za-z0-9.=_-]+", "-", text).strip("-")[:limit].strip("-") or "cell"


def cell_filename(label: str, key: str) -> str:
    return f"{slug(label)}-{key}.json"


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=False, default=str) + "\n")
    os.replace(tmp, path)


def index(out_dir: Path) -> dict[str, tuple[Path, dict]]:
    """key -> (path, record) of every readable cell file in ``out_dir``."""
    found: dict[str, tuple[Path, dict]] = {}
    if not out_dir.is_dir():
        return found
    for path in sorted(out_dir.glob("*.json")):
        if path.name == MANIFEST:
            continue
        try:
            record = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            print(f"[sweep] ignoring unreadable {path.name}: {exc}", file=sys.stderr)
            continue
        if not isinstance(record, dict) or record.get("format") != FORMAT or "key" not in record:
            continue
        key = record["key"]
        # Two files for one key (the label changed between runs): the newer one wins.
        if key not in found or record.get("datetime", "") >= found[key][1].get("datetime", ""):
            found[key] = (path, record)
    return found


def write_record(out_dir: Path, record: dict) -> Path:
    """Write one cell's record; older files of the same key are removed."""
    path = out_dir / cell_filename(record["label"], record["key"])
    write_json(path, record)
    for other in out_dir.glob(f"*-{record['key']}.json"):
        if other != path:
            other.unlink(missing_ok=True)
    return path


def finished_keys(out_dir: Path) -> set[str]:
    """Keys whose latest record succeeded: what a re-run skips."""
    return {key for key, (_, record) in index(out_dir).items() if record.get("status") == "ok"}

"""Sweep configs (YAML, docs/sweeps-and-e2e.md) expanded into cells: dicts of ``kind``,
``gpus``, ``cpus``, ``timeout_s``, ``retries``, ``env`` and ``params`` (every other key), with
``key``, a hash of what defines the cell's result (kind, gpus, env, params), and ``label``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from pathlib import Path


class SweepError(Exception):
    """A failure the user can act on: one message, no traceback."""

FIELDS = {"kind": None, "gpus": 0, "cpus": 1, "timeout_s": 3600, "retries": 0}


def load(path: Path) -> tuple[dict, list[dict]]:
    """(the parsed config, its cells); SweepError saying what is wrong with a bad file."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise SweepError(f"{path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise SweepError(f"{path}: the top level must be a mapping (name, installs, matrix, ...)")
    data.setdefault("name", path.stem)
    return data, expand(data)


def _set(cell: dict, name: str, value, where: str) -> None:
    if name == "env":
        if not isinstance(value, dict):
            raise SweepError(f"{where}: env must map variable names to values, got {value!r}")
        cell["env"] = {**cell["env"], **{str(k): str(v) for k, v in value.items()}}
    elif name in FIELDS:
        cell[name] = value
    else:
        cell["params"][name] = value


def _check(cell: dict, where: str, installs: dict) -> dict:
    if cell["kind"] not in ("fake", "e2e"):
        raise SweepError(f"{where}: kind must be fake or e2e, got {cell['kind']!r}")
    for name in ("gpus", "cpus", "timeout_s", "retries"):
        if isinstance(cell[name], bool) or not isinstance(cell[name], (int, float)) \
                or cell[name] < 0:
            raise SweepError(f"{where}: {name} must be a number >= 0, got {cell[name]!r}")
    if cell["kind"] == "e2e":
        if "recipe" not in cell["params"] or "model" not in cell["params"]:
            raise SweepError(f"{where}: an e2e cell needs `recipe` and `model`")
        if set(installs) != {"upstream", "patched"}:
            raise SweepError(f"{where}: e2e cells run the upstream and the patched install: "
                             "`installs` gives the command running each one's Python")
    identity = [cell["kind"], cell["gpus"], cell["env"], cell["params"]]
    cell["key"] = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    words = [f"{k}={v}" for k, v in cell["params"].items() if not isinstance(v, (dict, list))]
    cell["label"] = " ".join([cell["kind"], *words, *(f"{k}={v}" for k, v in cell["env"].items())])
    return cell


def expand(data: dict) -> list[dict]:
    """Every cell of the matrix, in order; a duplicate cell is an error."""
    unknown = set(data) - {"name", "out", "installs", "defaults", "matrix"}
    if unknown:
        raise SweepError(f"unknown top-level key(s) {sorted(unknown)}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(data["name"])):
        raise SweepError(f"`name` must be a plain folder name, got {data['name']!r}")
    matrix = data.get("matrix")
    if not isinstance(matrix, list) or not matrix or not all(isinstance(b, dict) for b in matrix):
        raise SweepError("`matrix` must be a non-empty list of blocks (mappings with `kind`)")
    cells, seen = [], set()
    for index, block in enumerate(matrix):
        where = f"matrix[{index}]"
        base = {**FIELDS, "env": {}, "params": {}}
        for name, value in [*(data.get("defaults") or {}).items(), *block.items()]:
            if name != "axes":
                _set(base, name, value, where)
        axes = block.get("axes") or {}
        if not all(isinstance(values, list) and values for values in axes.values()):
            raise SweepError(f"{where}.axes: every axis must be a non-empty list")
        for combo in itertools.product(*axes.values()):
            cell = {**base, "env": dict(base["env"]), "params": dict(base["params"])}
            for axis, value in zip(axes, combo):
                merged = value if isinstance(value, dict) and axis != "env" else {axis: value}
                for name, sub in merged.items():
                    _set(cell, name, sub, f"{where}.axes.{axis}")
            cell = _check(cell, where, data.get("installs") or {})
            if cell["key"] in seen:
                raise SweepError(f"{where}: the cell {cell['label']!r} is in the matrix twice")
            seen.add(cell["key"])
            cells.append(cell)
    return cells

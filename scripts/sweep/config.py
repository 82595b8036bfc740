"""Sweep configs (YAML or TOML) expanded into cells; the format is in docs/sweeps-and-e2e.md.

Cell fields (kind, gpus, cpus, timeout_s, retries, env) come from ``defaults``, the
block or an axis; any other key is a parameter.  An axis value that is a mapping is
merged key by key (``{model: X, gpus: 8, tp: 8}``); env mappings merge onto the
inherited env.  A cell's key hashes what defines its result: kind, gpus, env, params.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from . import SweepError

KINDS = ("fake", "e2e")
FIELDS = ("kind", "gpus", "cpus", "timeout_s", "retries", "env")


@dataclass
class Cell:
    kind: str
    params: dict
    gpus: float = 0
    cpus: float = 1
    timeout_s: float = 3600
    retries: int = 0          # Ray's max_retries: re-runs of a cell whose worker died
    env: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        identity = [self.kind, self.gpus, self.env, self.params]
        return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]

    @property
    def label(self) -> str:
        """The kind, the parameter values (a model by its last path part), the env."""
        words = [self.kind]
        for name, value in self.params.items():
            if name == "model":
                words.append(str(value).rsplit("/", 1)[-1])
            elif name == "recipe":
                words.append(str(value))
            elif not isinstance(value, (dict, list)):
                words.append(f"{name}={value}")
        return " ".join(words + [f"{k}={v}" for k, v in sorted(self.env.items())])


def load(path: Path) -> tuple[dict, list[Cell]]:
    """(the parsed config, its cells); SweepError saying what is wrong with a bad file."""
    if path.suffix not in (".toml", ".yaml", ".yml") or not path.is_file():
        raise SweepError(f"{path}: no such .yaml, .yml or .toml file")
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(path.read_text())
        else:
            import yaml

            data = yaml.safe_load(path.read_text())
    except Exception as exc:  # no PyYAML, or a syntax error
        raise SweepError(f"{path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise SweepError(f"{path}: the top level must be a mapping (name, installs, matrix, ...)")
    data.setdefault("name", path.stem)
    return data, expand(data)


def _set(cell: dict, name: str, value, where: str) -> None:
    if name == "env":
        if not isinstance(value, dict) or not all(re.fullmatch(r"[A-Za-z_]\w*", k) for k in value):
            raise SweepError(f"{where}: env must map variable names to values, got {value!r}")
        cell["env"] = {**cell["env"], **{k: str(v) for k, v in value.items()}}
    elif name in FIELDS:
        cell[name] = value
    else:
        cell["params"][name] = value


def _check(cell: dict, where: str, installs: dict) -> Cell:
    if cell["kind"] not in KINDS:
        raise SweepError(f"{where}: kind must be one of {', '.join(KINDS)}, got {cell['kind']!r}")
    for name in ("gpus", "cpus", "timeout_s", "retries"):
        if isinstance(cell[name], bool) or not isinstance(cell[name], (int, float)) \
                or cell[name] < 0:
            raise SweepError(f"{where}: {name} must be a number >= 0, got {cell[name]!r}")
    params = cell["params"]
    if cell["kind"] == "e2e":
        if "recipe" not in params or "model" not in params:
            raise SweepError(f"{where}: an e2e cell needs `recipe` and `model`")
        for name in [params["only"]] if params.get("only") else ["upstream", "patched"]:
            if not isinstance(installs.get(name), str):
                raise SweepError(f"{where}: an e2e cell runs the `{name}` install: give the "
                                 "command running its Python under `installs`")
    return Cell(**cell)


def expand(data: dict) -> list[Cell]:
    """Every cell of the matrix, in order; a duplicate cell is an error."""
    unknown = set(data) - {"name", "out", "installs", "defaults", "matrix"}
    if unknown:
        raise SweepError(f"unknown top-level key(s) {sorted(unknown)}")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(data["name"])):
        raise SweepError(f"`name` must be a plain folder name, got {data['name']!r}")
    matrix = data.get("matrix")
    if not isinstance(matrix, list) or not matrix or not all(isinstance(b, dict) for b in matrix):
        raise SweepError("`matrix` must be a non-empty list of blocks (mappings with `kind`)")
    installs = data.get("installs") or {}
    if set(installs) - {"upstream", "patched"}:
        raise SweepError("`installs` names the upstream and the patched install only")
    cells, seen = [], {}
    for index, block in enumerate(matrix):
        where = f"matrix[{index}]"
        base = {"kind": None, "gpus": 0, "cpus": 1, "timeout_s": 3600, "retries": 0, "env": {},
                "params": {}}
        for key, value in [*(data.get("defaults") or {}).items(), *block.items()]:
            if key != "axes":
                _set(base, key, value, where)
        axes = block.get("axes") or {}
        if not all(isinstance(values, list) and values for values in axes.values()):
            raise SweepError(f"{where}.axes: every axis must be a non-empty list")
        for combo in itertools.product(*axes.values()):
            cell = {**base, "env": dict(base["env"]), "params": dict(base["params"])}
            for axis, value in zip(axes, combo):
                merged = value if isinstance(value, dict) and axis != "env" else {axis: value}
                for key, sub in merged.items():
                    _set(cell, key, sub, f"{where}.axes.{axis}")
            done = _check(cell, where, installs)
            if done.key in seen:
                raise SweepError(f"{where}: cell {done.label!r} is the same as {seen[done.key]!r}")
            seen[done.key] = done.label
            cells.append(done)
    return cells

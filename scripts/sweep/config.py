"""Sweep config files and matrix expansion.

A config is YAML (``.yaml``/``.yml``) or TOML (``.toml``) with these keys::

    name: rocm-mi300x            # the sweep's name (default: the file's stem)
    out: path/to/results         # optional; default benchmarks/results/sweeps/<name>/
    installs:                    # e2e cells: how to run each vLLM install
      upstream: {python: /opt/vllm-upstream/bin/python}
      patched:  {python: "docker exec vllm-patched python3", env: {VLLM_X: "1"}}
    defaults:                    # applies to every cell; a block or an axis overrides it
      gpus: 1
      timeout_s: 3600
      env: {VLLM_ROCM_USE_AITER: "1"}
    matrix:                      # a list of blocks; each block expands to cells
      - kind: e2e                # fake | kernel | e2e
        recipe: throughput       # any other key is a parameter of every cell of the block
        axes:                    # cartesian product over these lists
          model: [meta-llama/Llama-3.1-8B-Instruct]
          lengths: [{input_len: 2048, output_len: 16}, {input_len: 8192, output_len: 16}]
          install: [upstream, patched]
          env: [{}, {VLLM_ROCM_USE_AITER_MHA: "0"}]

Cell fields (``kind``, ``install``, ``gpus``, ``cpus``, ``timeout_s``, ``retries``,
``env``) can be set in ``defaults``, in a block, or by an axis; every other key is a
parameter.  ``gpus``/``cpus`` are what the Ray task asks for; ``timeout_s`` limits each
command a cell runs (the bench run, each vLLM command); ``retries`` is how often Ray
re-runs a cell whose worker died (never on an exception: that is a result).

An axis value that is a mapping is merged key by key (so zipped values such as
input/output length pairs, or a model with the GPUs it needs, are one axis);
``env`` mappings merge onto the inherited env.

A cell's key is a stable hash of what defines its result: kind, install, gpus,
env and params (not timeout or retries).  The results folder is indexed by it, so
a re-run skips cells whose key already has a successful result.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import SweepError

KINDS = ("fake", "kernel", "e2e")
CELL_FIELDS = ("kind", "install", "gpus", "cpus", "timeout_s", "retries", "env")
DEFAULT_TIMEOUT_S = 3600.0
KEY_CHARS = 16  # hex digits of sha256 kept in a cell key (64 bits)


@dataclass(frozen=True)
class Install:
    """One vLLM install: a command that runs its Python (a path, or a prefix such as
    ``docker exec NAME python3``), plus env vars set for everything run with it."""

    name: str
    python: str
    env: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "python": self.python, "env": dict(self.env)}


@dataclass
class Cell:
    kind: str
    params: dict[str, Any]
    install: str | None = None
    gpus: float = 0
    cpus: float = 1
    timeout_s: float = DEFAULT_TIMEOUT_S
    retries: int = 0
    env: dict[str, str] = field(default_factory=dict)
    block: int = 0

    @property
    def identity(self) -> dict:
        """What defines the cell's result; hashed into :attr:`key`."""
        return {"kind": self.kind, "install": self.install, "gpus": self.gpus,
                "env": self.env, "params": self.params}

    @property
    def key(self) -> str:
        blob = json.dumps(self.identity, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(blob.encode()).hexdigest()[:KEY_CHARS]

    @property
    def label(self) -> str:
        """A readable name: kind, then the parameter values, then the install."""
        parts = [self.kind]
        for name in ("recipe", "select"):
            if name in self.params:
                parts.append(str(self.params[name]))
        for name, value in self.params.items():
            if name in ("recipe", "select") or isinstance(value, (dict, list)):
                continue
            text = str(value).rsplit("/", 1)[-1] if name == "model" else str(value)
            parts.append(text if name == "model" else f"{name}={text}")
        for name, value in sorted(self.env.items()):
            parts.append(f"{name}={value}")
        if self.install:
            parts.append(self.install)
        return " ".join(parts)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "install": self.install, "gpus": self.gpus, "cpus": self.cpus,
                "timeout_s": self.timeout_s, "retries": self.retries, "env": dict(self.env),
                "params": dict(self.params)}


@dataclass
class SweepConfig:
    name: str
    path: Path | None
    out: Path | None
    installs: dict[str, Install]
    cells: list[Cell]
    raw: dict = field(default_factory=dict)


def load_file(path: Path) -> dict:
    """Parse a YAML or TOML config file into a dict."""
    if not path.is_file():
        raise SweepError(f"config {path} not found")
    text = path.read_text()
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError as exc:
                raise SweepError(f"{path}: YAML configs need PyYAML (pip install pyyaml), "
                                 "or write the config as TOML") from exc
            data = yaml.safe_load(text)
        else:
            raise SweepError(f"{path}: unknown config format {suffix!r} (use .yaml, .yml or .toml)")
    except SweepError:
        raise
    except Exception as exc:  # yaml.YAMLError / tomllib.TOMLDecodeError
        raise SweepError(f"{path}: {type(exc).__name__}: {exc}") from exc
    if not isinstance(data, dict):
        raise SweepError(f"{path}: the top level must be a mapping "
                         "(name, installs, defaults, matrix)")
    return data


def load(path: Path) -> SweepConfig:
    return parse(load_file(path), path=path)


def _str_env(env: Any, where: str) -> dict[str, str]:
    if env is None:
        return {}
    if not isinstance(env, dict):
        raise SweepError(f"{where}: env must be a mapping of NAME: value, got {env!r}")
    out = {}
    for name, value in env.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
            raise SweepError(f"{where}: {name!r} is not an environment variable name")
        out[str(name)] = "1" if value is True else "0" if value is False else str(value)
    return out


def _set(cell: dict, name: str, value: Any, where: str) -> None:
    """Apply one config key to a cell under construction (fields vs params)."""
    if name == "env":
        cell["env"] = {**cell["env"], **_str_env(value, where)}
    elif name in CELL_FIELDS:
        cell[name] = value
    else:
        cell["params"][name] = value


def _parse_installs(data: Any) -> dict[str, Install]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SweepError("installs: must map a name to {python: ..., env: {...}}")
    installs = {}
    for name, spec in data.items():
        if isinstance(spec, str):
            spec = {"python": spec}
        if not isinstance(spec, dict) or not spec.get("python"):
            raise SweepError(f"installs.{name}: needs `python` (a path or a command that runs "
                             "that install's Python)")
        unknown = set(spec) - {"python", "env"}
        if unknown:
            raise SweepError(f"installs.{name}: unknown key(s) {sorted(unknown)}")
        installs[str(name)] = Install(str(name), str(spec["python"]),
                                      _str_env(spec.get("env"), f"installs.{name}"))
    return installs


def _finish(cell: dict, where: str, installs: dict[str, Install]) -> Cell:
    kind = cell.get("kind")
    if kind not in KINDS:
        raise SweepError(f"{where}: kind must be one of {', '.join(KINDS)}, got {kind!r}")
    for name in ("gpus", "cpus", "timeout_s"):
        value = cell.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise SweepError(f"{where}: {name} must be a number >= 0, got {value!r}")
    retries = cell.get("retries")
    if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
        raise SweepError(f"{where}: retries must be an integer >= 0, got {retries!r}")
    install = cell.get("install")
    if kind == "e2e":
        if install is None:
            raise SweepError(f"{where}: an e2e cell needs `install` (one of the config's installs)")
        if "recipe" not in cell["params"]:
            raise SweepError(f"{where}: an e2e cell needs `recipe` "
                             "(throughput, mixed, serve, gsm8k)")
    if install is not None and kind != "fake" and str(install) not in installs:
        known = ", ".join(sorted(installs)) or "none defined"
        raise SweepError(f"{where}: install {install!r} is not in `installs` ({known})")
    gpus = cell["gpus"]
    return Cell(kind=kind, params=cell["params"], install=None if install is None else str(install),
                gpus=int(gpus) if float(gpus).is_integer() else float(gpus), cpus=cell["cpus"],
                timeout_s=float(cell["timeout_s"]), retries=retries, env=cell["env"],
                block=cell["block"])


def parse(data: dict, path: Path | None = None) -> SweepConfig:
    """Expand a parsed config into cells (in matrix order; duplicates are an error)."""
    where0 = str(path) if path else "config"
    unknown = set(data) - {"name", "out", "installs", "defaults", "matrix"}
    if unknown:
        raise SweepError(f"{where0}: unknown top-level key(s) {sorted(unknown)}")
    name = data.get("name") or (path.stem if path else None)
    if not name or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", str(name)):
        raise SweepError(f"{where0}: `name` must be a plain folder name (letters, digits, . _ -), "
                         f"got {name!r}")
    installs = _parse_installs(data.get("installs"))
    defaults = data.get("defaults") or {}
    if not isinstance(defaults, dict):
        raise SweepError(f"{where0}: defaults must be a mapping")
    matrix = data.get("matrix")
    if not isinstance(matrix, list) or not matrix:
        raise SweepError(f"{where0}: `matrix` must be a non-empty list of blocks")
    cells: list[Cell] = []
    seen: dict[str, str] = {}
    for index, block in enumerate(matrix):
        where = f"matrix[{index}]"
        if not isinstance(block, dict):
            raise SweepError(f"{where}: a block must be a mapping with `kind`")
        base: dict[str, Any] = {"kind": None, "install": None, "gpus": 0, "cpus": 1,
                                "timeout_s": DEFAULT_TIMEOUT_S, "retries": 0, "env": {},
                                "params": {}, "block": index}
        for key, value in defaults.items():
            _set(base, key, value, "defaults")
        for key, value in block.items():
            if key != "axes":
                _set(base, key, value, where)
        axes = block.get("axes") or {}
        if not isinstance(axes, dict):
            raise SweepError(f"{where}.axes: must map an axis name to a list of values")
        for axis, values in axes.items():
            if not isinstance(values, list) or not values:
                raise SweepError(f"{where}.axes.{axis}: must be a non-empty list")
        for combo in itertools.product(*axes.values()) if axes else [()]:
            cell = {**base, "env": dict(base["env"]), "params": dict(base["params"])}
            for axis, value in zip(axes, combo):
                if axis != "env" and isinstance(value, dict):
                    for key, sub in value.items():
                        _set(cell, key, sub, f"{where}.axes.{axis}")
                else:
                    _set(cell, axis, value, f"{where}.axes.{axis}")
            finished = _finish(cell, where, installs)
            if finished.key in seen:
                raise SweepError(f"{where}: cell {finished.label!r} is the same as "
                                 f"{seen[finished.key]!r} "
                                 "(same kind, install, gpus, env and params)")
            seen[finished.key] = finished.label
            cells.append(finished)
    out = Path(data["out"]) if data.get("out") else None  # relative: to the working directory
    return SweepConfig(name=str(name), path=path, out=out, installs=installs, cells=cells, raw=data)

"""Read pins.env, the one file that pins upstream versions."""

from __future__ import annotations

import re
from pathlib import Path

from . import SeriesError

REQUIRED = ("VLLM_VERSION", "VLLM_SDIST_SHA256", "VLLM_COMMIT", "AITER_REF")


def load_pins(root: Path) -> dict[str, str]:
    path = root / "pins.env"
    if not path.is_file():
        raise SeriesError(f"{path}: missing (the pin file of the series)")
    pins: dict[str, str] = {}
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip().isidentifier():
            raise SeriesError(f"{path}:{lineno}: expected KEY=VALUE, got {raw!r}")
        pins[key.strip()] = value.strip()
    missing = [k for k in REQUIRED if not pins.get(k)]
    if missing:
        raise SeriesError(f"{path}: missing pins: {', '.join(missing)}")
    return pins


def update_pins(root: Path, values: dict[str, str]) -> list[str]:
    """Set KEY=VALUE lines of pins.env in place (comments and order kept); return "KEY: old -> new"."""
    path = root / "pins.env"
    text = path.read_text()
    changed = []
    for key, value in values.items():
        line = re.search(rf"^{key}=(.*)$", text, re.M)
        if not line:
            raise SeriesError(f"{path}: no line for {key}")
        if line.group(1).strip() != value:
            text = text[:line.start(1)] + value + text[line.end(1):]
            changed.append(f"{key}: {line.group(1).strip()} -> {value}")
    path.write_text(text)
    return changed

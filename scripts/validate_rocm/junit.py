"""Read a pytest ``--junitxml`` file: one outcome per test, by pytest node id."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

__all__ = ["read", "summary"]


def _nodeid(root: Path, classname: str, name: str) -> str:
    """``tests.mla.test_x`` / ``tests.mla.test_x.TestY`` + name -> a pytest node id."""
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (root / path).is_file() or cut == 1:
            return "::".join([path, *parts[cut:], name])
    return name


def read(path: Path, root: Path) -> list[dict]:
    """[{"test": node id, "outcome": passed | failed | error | skipped, "message"}]."""
    if not path.is_file():
        return []
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                message = (el.get("message") or "").splitlines()[0][:300] if el.get(
                    "message") else ""
                break
        tests.append({"test": _nodeid(root, case.get("classname", ""), case.get("name", "")),
                      "outcome": outcome, "message": message})
    return tests


def summary(tests: list[dict]) -> dict:
    counts: dict[str, int] = {}
    for t in tests:
        counts[t["outcome"]] = counts.get(t["outcome"], 0) + 1
    return counts

"""The claims registry (claims.toml) and the verdict on each claim: held / failed / not run.

``load()`` reads the registry; ``quote_found(root, claim)`` says whether its
quote is still in its doc; ``judge(claim, parts)`` checks it against the
collected parts (``parts.Part.collect`` results by part name).  A claim holds
when every check holds, fails when any fails, and is not run otherwise.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

__all__ = ["CHECK_KINDS", "REGISTRY", "judge", "load", "quote_found"]

REGISTRY = Path(__file__).with_name("claims.toml")
HELD, FAILED, NOT_RUN = "held", "failed", "not run"
PYTEST_PARTS = ("rocm-tests", "conformance", "kernels")


def load(path: Path = REGISTRY) -> list[dict]:
    return tomllib.loads(path.read_text(encoding="utf-8"))["claim"]


def _squash(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def quote_found(root: Path, claim: dict) -> bool:
    path = root / claim["doc"]
    return path.is_file() and _squash(claim["quote"]) in _squash(path.read_text(encoding="utf-8"))


def _part(parts: dict, name: str) -> tuple[dict | None, str | None]:
    part = parts.get(name)
    if part is None or part.get("status") in (None, NOT_RUN, "skipped"):
        reason = (part or {}).get("reason") or "not run"
        return None, f"{name}: {reason}"
    return part, None


def _check_test(prefix: str, parts: dict):
    tests = [t for name in PYTEST_PARTS for t in (parts.get(name) or {}).get("tests", [])
             if t["test"].startswith(prefix)]
    if not tests:
        return NOT_RUN, f"{prefix}: did not run"
    bad = [t["test"] for t in tests if t["outcome"] in ("failed", "error")]
    if bad:
        return FAILED, f"{len(bad)} of {len(tests)} failed: {', '.join(bad[:3])}"
    passed = sum(t["outcome"] == "passed" for t in tests)
    if not passed:
        return NOT_RUN, f"{prefix}: skipped ({tests[0]['message'] or 'no reason'})"
    return HELD, f"{passed} passed"


def _check_part(name: str, parts: dict):
    part, why = _part(parts, name)
    if part is None:
        return NOT_RUN, why
    return (HELD, f"{name} passed") if part["status"] == "passed" else (FAILED, f"{name} failed")


def _check_conformance(fake: str, parts: dict):
    part, why = _part(parts, "conformance")
    report = (part or {}).get("conformance")
    if report is None:
        return NOT_RUN, why or "conformance: no report"
    fakes = report["fakes"] if fake == "*" else {
        k: v for k, v in report["fakes"].items() if k == fake}
    compared = sum(v["compared"] for v in fakes.values())
    bad = sorted(k for k, v in fakes.items() if v["disagreed"])
    if bad:
        n = sum(fakes[k]["disagreed"] for k in bad)
        return FAILED, f"{n} calls disagree: {', '.join(bad)}"
    if not compared:
        return NOT_RUN, f"{fake}: no call compared"
    return HELD, f"{compared} calls agree"


def _check_facts(what: str, parts: dict):
    part, why = _part(parts, "facts")
    if part is None or "rows" not in part:
        return NOT_RUN, why or "facts: no device facts"
    amd = str(part.get("target", "")).startswith("gfx")
    if what == "match":
        diff = part["differences"]
        if diff:
            return FAILED, (f"{len(diff)} of {part['cases']} cases differ from "
                            f"{part.get('committed')} (Triton {part.get('triton')} here, "
                            f"{part.get('committed_triton')} there), e.g. {diff[0]['case']}")
        return HELD, f"{part['cases']} cases as committed"
    if not amd:
        return NOT_RUN, f"{what}: an AMD budget; the device's target is {part.get('target')}"
    if what == "spills":
        if part["spills"]:
            return FAILED, f"{len(part['spills'])} cases spill: {', '.join(part['spills'][:3])}"
        return HELD, f"no spill in {part['cases']} cases"
    if what == "waves":
        # The runtime's occupancy where the device gave one, else the compile facts'.
        low = [f"{r['kernel']}/{r['case']}" for r in part["rows"]
               if ((r.get("driver") or {}).get("waves_per_simd")
                   or r["compiled_here"].get("waves_per_simd") or 0) < 2]
        if low:
            return FAILED, f"{len(low)} cases under 2 waves per SIMD: {', '.join(low[:3])}"
        return HELD, f"{part['cases']} cases at >= 2 waves per SIMD"
    raise ValueError(f"facts:{what}")


def _bench_cases(parts: dict):
    part, why = _part(parts, "bench")
    return (part or {}).get("cases"), why


def _check_bench(spec: str, parts: dict):
    kernel, _, floor = spec.partition(">=")
    cases, why = _bench_cases(parts)
    rows = [c for c in cases or [] if c["kernel"] == kernel]
    if not rows:
        return NOT_RUN, why or f"{kernel}: no case measured"
    if floor:
        low = [f"{c['case']} {c['vs_upstream']}x" for c in rows
               if c["vs_upstream"] is None or c["vs_upstream"] < float(floor)]
        if low:
            return FAILED, f"{len(low)} of {len(rows)} under {floor}x upstream: {', '.join(low[:3])}"
        return HELD, f"{len(rows)} cases >= {floor}x upstream"
    return HELD, f"{len(rows)} cases measured"


def _check_roofline(kernel: str, parts: dict):
    cases, why = _bench_cases(parts)
    rows = [c for c in cases or [] if kernel in ("*", c["kernel"])
            and c["fraction_of_bound"] is not None]
    if not rows:
        return NOT_RUN, why or "no case with an AMD bound on this device"
    over = [f"{c['kernel']}/{c['case']} {c['fraction_of_bound']}" for c in rows
            if c["fraction_of_bound"] > 1.0]
    if over:
        return FAILED, f"{len(over)} cases faster than the bound: {', '.join(over[:3])}"
    best = max(c["fraction_of_bound"] for c in rows)
    return HELD, f"{len(rows)} cases within the bound (best {best:.0%} of it)"


def _check_e2e(recipe: str, parts: dict):
    part, why = _part(parts, "e2e")
    doc = ((part or {}).get("recipes") or {}).get(recipe)
    if doc is None:
        return NOT_RUN, why or f"{recipe}: not measured"
    if doc["failed"] or doc["gate"] is False:
        return FAILED, "; ".join(doc["failed"][:2]) or "gate failed"
    return HELD, f"{len(doc['comparison'])} comparisons" + (", gate passed" if doc["gate"] else "")


CHECK_KINDS = {"test": _check_test, "part": _check_part, "conformance": _check_conformance,
               "facts": _check_facts, "bench": _check_bench, "roofline": _check_roofline,
               "e2e": _check_e2e}


def check(spec: str, parts: dict) -> tuple[str, str]:
    kind, _, arg = spec.partition(":")
    return CHECK_KINDS[kind](arg, parts)


def judge(claim: dict, parts: dict) -> dict:
    results = [(spec, *check(spec, parts)) for spec in claim["checks"]]
    verdicts = {v for _, v, _ in results}
    verdict = FAILED if FAILED in verdicts else NOT_RUN if NOT_RUN in verdicts else HELD
    return {"id": claim["id"], "doc": claim["doc"], "quote": claim["quote"],
            "claim": claim["claim"], "verdict": verdict,
            "checks": [{"check": s, "verdict": v, "detail": d} for s, v, d in results]}

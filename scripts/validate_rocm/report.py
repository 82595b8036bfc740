"""The run's results JSON (``results.json``) and its one-page report (``REPORT.md``)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["ENV_KEYS", "write"]

ENV_KEYS = ("device", "arch", "hip", "torch", "triton", "aiter", "cuda", "gpu_count", "python",
            "python_version", "host", "commit", "dirty")
_MARK = {"held": "held", "failed": "**FAILED**", "not run": "not run",
         "passed": "passed", "skipped": "skipped"}


def _environment_line(env: dict) -> str:
    return (f"{env.get('device') or 'no GPU'} ({env.get('arch') or '-'}); ROCm (HIP) "
            f"{env.get('hip') or '-'}; torch {env.get('torch')}; Triton {env.get('triton')}; "
            f"AITER {env.get('aiter') or '-'}; commit {str(env.get('commit'))[:10]}"
            f"{' (dirty)' if env.get('dirty') is True else ''}")


def _part_line(name: str, part: dict) -> str:
    status = part.get("status", "not run")
    if part.get("reason"):
        detail = part["reason"]
    elif "counts" in part:
        detail = ", ".join(f"{n} {k}" for k, n in sorted(part["counts"].items())) or "no tests"
        conf = part.get("conformance")
        if conf:
            compared = sum(e["compared"] for e in conf["fakes"].values())
            detail += (f"; {compared} fake calls compared, disagreeing: "
                       f"{', '.join(conf['disagreeing']) or 'none'}")
    elif name == "facts" and "cases" in part:
        detail = (f"{part['target']}: {part['cases']} cases, {len(part['differences'])} differ "
                  f"from the committed facts, {len(part['spills'])} spill, "
                  f"{len(part.get('occupancy_differs', []))} with another occupancy at run "
                  f"time, {len(part['errors'])} errors")
    elif name == "bench" and "cases" in part:
        detail = f"{len(part['cases'])} cases ({part['file']})"
    elif name == "e2e" and "recipes" in part:
        detail = ", ".join(part["recipes"]) or "no recipe measured"
    else:
        detail = f"exit {part.get('rc')}" if "rc" in part else ""
    log = f" ([log]({part['log']}))" if part.get("log") else ""
    return f"| {name} | {_MARK.get(status, status)} | {detail}{log} |"


def _bench_lines(part: dict) -> list[str]:
    kernels: dict[str, list] = {}
    for c in part.get("cases", []):
        kernels.setdefault(c["kernel"], []).append(c)

    def span(values, fmt):
        values = [v for v in values if v is not None]
        if not values:
            return "n/a"
        lo, hi = min(values), max(values)
        return fmt(lo) if lo == hi else f"{fmt(lo)}–{fmt(hi)}"

    out = ["| kernel | cases | vs upstream | fraction of the AMD bound |", "|---|---:|---|---|"]
    for kernel, rows in sorted(kernels.items()):
        out.append(f"| {kernel} | {len(rows)} | {span([r['vs_upstream'] for r in rows], lambda v: f'{v:.2f}×')} "
                   f"| {span([r['fraction_of_bound'] for r in rows], lambda v: f'{v:.0%}')} |")
    return out


def markdown(results: dict) -> str:
    env = results["environment"]
    claims = results["claims"]
    s = results["summary"]
    out = ["# make validate-rocm", "",
           f"{_environment_line(env)}. Run {results['generated']}; parts: "
           f"{', '.join(results['options']['parts'])}"
           f"{'; ALLOW_CUDA' if results['options']['allow_cuda'] else ''}.", "",
           f"**{s['held']} held, {s['failed']} failed, {s['not run']} not run** of {len(claims)} "
           "ROCm claims of README.md and docs/ (registry: scripts/validate_rocm/claims.toml). "
           "held: every check behind the claim passed on this device; failed: one did not; "
           "not run: a check could not run here (the reason is given).", "",
           "## Claims", "", "| verdict | claim | where | checks |", "|---|---|---|---|"]
    for c in claims:
        checks = "; ".join(f"`{k['check']}`: {k['verdict']} ({k['detail']})" for k in c["checks"])
        out.append(f"| {_MARK[c['verdict']]} | {c['claim']} | {c['doc']}: “{c['quote']}” | "
                   f"{checks} |")
    out += ["", "## Parts", "", "| part | status | detail |", "|---|---|---|"]
    for name, part in results["parts"].items():
        out.append(_part_line(name, part))
    conf = (results["parts"].get("conformance") or {}).get("conformance")
    if conf and conf["disagreements"]:
        out += ["", "## Fakes that disagree with AITER", "",
                "| fake | test | problem |", "|---|---|---|"]
        for d in conf["disagreements"][:12]:
            out.append(f"| {d['fake']} | `{d['test']}` | {d['problem']} |")
        out += ["", "Each call's arguments: conformance.json."]
    bench = results["parts"].get("bench") or {}
    if bench.get("cases"):
        out += ["", "## Benchmarks", "", *_bench_lines(bench), "",
                "fraction of the bound: docs/roofline-amd.md's bound on this device / measured "
                "time (n/a off AMD); vs upstream: the suite's ratio in the same run."]
    e2e = results["parts"].get("e2e") or {}
    if e2e.get("recipes"):
        out += ["", "## End to end (patched / upstream)", "",
                "| recipe | case | metric | upstream | patched | ratio |", "|---|---|---|---:|---:|---:|"]
        for recipe, doc in e2e["recipes"].items():
            for row in doc["comparison"]:
                ratio = f"{row['ratio']:.3f}" if row.get("ratio") is not None else "–"
                out.append(f"| {recipe} | {row['case']} | {row['metric']} | {row['upstream']:.4g} "
                           f"| {row['patched']:.4g} | {ratio} |")
    return "\n".join(out) + "\n"


def write(results: dict, out: Path) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    data, page = out / "results.json", out / "REPORT.md"
    data.write_text(json.dumps(results, indent=1, default=str) + "\n")
    page.write_text(markdown(results))
    return data, page

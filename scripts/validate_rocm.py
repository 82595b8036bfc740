#!/usr/bin/env python3
"""make validate-rocm: every ROCm claim of README.md and docs/, judged on this machine.

The checks of scripts/validate_rocm/claims.toml read what the PARTS write, each one command run
from the checkout (relative paths are its), output in <out>/<part>.log (e2e only with --model).
Each claim is held, failed or not run (with the reason), printed and written to <out>/REPORT.md.
Exit status: 0 nothing failed, 1 a check or part failed, 2 a prerequisite is missing (nothing ran).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from e2e import PROBE, commit, probe, problems, run_logged  # noqa: E402
from seriestool.pins import load_pins  # noqa: E402

CLAIMS = ROOT / "scripts" / "validate_rocm" / "claims.toml"
TREE = ROOT / "build" / "vllm"  # the patched tree (make apply)
PARTS = ("rocm-tests", "kernels", "compile", "e2e")


def missing(facts: dict, args) -> list[str]:
    """What this machine lacks for the parts; empty when nothing."""
    pin = load_pins(ROOT)["AITER_REF"]
    found = problems(facts, 1, ("pytest",))
    if facts["aiter"] not in (None, "unknown") and not facts["aiter"].startswith(pin[1:]):
        found.append(f"AITER {facts['aiter']} is not the pinned {pin}")
    if not (TREE / "vllm").is_dir():
        found.append("build/vllm (the patched tree) is missing: run `make apply` here")
    if args.model and not (Path(args.model) / "config.json").is_file():
        found.append(f"MODEL={args.model} is not a local model directory (e2e never downloads)")
    if args.model and not (args.upstream and args.patched):
        found.append("MODEL= needs UPSTREAM= and PATCHED= (docs/sweeps-and-e2e.md)")
    return found


def command(part: str, out: Path, args) -> tuple[list, dict]:
    """(argv, environment added) of one part."""
    pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
              "-o", "junit_family=xunit1", f"--junitxml={out / (part + '.xml')}"]
    if part == "rocm-tests":
        files = [p.relative_to(ROOT) for p in sorted((ROOT / "tests").rglob("test_*.py"))
                 if "mark.rocm" in p.read_text(encoding="utf-8")]
        return [*pytest, "-m", "rocm", *files], {"PYTHONPATH": str(TREE),
                                                 "VLLM_BUILD_TREE": str(TREE)}
    if part == "kernels":
        return [*pytest, "tests/kernels"], {"PYTHONPATH": "vllm_overlay:tests/without_vllm:."}
    if part == "compile":
        return [*pytest, "-m", "compile", "tests/compile/test_compile_tier.py"], {}
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return [sys.executable, "scripts/e2e.py", "all", "--model", args.model,
            "--upstream", args.upstream, "--patched", args.patched, "--out", out / "e2e",
            "--work", out / "e2e-work", *(f"--env={k}=1" for k in offline)], offline


def junit_tests(xml: Path) -> dict[str, tuple[str, str]]:
    """{node id: (passed | failed | skipped, message)} of a pytest part's JUnit XML."""
    tests = {}
    for case in ET.parse(xml).getroot().iter("testcase") if xml.is_file() else ():
        file = case.get("file")
        classes = case.get("classname").split(".")[file.count("/") + 1:]
        found = [e for e in case if e.tag in ("failure", "error", "skipped")]
        outcome = "passed" if not found else "skipped" if found[0].tag == "skipped" else "failed"
        message = (found[0].get("message") or "").partition("\n")[0][:200] if found else ""
        tests["::".join([file, *classes, case.get("name")])] = (outcome, message)
    return tests


def judge(check: str, ran: dict, out: Path) -> tuple[str, str]:
    """(passed | failed | not run, why) of one check; ``ran``: {part: exit status or reason}."""
    kind, _, arg = check.partition(":")
    part = arg if kind == "part" else kind
    if check.startswith("tests/"):  # tests/kernels and tests/compile have parts of their own
        folder = check.split("/")[1]
        part = folder if folder in ("kernels", "compile") else "rocm-tests"
    if not isinstance(ran.get(part), int):
        return "not run", f"{part}: {ran.get(part)}"
    if check.startswith("tests/"):
        found = [v for k, v in junit_tests(out / f"{part}.xml").items() if k.startswith(check)]
        failed = [message for outcome, message in found if outcome == "failed"]
        passed = sum(outcome == "passed" for outcome, _ in found)
        if failed:
            return "failed", f"{len(failed)} of {len(found)} failed: {failed[0]}"
        if passed:
            return "passed", f"{passed} passed"
        return "not run", found[0][1] if found else f"not in {part}'s results ({part}.log)"
    if kind == "part":
        if ran[part] == 5:  # pytest: no test collected
            return "not run", f"{part}: no test ran"
        if ran[part] != 0:
            return "failed", f"{part} exited {ran[part]} (its log: {part}.log)"
        return "passed", f"{part} passed"
    docs = sorted((out / "e2e").glob(f"*-{arg}.json"))  # e2e:<recipe>
    if not docs:
        return "failed", f"e2e exited {ran['e2e']} with no {arg} result (e2e.log)"
    failed = json.loads(docs[-1].read_text())["failed"]
    return ("failed", failed[0]) if failed else ("passed", f"{docs[-1].name}: nothing failed")


def report(ran: dict, facts: dict, out: Path) -> int:
    """Judge each claim of claims.toml, write REPORT.md, print each; return how many failed."""
    lines = ["# make validate-rocm", "",
             f"{facts['device']}; HIP {facts['hip']}; torch {facts['torch']}; "
             f"AITER {facts['aiter']}; commit {facts['commit']}; "
             f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", "",
             "Parts: " + "; ".join(f"{k} " + (f"exit {v} ({k}.log)" if isinstance(v, int)
                                              else f"not run: {v}") for k, v in ran.items()), "",
             "| verdict | where | claim | checks |", "|---|---|---|---|"]
    counts = {"held": 0, "failed": 0, "not run": 0}
    for doc, quotes in tomllib.loads(CLAIMS.read_text(encoding="utf-8")).items():
        for quote, checks in quotes.items():
            results = [(check, *judge(check, ran, out)) for check in checks]
            seen = {v for _, v, _ in results}
            verdict = "failed" if "failed" in seen else "not run" if "not run" in seen else "held"
            counts[verdict] += 1
            why = "; ".join(f"`{check}`: {v} ({reason})" for check, v, reason in results)
            lines.append(f"| {verdict} | {doc} | “{quote}” | {why} |")
            print(f"{verdict:>8}  {doc}: “{quote[:60]}”" + "".join(
                f"; {check}: {reason}" for check, v, reason in results if v != "passed"))
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
    print(f"[validate-rocm] {counts['held']} held, {counts['failed']} failed, "
          f"{counts['not run']} not run; {out / 'REPORT.md'}")
    return counts["failed"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="validate_rocm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="local model directory for e2e (never downloaded)")
    p.add_argument("--upstream", help="the upstream install's Python, for e2e")
    p.add_argument("--patched", help="the patched install's Python, for e2e")
    p.add_argument("--out", type=Path, help="default build/validate-rocm/<date>-<device>-<commit>")
    args = p.parse_args(argv)
    os.chdir(ROOT)  # the parts' paths are the checkout's
    facts = {**probe([sys.executable, "-c", PROBE], dict(os.environ)), "commit": commit()}
    if found := missing(facts, args):
        print("validate-rocm: cannot run here:\n" + "\n".join(f"  - {m}" for m in found) +
              "\nNothing was run. The ROCm image has all of it (`make image`, ci/Dockerfile.rocm).",
              file=sys.stderr)
        return 2
    device = "-".join(str(facts["device"]).lower().replace("/", " ").split())
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M}-{device}-{facts['commit'][:10]}"
    out = (args.out or ROOT / "build" / "validate-rocm" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    ran = {}
    for part in PARTS:
        if part == "e2e" and not args.model:
            ran[part] = "no MODEL= (with UPSTREAM= and PATCHED=) given"
            continue
        argv_, extra = command(part, out, args)
        print(f"[validate-rocm] {part}: {' '.join(map(str, argv_))}", flush=True)
        ran[part] = run_logged(argv_, {**os.environ, **extra}, out / f"{part}.log")
    failed = report(ran, facts, out)
    parts_failed = any(isinstance(rc, int) and rc not in (0, 5) for rc in ran.values())
    return 1 if failed or parts_failed else 0


if __name__ == "__main__":
    sys.exit(main())

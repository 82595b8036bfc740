#!/usr/bin/env python3
"""make validate-rocm: every ROCm claim of README.md and docs/, judged on this machine.

scripts/validate_rocm/claims.toml lists the claims: the words of the doc that makes each
and the checks behind it.  The checks need these parts, each a plain command run here with
its output in <out>/<part>.log:

  rocm-tests  pytest -m rocm over the test files with a rocm mark, on the patched tree: the
              real AITER MLA op vs the Triton kernel, real AITER vs the fakes
              (tests/validate_rocm/test_conformance.py)
  kernels     pytest tests/kernels, compiled for this GPU (make test-gpu)
  compile     pytest -m compile tests/compile/test_compile_tier.py with this machine's Triton
  bench       scripts/run_bench.py (make bench); each case against docs/roofline-amd.md's bound
  e2e         scripts/e2e.py <recipe> for each recipe, pristine vs patched, local MODEL, offline

pytest parts write JUnit XML (<out>/<part>.xml); a check `test:<node id prefix>` reads it.
Each claim is then held (every check passed), failed (one failed) or not run (one could not
run here, with the reason); printed, and written to <out>/REPORT.md and <out>/results.json.
Exit status: 0 nothing failed, 1 a check or part failed, 2 a part asked for cannot run here
(one line per missing thing; nothing was run).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import subprocess
import sys
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

CLAIMS = ROOT / "scripts" / "validate_rocm" / "claims.toml"
TREE = ROOT / "build" / "vllm"  # the patched tree (make apply)
PARTS = ("rocm-tests", "kernels", "compile", "bench", "e2e")
ROCM_ONLY = ("rocm-tests", "e2e")
RECIPES = ("throughput", "mixed", "serve", "gsm8k")
HOST_TIMED = ("host_cost", "eager_step")  # bench suites timed on the host: no roofline
IMAGE = "the ROCm image has it (`make image`, ci/Dockerfile.rocm)"


def _version(module: str) -> tuple[str | None, str | None]:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "unknown")), None
    except Exception as exc:  # noqa: BLE001 - what does not import is a fact
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def probe() -> dict:
    """torch (and whether it is ROCm's), the GPU and its arch, Triton, AITER, the commit."""
    env = {"device": None, "arch": None, "hip": None}
    env["torch"], env["torch_error"] = _version("torch")
    if env["torch"] is not None:
        import torch

        env["hip"] = torch.version.hip
        if torch.cuda.is_available() and torch.cuda.device_count():
            props = torch.cuda.get_device_properties(0)
            env["device"] = props.name
            env["arch"] = (props.gcnArchName.split(":")[0] if env["hip"]
                           else f"sm_{props.major}{props.minor}")
    env["triton"], env["triton_error"] = _version("triton")
    env["aiter"], env["aiter_error"] = _version("aiter")
    git = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                         text=True)
    env["commit"] = git.stdout.strip() or None
    return env


def pins() -> dict:
    lines = (ROOT / "pins.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))


def cannot_run(part: str, env: dict, args) -> str | None:
    """Why ``part`` cannot run on this machine (how to get what is missing), or None."""
    pin = pins()
    if env["torch"] is None:
        return f"torch does not import ({env['torch_error']}): {IMAGE}"
    if env["device"] is None:
        return (f"no GPU visible to torch {env['torch']}: run on an MI300X / MI355X (a "
                "container needs --device /dev/kfd --device /dev/dri --group-add video)")
    for module, needed in (("pytest", part != "e2e"), ("pytest_benchmark", part == "bench")):
        if needed and _version(module)[0] is None:
            return f"{module} does not import: pip install {module.replace('_', '-')}"
    if part in ROCM_ONLY or not args.allow_cuda:
        if not env["hip"]:
            return (f"torch {env['torch']} is not a ROCm build: {IMAGE} (on a CUDA GPU, "
                    "ALLOW_CUDA=1 runs kernels, compile and bench)")
        triton = ".".join(pin["TRITON_VERSION"].split(".")[:2])
        if not (env["triton"] or "").startswith(triton + "."):
            return f"Triton {env['triton']} is not the pinned {triton}.x: {IMAGE}"
    if part in ROCM_ONLY:
        if env["aiter"] is None:
            return f"AITER does not import ({env['aiter_error']}): {pin['AITER_REF']}; {IMAGE}"
        if env["aiter"] != "unknown" and not env["aiter"].startswith(pin["AITER_REF"][1:]):
            return f"AITER {env['aiter']} is not the pinned {pin['AITER_REF']}: {IMAGE}"
    if part == "rocm-tests" and not (TREE / "vllm").is_dir():
        return "build/vllm (the patched tree) is missing: run `make apply` here"
    if part == "e2e":
        if not args.model or not (Path(args.model) / "config.json").is_file():
            return (f"MODEL={args.model or ''} is not a local model directory (no config.json): "
                    "the e2e part never downloads")
        if not (args.upstream and args.patched):
            return ("UPSTREAM= and PATCHED= (the commands running each install's Python, "
                    "docs/sweeps-and-e2e.md) are needed")
    return None


def _pytest(out: Path, part: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
            f"--junitxml={out / (part + '.xml')}"]


def commands(part: str, out: Path, args) -> dict[str, tuple[list[str], dict]]:
    """{log name: (argv, environment added)} of one part."""
    gpu = {"PYTHONPATH": os.pathsep.join(["vllm_overlay", "tests/without_vllm", "."])}
    if part == "rocm-tests":
        files = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "tests").rglob("test_*.py"))
                 if "mark.rocm" in p.read_text(encoding="utf-8")]
        return {part: (_pytest(out, part, "-m", "rocm", *files),
                       {"PYTHONPATH": str(TREE), "VLLM_BUILD_TREE": str(TREE)})}
    if part == "kernels":
        return {part: (_pytest(out, part, "tests/kernels"), gpu)}
    if part == "compile":
        return {part: (_pytest(out, part, "-m", "compile", "tests/compile/test_compile_tier.py"),
                       {})}
    if part == "bench":
        return {part: ([sys.executable, "scripts/run_bench.py", "--out", str(out / "bench")], gpu)}
    offline = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return {f"e2e-{r}": ([sys.executable, "scripts/e2e.py", r, "--model", args.model,
                          "--upstream", args.upstream, "--patched", args.patched,
                          "--out", str(out / "e2e"), "--work", str(out / "e2e-work"),
                          *(f"--env={k}=1" for k in offline)], offline) for r in RECIPES}


def run(argv: list[str], env: dict, log: Path) -> int:
    with open(log, "w", encoding="utf-8") as sink:
        sink.write("$ " + " ".join(argv) + "\n")
        sink.flush()
        return subprocess.run(argv, cwd=ROOT, env={**os.environ, **env}, stdout=sink,
                              stderr=subprocess.STDOUT).returncode


# --- judging ------------------------------------------------------------------------------


def junit_tests(xml: Path) -> dict[str, tuple[str, str]]:
    """{"<classname>::<name>": (passed | failed | skipped, message)} of a pytest part."""
    tests = {}
    for case in ET.parse(xml).getroot().iter("testcase") if xml.is_file() else ():
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (found.get("message") or "").splitlines()[0][:200]
                break
        tests[f"{case.get('classname')}::{case.get('name')}"] = (outcome, message)
    return tests


def _matches(key: str, check: str) -> bool:
    """Whether JUnit's ``tests.mla.test_x.TestY::test_a[p]`` is under a node id prefix such as
    ``tests/mla/test_x.py::TestY``; a prefix with ``[`` matches parameter ids that start so."""
    path, _, rest = check.partition("::")
    prefix = ".".join([path.removesuffix(".py").replace("/", "."), *rest.split("::")]).strip(".")
    key = key.replace("::", ".")
    after = key[len(prefix):]
    return key.startswith(prefix) and (not after or after[0] in ".[" or "[" in prefix)


def bench_cases(out: Path) -> list[dict] | None:
    files = sorted((out / "bench").glob("*.json"))
    if not files:
        return None
    return [b["extra_info"] for b in json.loads(files[-1].read_text())["benchmarks"]
            if (b.get("extra_info") or {}).get("kernel")]


def fraction_of_bound(case: dict, arch: str | None) -> float | None:
    """docs/roofline-amd.md's bound on this AMD GPU / the measured time (None: no bound)."""
    from compile_tier.roofline import AMD, case_flops
    from compile_tier.targets import DEVICES

    device = next((name for name in AMD if DEVICES[name]["arch"] == arch), None)
    ours = ((case.get("results") or {}).get("ours") or {}).get("us")
    if device is None or not ours or not case.get("nbytes") or case["kernel"].startswith(HOST_TIMED):
        return None
    flops, _ = case_flops(case["kernel"], case.get("shapes", {}))
    bound = max(case["nbytes"] / DEVICES[device]["hbm_bytes_per_s"],
                flops / DEVICES[device]["bf16_dense_flops"])
    return bound * 1e6 / ours


def judge(check: str, ran: dict, out: Path, arch: str | None) -> tuple[str, str]:
    """(passed | failed | not run, why) of one check; ``ran``: {part or log name: rc or reason}."""
    kind, _, arg = check.partition(":")
    part = {"part": arg, "e2e": "e2e", "bench": "bench", "roofline": "bench"}.get(kind)
    if kind == "test":  # tests/kernels and tests/compile run in their parts, the rest in rocm-tests
        part = next((p for p in ("kernels", "compile") if arg.startswith(f"tests/{p}/")),
                    "rocm-tests")
    if not isinstance(ran.get(part), int):
        return "not run", f"{part}: {ran.get(part, 'not asked for')}"
    if kind == "test":
        found = [v for k, v in junit_tests(out / f"{part}.xml").items() if _matches(k, arg)]
        failed = [m for outcome, m in found if outcome == "failed"]
        passed = sum(outcome == "passed" for outcome, _ in found)
        if failed:
            return "failed", f"{len(failed)} of {len(found)} failed: {failed[0]}"
        if passed:
            return "passed", f"{passed} passed"
        return "not run", found[0][1] if found else f"not in {part}'s results ({part}.log)"
    if kind in ("part", "e2e"):
        name = f"e2e-{arg}" if kind == "e2e" else part
        if ran[name] == 5:  # pytest: no test collected
            return "not run", f"{name}: no test ran"
        return ("passed", f"{name} passed") if ran[name] == 0 else (
            "failed", f"{name} exited {ran[name]} (its log: {name}.log)")
    cases = bench_cases(out)
    if not cases:
        return "failed", "make bench wrote no results"
    kernel, _, floor = arg.partition(">=")
    if kind == "bench":
        low = [f"{c['case']} {c.get('speedup')}x" for c in cases if c["kernel"] == kernel
               and (c.get("speedup") or 0) < float(floor)]
        return ("failed", f"under {floor}x upstream: {', '.join(low)}") if low else (
            "passed", f"every {kernel} case >= {floor}x upstream")
    fractions = {f"{c['kernel']}/{c['case']}": fraction_of_bound(c, arch) for c in cases
                 if kernel in ("*", c["kernel"])}
    fractions = {k: v for k, v in fractions.items() if v is not None}
    if not fractions:
        return "not run", f"no case has an AMD bound on this GPU ({arch})"
    over = [f"{k} {v:.2f}" for k, v in fractions.items() if v > 1.0]
    return ("failed", f"faster than the bound: {', '.join(over)}") if over else (
        "passed", f"{len(fractions)} cases within the bound (best {max(fractions.values()):.0%})")


def verdicts(ran: dict, out: Path, arch: str | None) -> list[dict]:
    claims = tomllib.loads(CLAIMS.read_text(encoding="utf-8"))["claim"]
    for claim in claims:
        claim["results"] = [(c, *judge(c, ran, out, arch)) for c in claim["checks"]]
        seen = {verdict for _, verdict, _ in claim["results"]}
        claim["verdict"] = ("failed" if "failed" in seen else "not run" if "not run" in seen
                            else "held")
    return claims


def report(claims: list[dict], env: dict, ran: dict, out: Path) -> str:
    lines = ["# make validate-rocm", "",
             f"{env['device']} ({env['arch']}); HIP {env['hip']}; torch {env['torch']}; Triton "
             f"{env['triton']}; AITER {env['aiter']}; commit {env['commit']}; "
             f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC", "",
             "Parts: " + "; ".join(f"{k} " + (f"exit {v} ({k}.log)" if isinstance(v, int)
                                              else f"not run: {v}") for k, v in ran.items()), "",
             "| verdict | claim | where | checks |", "|---|---|---|---|"]
    for c in claims:
        checks = "; ".join(f"`{check}`: {v} ({why})" for check, v, why in c["results"])
        lines.append(f"| {c['verdict']} | {c['claim']} | {c['doc']}: “{c['quote']}” | {checks} |")
    (out / "REPORT.md").write_text("\n".join(lines) + "\n")
    (out / "results.json").write_text(json.dumps({"environment": env, "parts": ran,
                                                  "claims": claims}, indent=1) + "\n")
    return "\n".join(f"{c['verdict']:>8}  {c['id']}" + "".join(
        f"; {check}: {why}" for check, v, why in c["results"] if v != "passed") for c in claims)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="validate_rocm.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {PARTS}")
    p.add_argument("--allow-cuda", action="store_true",
                   help="on a CUDA GPU: the ROCm-only parts are not run (with the reason)")
    p.add_argument("--model", help="local model directory for e2e (never downloaded)")
    p.add_argument("--upstream", default=os.environ.get("E2E_UPSTREAM"))
    p.add_argument("--patched", default=os.environ.get("E2E_PATCHED"))
    p.add_argument("--out", type=Path, help="default build/validate-rocm/<date>-<device>-<commit>")
    args = p.parse_args(argv)
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if unknown := [x for x in parts if x not in PARTS]:
        p.error(f"unknown part(s) {', '.join(unknown)}; parts: {', '.join(PARTS)}")
    env = probe()
    ran, missing = {}, []
    for part in PARTS:
        why = part in parts and cannot_run(part, env, args)
        if not why:
            ran[part] = "not asked for (PARTS=)" if part not in parts else None
        elif args.allow_cuda and part in ROCM_ONLY and env["device"] and not env["hip"]:
            ran[part] = f"needs ROCm and AITER; not run under ALLOW_CUDA on {env['device']}"
        else:
            missing.append(f"{part}: {why}")
    if missing:
        print("validate-rocm: cannot run here:\n" + "\n".join(f"  - {m}" for m in missing) +
              "\nNothing was run. docs/rocm.md says what each part needs.", file=sys.stderr)
        return 2
    device = "-".join(str(env["device"]).lower().replace("/", " ").split())
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M}-{device}-{(env['commit'] or 'unknown')[:10]}"
    out = (args.out or ROOT / "build" / "validate-rocm" / stamp).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for part in [x for x in PARTS if ran[x] is None]:
        for name, (argv_, extra) in commands(part, out, args).items():
            print(f"[validate-rocm] {name}: {' '.join(argv_)}", flush=True)
            ran[name] = run(argv_, extra, out / f"{name}.log")
            print(f"[validate-rocm] {name}: exit {ran[name]} ({out / name}.log)", flush=True)
        if part == "e2e":
            ran[part] = max(ran[f"e2e-{r}"] for r in RECIPES)
    claims = verdicts(ran, out, env["arch"])
    print(report(claims, env, ran, out))
    counts = {v: sum(c["verdict"] == v for c in claims) for v in ("held", "failed", "not run")}
    print(f"[validate-rocm] {counts['held']} held, {counts['failed']} failed, "
          f"{counts['not run']} not run; {out / 'REPORT.md'}")
    failed = counts["failed"] or any(isinstance(rc, int) and rc not in (0, 5) for rc in ran.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

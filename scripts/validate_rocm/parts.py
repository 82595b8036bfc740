"""The parts of a validate-rocm run: the command each runs and how its output is read.

Every part is a ``Part``: ``command(ctx)`` (argv), ``env(ctx)`` (what it adds
to the environment) and ``collect(ctx, rc)`` (its outputs under ``ctx.out``
read into a dict with a ``status``: passed / failed / not run).  The
commands are the repository's own verbs, as the Makefile runs them:

==============  ==============================================================
``rocm-tests``  ``pytest -m rocm`` over the test files with a ``rocm`` mark, with
                the patched tree (``make test``'s environment): the real AITER
                MLA op vs the Triton kernel
``conformance`` every test file that goes through tests/fakes/, with ``-p
                conformance`` (tests/fakes/conformance.py): each fake call
                also runs real AITER; disagreements in conformance.json
``kernels``     ``tests/kernels`` compiled for the device's own target
                (``make test-gpu``'s environment)
``facts``       validate_rocm.device_facts: the compile tier's facts of the
                device's target compiled and loaded here, beside
                benchmarks/results/compile/<target>.json
``bench``       ``scripts/run_bench.py`` (``make bench``) into the run's folder,
                each case beside the roofline and upstream (bench_roofline)
``e2e``         ``scripts/e2e.py all`` (``make e2e``): pristine vs patched on
                the local MODEL, offline
==============  ==============================================================
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from . import bench_roofline, device_facts, junit

__all__ = ["ORDER", "PARTS", "Context", "Part", "facts_target", "fake_test_files",
           "rocm_test_files"]

# A test module goes through the fakes if it imports one of these (tests/fakes).
FAKE_MODULES = ("fake_aiter", "aiter_export", "aiter_fa", "aiter_mla")
_IMPORTS_FAKE = re.compile(rf"^\s*(?:import|from)\s+(?:{'|'.join(FAKE_MODULES)})\b", re.M)


@dataclass
class Context:
    root: Path
    out: Path
    python: str
    env: dict  # environment.probe's facts
    opts: object  # prereqs.Options
    base_env: dict = field(default_factory=lambda: dict(os.environ))


@dataclass(frozen=True)
class Part:
    name: str
    title: str
    command: Callable[[Context], list[str]]
    env: Callable[[Context], dict]
    collect: Callable[[Context, int], dict]


def _path(*entries) -> str:
    return os.pathsep.join(str(e) for e in entries if e)


def fake_test_files(root: Path) -> list[str]:
    """tests/**/test_*.py that import a fake (not the fakes' own folder, not this kit's tests)."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root)
        if rel.parts[1] in ("fakes", "validate_rocm"):
            continue
        if _IMPORTS_FAKE.search(path.read_text(encoding="utf-8", errors="replace")):
            found.append(str(rel))
    return found


def rocm_test_files(root: Path) -> list[str]:
    """tests/**/test_*.py with a ``rocm`` mark: collecting only these, an unrelated
    module that does not import on this machine cannot fail the part."""
    return [str(p.relative_to(root)) for p in sorted((root / "tests").rglob("test_*.py"))
            if p.relative_to(root).parts[1] != "validate_rocm"
            and "mark.rocm" in p.read_text(encoding="utf-8", errors="replace")]


def facts_target(arch: str | None) -> str | None:
    """The compile tier's target for the device's arch (None: no such target)."""
    from compile_tier.targets import TARGETS

    return arch if arch in TARGETS else None


# --- pytest parts -----------------------------------------------------------------------


def _pytest(ctx: Context, name: str, *args: str) -> list[str]:
    return [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args,
            f"--junitxml={ctx.out / f'{name}.xml'}"]


def _tree_env(ctx: Context, *extra) -> dict:
    tree = ctx.root / "build" / "vllm"
    return {"PYTHONPATH": _path(tree, *extra, ctx.base_env.get("PYTHONPATH")),
            "VLLM_BUILD_TREE": str(tree)}


def _gpu_env(ctx: Context) -> dict:  # make test-gpu / make bench
    return {"PYTHONPATH": _path(ctx.root / "vllm_overlay", ctx.root / "tests" / "without_vllm",
                                ctx.root, ctx.base_env.get("PYTHONPATH"))}


def _collect_pytest(name: str):
    def collect(ctx: Context, rc: int) -> dict:
        tests = junit.read(ctx.out / f"{name}.xml", ctx.root)
        counts = junit.summary(tests)
        ran = counts.get("passed", 0) + counts.get("failed", 0) + counts.get("error", 0)
        if counts.get("failed") or counts.get("error") or rc not in (0, 5):
            status = "failed"
        elif ran:
            status = "passed"
        else:
            status = "not run"
        return {"status": status, "rc": rc, "counts": counts, "tests": tests}

    return collect


def _collect_conformance(ctx: Context, rc: int) -> dict:
    result = _collect_pytest("conformance-tests")(ctx, rc)
    path = ctx.out / "conformance.json"
    report = json.loads(path.read_text()) if path.is_file() else None
    result["conformance"] = report
    if report is None:
        result["status"] = "failed" if rc not in (0, 5) else "not run"
    elif report["disagreeing"]:
        result["status"] = "failed"
    elif not sum(e["compared"] for e in report["fakes"].values()):
        result["status"] = "not run"
    return result


# --- facts, bench, e2e -----------------------------------------------------------------


def _facts_command(ctx: Context) -> list[str]:
    return [ctx.python, "-m", "validate_rocm.device_facts", "--target",
            str(facts_target(ctx.env.get("arch"))), "--out", str(ctx.out / "device-facts.json")]


def _facts_env(ctx: Context) -> dict:
    # As compile_tier.run: a scratch Triton cache and every kernel compiled (ptxas -v runs).
    return {"PYTHONPATH": _path(ctx.root / "vllm_overlay", ctx.root / "tests" / "without_vllm",
                                ctx.root / "scripts", ctx.base_env.get("PYTHONPATH")),
            "TRITON_INTERPRET": None,
            "TRITON_CACHE_DIR": str(ctx.out / "triton-cache"), "TRITON_ALWAYS_COMPILE": "1"}


def _collect_facts(ctx: Context, rc: int) -> dict:
    path = ctx.out / "device-facts.json"
    if not path.is_file():
        return {"status": "failed" if rc else "not run", "rc": rc}
    device = json.loads(path.read_text())
    committed_file = ctx.root / "benchmarks" / "results" / "compile" / f"{device['target']}.json"
    committed = json.loads(committed_file.read_text()) if committed_file.is_file() else None
    cmp = device_facts.compare(device, committed)
    amd = str(device["target"]).startswith("gfx")
    bad = cmp["errors"] or (amd and cmp["spills"])
    return {"status": "failed" if bad or rc else "passed", "rc": rc,
            "committed": str(committed_file.relative_to(ctx.root)) if committed else None, **cmp}


def _bench_command(ctx: Context) -> list[str]:
    return [ctx.python, str(ctx.root / "scripts" / "run_bench.py"), "--out", str(ctx.out / "bench")]


def _collect_bench(ctx: Context, rc: int) -> dict:
    path = bench_roofline.newest(ctx.out / "bench")
    if path is None:
        return {"status": "failed" if rc else "not run", "rc": rc}
    rows = bench_roofline.cases(path, ctx.env.get("arch"))
    return {"status": "failed" if rc else "passed", "rc": rc,
            "file": str(path.relative_to(ctx.out)), "cases": rows}


def _e2e_command(ctx: Context) -> list[str]:
    o = ctx.opts
    return [ctx.python, str(ctx.root / "scripts" / "e2e.py"), "all", "--model", str(o.model),
            "--upstream", str(o.upstream), "--patched", str(o.patched),
            "--out", str(ctx.out / "e2e"), "--work", str(ctx.out / "e2e-work"),
            "--env", "HF_HUB_OFFLINE=1", "--env", "TRANSFORMERS_OFFLINE=1"]


def _e2e_env(ctx: Context) -> dict:
    return {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _collect_e2e(ctx: Context, rc: int) -> dict:
    recipes = {}
    for path in sorted((ctx.out / "e2e").glob("*.json")):
        doc = json.loads(path.read_text())
        gate = doc.get("gate") or {}
        recipes[doc["recipe"]] = {
            "file": str(path.relative_to(ctx.out)), "failed": doc.get("failed") or [],
            "gate": gate.get("passed"), "comparison": doc.get("comparison") or [],
        }
    if not recipes:
        return {"status": "failed" if rc else "not run", "rc": rc, "recipes": {}}
    bad = rc or any(r["failed"] or r["gate"] is False for r in recipes.values())
    return {"status": "failed" if bad else "passed", "rc": rc, "recipes": recipes}


PARTS = {p.name: p for p in (
    Part("rocm-tests", "`rocm`-marked tests (real AITER)",
         lambda c: _pytest(c, "rocm-tests", "-m", "rocm", *rocm_test_files(c.root)),
         lambda c: _tree_env(c), _collect_pytest("rocm-tests")),
    Part("conformance", "fake conformance (each fake call also on real AITER)",
         lambda c: _pytest(c, "conformance-tests", "-p", "conformance",
                           *fake_test_files(c.root)),
         lambda c: {**_tree_env(c, c.root / "tests" / "fakes"),
                    "AITER_CONFORMANCE": str(c.out / "conformance.json")},
         _collect_conformance),
    Part("kernels", "tests/kernels on the device's own target",
         lambda c: _pytest(c, "kernels", "tests/kernels"), _gpu_env, _collect_pytest("kernels")),
    Part("facts", "compile-tier facts of the device's target vs what the device reports",
         _facts_command, _facts_env, _collect_facts),
    Part("bench", "make bench beside the roofline and upstream", _bench_command, _gpu_env,
         _collect_bench),
    Part("e2e", "e2e recipes, pristine vs patched, local model", _e2e_command, _e2e_env,
         _collect_e2e),
)}
ORDER = tuple(PARTS)

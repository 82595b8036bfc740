"""make pr-stack (CI): the exported PRs as a maintainer would apply them: each alone and
all stacked (= build/vllm's main plus the PRs' tests) on pristine upstream with ``git am``,
in scratch worktrees; with ``python``, the PRs' tests run in the stacked tree (CPU).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from . import SeriesError, buildtree, export, gitrepo, patchfile, progress, topics
from .pins import load_pins


def _am(tree: Path, patches: list[Path], what: str) -> None:
    proc = gitrepo.git(tree, "am", "-q", "--no-3way", *map(str, patches), check=False, env=export.EXPORT_ENV)
    if proc.returncode:
        gitrepo.git(tree, "am", "--abort", check=False)
        raise SeriesError(f"{what}: git am failed:\n" + export.shown(proc.stderr + proc.stdout))


def check_stack(layout: buildtree.Layout, dist_root: Path, python: str | None = None) -> list[str]:
    pins = load_pins(layout.root)
    build = layout.build
    root = export.pristine_root(layout, pins)
    export.check_identity(build)
    files = buildtree.overlay_files(layout)
    series = buildtree.series_patches(layout)
    # A topic with neither patches nor files has no PR (make pr refuses it).
    names = [t for t in patchfile.TOPICS if any(p.topic == t for p in series)
             or topics.overlay_files_of(layout.patches, files, t)]
    dists = {t: sorted((dist_root / t).glob("*.patch")) for t in names}
    missing = [t for t in names if not dists[t]]
    if missing:
        raise SeriesError(f"no {dist_root}/<topic>/*.patch for {', '.join(missing)}: run "
                          f"`make pr TOPIC=...` for each topic first")
    report = []
    for topic in names:
        deps = [dists[u][0] for u, _ in export.export_plan(layout, topic, files).depends]
        with progress.stage("pr-stack", f"{topic} alone on pristine vLLM {pins['VLLM_VERSION']}"):
            with export.scratch_worktree(build, f"pr-stack-{topic}", root) as tree:
                _am(tree, [*deps, *dists[topic]], f"PR {topic} alone")
        after = f" after {', '.join(d.parent.name + '/' + d.name for d in deps)}" if deps else ""
        report.append(f"pr-stack: {topic}: {len(dists[topic])} patch(es) apply on pristine "
                      f"vLLM {pins['VLLM_VERSION']}{after}")
    tests = [t.dest for t in topics.read_pr_tests(layout.patches)[0]]
    with progress.stage("pr-stack", "all topics stacked in series order"):
        with export.scratch_worktree(build, "pr-stack-all", root) as tree:
            for topic in names:
                _am(tree, dists[topic], f"PR {topic} on top of the earlier PRs")
            differ = gitrepo.out(tree, "diff", "--name-status", "--no-renames", "main", "HEAD").splitlines()
            extra = [ln for ln in differ if ln.split("\t")[-1] not in tests or not ln.startswith("A")]
            if extra:
                raise SeriesError("the stacked PRs are not the series (build/vllm main; `make apply` "
                                  "rebuilds it):\n" + export.shown("\n".join(extra)))
            report.append(f"pr-stack: {', '.join(names)} stacked = the series + {len(tests)} PR test file(s)")
            if python and tests:
                report.append(run_tests(tree, python, tests))
    return report


def run_tests(tree: Path, python: str, tests: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "PYTHONPATH"}
    env.update(export.CPU_KERNEL_ENV, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1", PYTHONDONTWRITEBYTECODE="1")
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree), *tests]
    with progress.stage("pr-stack", f"the PRs' tests in vLLM's layout: {' '.join(tests)}"):
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SeriesError(f"the PRs' tests fail in the stacked tree (cd {tree} && {export.CPU_KERNEL_PREFIX} "
                          f"{' '.join(cmd)}):\n" + export.shown(proc.stdout[-6000:] + proc.stderr[-3000:]))
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    return f"pr-stack: the PRs' tests in vLLM's layout (CPU): {tail}"

"""make pr-stack (CI): the exported PRs as a maintainer would apply them.

After ``make pr TOPIC=...`` for every topic, on pristine upstream (the root
commit of build/vllm), in scratch worktrees next to it:

* each topic alone: ``git am`` of ``dist/<topic>/*.patch``, after the shared
  commits of the PRs it depends on (the first patch of ``dist/<dep>/``, which
  adds the files both ship; the PR body says so);
* all topics stacked in series order: ``git am`` of every ``dist/<topic>/``
  in turn; the result must be build/vllm's ``main`` (the whole series) plus
  the tests the PRs carry (patches/pr-tests), and nothing else;
* with ``python``: the PRs' tests run in the stacked tree, in vLLM's layout and
  with vLLM's own conftest, on the CPU (``VLLM_TARGET_DEVICE=cpu``,
  ``TRITON_INTERPRET=1``).

Nothing in build/vllm's checkout, branches or index changes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from . import SeriesError, buildtree, export, gitrepo, patchfile, progress, topics
from .pins import load_pins


def _dist_patches(dist_root: Path, topic: str) -> list[Path]:
    found = sorted((dist_root / topic).glob("*.patch"))
    if not found:
        raise SeriesError(f"no {dist_root / topic}/*.patch: run `make pr TOPIC={topic}` first")
    return found


def _am(tree: Path, patches: list[Path], ident: dict[str, str], what: str) -> None:
    proc = gitrepo.git(tree, "am", "-q", "--no-3way", *map(str, patches), check=False, env=ident)
    if proc.returncode:
        gitrepo.git(tree, "am", "--abort", check=False)
        raise SeriesError(f"{what}: git am failed:\n" + export._shown(proc.stderr + proc.stdout))


def check_stack(layout: buildtree.Layout, dist_root: Path, python: str | None = None) -> list[str]:
    pins = load_pins(layout.root)
    build = layout.build
    root = export.pristine_root(layout, pins)
    ident = export.git_identity(build)
    files = buildtree.overlay_files(layout)
    series = buildtree.series_patches(layout)
    plans = {t: export.export_plan(layout, t, files) for t in patchfile.TOPICS}
    # A topic with neither patches nor files has no PR (make pr refuses it).
    names = [t for t in patchfile.TOPICS if any(p.topic == t for p in series)
             or topics.overlay_files_of(layout.patches, files, t)]
    dists = {t: _dist_patches(dist_root, t) for t in names}
    report = []
    for topic in names:
        deps = [dists[u][0] for u, _ in plans[topic].depends]
        with progress.stage("pr-stack", f"{topic} alone on pristine vLLM {pins['VLLM_VERSION']}"):
            with export.scratch_worktree(build, f"pr-stack-{topic}", root) as tree:
                _am(tree, [*deps, *dists[topic]], ident, f"PR {topic} alone")
        after = f" after {', '.join(d.parent.name + '/' + d.name for d in deps)}" if deps else ""
        report.append(f"pr-stack: {topic}: {len(dists[topic])} patch(es) apply on pristine "
                      f"vLLM {pins['VLLM_VERSION']}{after}")

    tests = [t.dest for t in topics.read_pr_tests(layout.patches)[0]]
    with progress.stage("pr-stack", "all topics stacked in series order"):
        with export.scratch_worktree(build, "pr-stack-all", root) as tree:
            for topic in names:
                _am(tree, dists[topic], ident, f"PR {topic} on top of the earlier PRs")
            differ = gitrepo.out(tree, "diff", "--name-status", "--no-renames", "main", "HEAD").splitlines()
            extra = [ln for ln in differ if ln.split("\t")[-1] not in tests or not ln.startswith("A")]
            if extra:
                raise SeriesError("the stacked PRs are not the series (build/vllm main; `make apply` "
                                  "rebuilds it):\n" + export._shown("\n".join(extra)))
            report.append(f"pr-stack: {', '.join(names)} stacked = the series + "
                          f"{len(tests)} PR test file(s)")
            if python and tests:
                report.append(run_tests(tree, python, tests))
    return report


def run_tests(tree: Path, python: str, tests: list[str]) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_") and k != "PYTHONPATH"}
    env.update(export.CPU_KERNEL_ENV, PYTHONPATH=str(tree), HF_HUB_OFFLINE="1",
               PYTHONDONTWRITEBYTECODE="1")
    cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tree), *tests]
    with progress.stage("pr-stack", f"the PRs' tests in vLLM's layout: {' '.join(tests)}"):
        proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    if proc.returncode:
        raise SeriesError(f"the PRs' tests fail in the stacked tree (cd {tree} && "
                          f"{export.CPU_KERNEL_PREFIX} {' '.join(cmd)}):\n" + export._shown(proc.stdout[-6000:]
                                                                                  + proc.stderr[-3000:]))
    return f"pr-stack: the PRs' tests in vLLM's layout (CPU): {tail}"

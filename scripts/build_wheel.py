#!/usr/bin/env python3
"""make build: a wheel of the patched tree (build/vllm) into dist/.

``--device rocm`` (auto: /opt/rocm exists or the python's torch has torch.version.hip):
vLLM's own setup.py compiles its HIP/C++ extensions with that python.  ``empty``
(anywhere else): a Python-only wheel, built with the sdist's tools venv and a stand-in
torch (no real torch needed), without the optional Rust frontend.  Built from a ``git
archive`` of build/vllm's HEAD in a scratch folder (setup.py writes files that must not
land in build/vllm).  Version: ``<VLLM_VERSION>+aiter.series.g<series commit>[.dirty]``
(``t<build-tree commit>`` where the series has no git history, e.g. a Docker context).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from seriestool import SeriesError, gitrepo, sdist  # noqa: E402
from seriestool.pins import load_pins  # noqa: E402

ROCM_HOME = Path("/opt/rocm")


def torch_hip(python: str) -> str | None:
    """torch.version.hip of the given interpreter, or None (no torch, or not ROCm)."""
    proc = subprocess.run([python, "-c", "import torch; print(torch.version.hip or '')"],
                          capture_output=True, text=True)
    if proc.returncode:
        return None
    return proc.stdout.strip() or None


def detect_device(python: str) -> str:
    return "rocm" if ROCM_HOME.exists() or torch_hip(python) else "empty"


def series_label(root: Path, tree: Path) -> str:
    commit = gitrepo.git(root, "rev-parse", "--short=9", "HEAD", check=False)
    if commit.returncode == 0 and (root / ".git").exists():
        dirty = gitrepo.series_inputs_dirty(root)
        return f"aiter.series.g{commit.stdout.strip()}" + (".dirty" if dirty else "")
    return f"aiter.series.t{gitrepo.out(tree, 'rev-parse', '--short=9', 'HEAD')}"


def _standin_torch(where: Path) -> Path:
    for rel, text in sdist._STANDIN_TORCH.items():
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(text)
    return where


def build(tree: Path, dist: Path, device: str) -> Path:
    pins = load_pins(REPO)
    if not gitrepo.is_repo(tree):
        raise SeriesError(f"{tree} does not exist: run `make apply` first")
    changes = gitrepo.dirty(tree)
    if changes:
        print(f"note: {tree} has {len(changes)} uncommitted change(s); the wheel is built from its HEAD "
              "(the series), without them", file=sys.stderr)
    python = sys.executable
    if device == "auto":
        device = detect_device(python)
    version = f"{pins['VLLM_VERSION']}+{series_label(REPO, tree)}"
    env = dict(os.environ, VLLM_TARGET_DEVICE=device, SETUPTOOLS_SCM_PRETEND_VERSION=version)
    for key in ("VLLM_USE_PRECOMPILED", "VLLM_VERSION_OVERRIDE", "VLLM_SKIP_VERSION_SUFFIX"):
        env.pop(key, None)

    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        scratch = Path(tmp)
        if device == "rocm":
            hip = torch_hip(python)
            if not hip:
                raise SeriesError(f"a ROCm build needs ROCm torch, but {python} has none "
                                  f"(torch.version.hip is unset); use that machine's ROCm python "
                                  f"(PYTHON=...), or DEVICE=empty for a Python-only wheel")
            print(f"building a ROCm wheel (HIP {hip}) with {python}; this compiles vLLM's extensions",
                  flush=True)
        else:
            python = str(sdist._tools_python(sdist.cache_dir()))
            env["PYTHONPATH"] = str(_standin_torch(scratch / "standin"))
            env["CARGO"] = shutil.which("false") or "/bin/false"  # the optional Rust frontend is skipped
            print("building a Python-only wheel (VLLM_TARGET_DEVICE=empty)", flush=True)
        source = scratch / "vllm"
        gitrepo.git(tree, "archive", "-o", str(scratch / "tree.tar"), "HEAD")
        with tarfile.open(scratch / "tree.tar") as archive:
            archive.extractall(source, filter="data")
        out = scratch / "out"
        proc = subprocess.run([python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
                               "--no-cache-dir", "-w", str(out), str(source)],
                              capture_output=True, text=True, env=env)
        if proc.returncode:
            tail = "\n".join(("  " + ln) for ln in (proc.stdout + proc.stderr).splitlines()[-40:])
            raise SeriesError(f"pip wheel failed for {source} (VLLM_TARGET_DEVICE={device}):\n{tail}")
        wheels = sorted(out.glob("vllm-*.whl"))
        if len(wheels) != 1:
            raise SeriesError(f"expected one vllm wheel in {out}, found {[w.name for w in wheels]}")
        wheel = wheels[0]
        expected = re.escape(version.replace("-", "_"))
        if not re.match(rf"vllm-{expected}(\.[a-z0-9]+)?-", wheel.name):
            raise SeriesError(f"{wheel.name}: version is not {version}[.<device>]")
        dist.mkdir(parents=True, exist_ok=True)
        for old in dist.glob("vllm-*.whl"):  # our own earlier outputs
            old.unlink()
        target = dist / wheel.name
        shutil.move(str(wheel), target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=REPO / "build" / "vllm")
    parser.add_argument("--dist", type=Path, default=REPO / "dist")
    parser.add_argument("--device", choices=("auto", "rocm", "empty"), default="auto")
    args = parser.parse_args(argv)
    start = time.monotonic()
    try:
        wheel = build(args.tree.resolve(), args.dist.resolve(), args.device)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{wheel} ({wheel.stat().st_size / 1e6:.1f} MB, {time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

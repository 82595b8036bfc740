#!/usr/bin/env python3
"""make build: a wheel of build/vllm's HEAD (from a ``git archive`` copy) into dist/.

``--device rocm`` (auto: /opt/rocm exists or this python's torch has torch.version.hip):
vLLM's setup.py compiles its HIP/C++ extensions.  ``empty``: a Python-only wheel, built with
the sdist's tools venv and a stand-in torch, without the optional Rust frontend.  Version:
``<VLLM_VERSION>+aiter.series.g<series commit>[.dirty]`` (``t<build-tree commit>`` where the
series has no git history, e.g. a Docker context)."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from seriestool import SeriesError, gitrepo, sdist
from seriestool.pins import load_pins

REPO = Path(__file__).resolve().parents[1]


def torch_hip(python: str) -> str:
    """torch.version.hip of the given interpreter ('' without torch or off ROCm)."""
    proc = subprocess.run([python, "-c", "import torch; print(torch.version.hip or '')"],
                          capture_output=True, text=True)
    return proc.stdout.strip() if proc.returncode == 0 else ""


def series_label(root: Path, tree: Path) -> str:
    if (root / ".git").exists():
        commit = gitrepo.out(root, "rev-parse", "--short=9", "HEAD")
        return f"aiter.series.g{commit}" + (".dirty" if gitrepo.series_inputs_dirty(root) else "")
    return f"aiter.series.t{gitrepo.out(tree, 'rev-parse', '--short=9', 'HEAD')}"


def build(tree: Path, dist: Path, device: str) -> Path:
    if not gitrepo.is_repo(tree):
        raise SeriesError(f"{tree} does not exist: run `make apply` first")
    changes = gitrepo.dirty(tree)
    if changes:
        print(f"note: {tree} has {len(changes)} uncommitted change(s); the wheel is built from its HEAD "
              "(the series), without them", file=sys.stderr)
    python = sys.executable
    hip = torch_hip(python) if device != "empty" else ""
    if device == "auto":
        device = "rocm" if Path("/opt/rocm").exists() or hip else "empty"
    version = f"{load_pins(REPO)['VLLM_VERSION']}+{series_label(REPO, tree)}"
    env = dict(os.environ, VLLM_TARGET_DEVICE=device, SETUPTOOLS_SCM_PRETEND_VERSION=version)
    for key in ("VLLM_USE_PRECOMPILED", "VLLM_VERSION_OVERRIDE", "VLLM_SKIP_VERSION_SUFFIX"):
        env.pop(key, None)

    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        scratch = Path(tmp)
        if device == "rocm":
            if not hip:
                raise SeriesError(f"a ROCm build needs ROCm torch, but {python} has none "
                                  f"(torch.version.hip is unset); use that machine's ROCm python "
                                  f"(PYTHON=...), or DEVICE=empty for a Python-only wheel")
            print(f"building a ROCm wheel (HIP {hip}) with {python}; this compiles vLLM's extensions",
                  flush=True)
        else:
            python = str(sdist._tools_python(sdist.cache_dir()))
            for rel, text in sdist._STANDIN_TORCH.items():
                (scratch / "standin" / rel).parent.mkdir(parents=True, exist_ok=True)
                (scratch / "standin" / rel).write_text(text)
            env["PYTHONPATH"] = str(scratch / "standin")
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
        wheels = sorted(out.glob("vllm-*.whl"))
        if proc.returncode or len(wheels) != 1:
            tail = "\n".join(("  " + ln) for ln in (proc.stdout + proc.stderr).splitlines()[-40:])
            raise SeriesError(f"pip wheel failed for {source} (VLLM_TARGET_DEVICE={device}):\n{tail}")
        dist.mkdir(parents=True, exist_ok=True)
        for old in dist.glob("vllm-*.whl"):  # our own earlier outputs
            old.unlink()
        return Path(shutil.move(str(wheels[0]), dist / wheels[0].name))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=REPO / "build" / "vllm")
    parser.add_argument("--dist", type=Path, default=REPO / "dist")
    parser.add_argument("--device", choices=("auto", "rocm", "empty"), default="auto")
    args = parser.parse_args()
    try:
        wheel = build(args.tree.resolve(), args.dist.resolve(), args.device)
    except SeriesError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{wheel} ({wheel.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

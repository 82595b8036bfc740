#!/usr/bin/env python3
"""make venv: one virtual environment for the CPU test tier, reused when up to date.

Installs, in one pip resolution (so nothing can pull a CUDA torch):
  * torch==TORCH_CPU_VERSION, triton==TRITON_VERSION, numba==NUMBA_VERSION (pins.env),
  * ci/requirements-test.txt,
  * the pinned tree's requirements/common.txt, so the patched vLLM imports from
    PYTHONPATH (BRIEF §2).
A stamp file holds the digest of those inputs; when it matches, nothing runs.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from seriestool import progress  # noqa: E402
from seriestool.pins import load_pins  # noqa: E402

STAMP = ".series-venv-stamp"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv")
    parser.add_argument("--tree", type=Path, default=ROOT / "build" / "vllm")
    args = parser.parse_args()
    pins = load_pins(ROOT)
    pinned = [f"torch=={pins['TORCH_CPU_VERSION']}", f"triton=={pins['TRITON_VERSION']}",
              f"numba=={pins['NUMBA_VERSION']}"]
    files = [ROOT / "ci" / "requirements-test.txt", args.tree / "requirements" / "common.txt"]
    if not files[1].is_file():
        print(f"error: {files[1]} not found: run `make apply` first", file=sys.stderr)
        return 2
    digest = hashlib.sha256("\n".join(pinned).encode() + sys.version.encode())
    for path in files:
        digest.update(path.read_bytes())
    stamp = args.venv / STAMP
    if stamp.exists() and stamp.read_text().strip() == digest.hexdigest():
        print(f"{args.venv} is up to date")
        return 0
    python = args.venv / "bin" / "python"
    if not python.exists():
        with progress.stage("venv", f"creating {args.venv}"):
            venv.create(args.venv, with_pip=True)
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pinned]
    for path in files:
        cmd += ["-r", str(path)]
    with progress.stage("venv", f"pip install of CPU torch, triton and vLLM's requirements into {args.venv} "
                                f"(first time: about 2.8 GB, a few minutes)"):
        status = subprocess.run(cmd).returncode
    if status != 0:
        print(f"error: pip install failed (see above); {args.venv} left as it is", file=sys.stderr)
        return 2
    stamp.write_text(digest.hexdigest() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

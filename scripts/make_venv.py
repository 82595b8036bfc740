#!/usr/bin/env python3
"""make venv: one virtual environment for the CPU test tier, reused when up to date.

One pip resolution (so nothing can pull a CUDA torch) of torch, triton and numba at their
pins.env versions, ci/requirements-test.txt and the pinned tree's requirements/common.txt
(so the patched vLLM imports from PYTHONPATH).  A stamp file in the venv holds the digest
of those inputs; when it matches, nothing runs.
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

from seriestool.pins import load_pins  # noqa: E402


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
    stamp = args.venv / ".series-venv-stamp"
    if stamp.exists() and stamp.read_text().strip() == digest.hexdigest():
        print(f"{args.venv} is up to date")
        return 0
    python = args.venv / "bin" / "python"
    if not python.exists():
        venv.create(args.venv, with_pip=True)
    cmd = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *pinned]
    for path in files:
        cmd += ["-r", str(path)]
    print(f"venv: pip install of CPU torch, triton and vLLM's requirements into {args.venv} "
          "(first time: about 2.8 GB, a few minutes) ...", file=sys.stderr, flush=True)
    if subprocess.run(cmd).returncode != 0:
        print(f"error: pip install failed (see above); {args.venv} left as it is", file=sys.stderr)
        return 2
    stamp.write_text(digest.hexdigest() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""make test-triton-next: CI's second leg, on the next Triton release (pins.env TRITON_NEXT_VERSION).

Runs the compile tier (tests/compile) and KernelCall's tests with that release first on
PYTHONPATH and writes the log and a summary to ``build/triton-next/``.  It reports and
never fails the build (exit 0 whatever the tests say; 2 when the release cannot be
installed): a Triton bump shows up as a report to read.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
from seriestool.pins import load_pins  # noqa: E402
from triton_releases import install  # noqa: E402

TESTS = ("tests/compile", "tests/kernels/test_triton_launch.py")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=REPO / "build" / "vllm")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "triton-next")
    parser.add_argument("--version", help="default: pins.env TRITON_NEXT_VERSION")
    parser.add_argument("tests", nargs="*", default=list(TESTS))
    args = parser.parse_args()
    version = args.version or load_pins(REPO)["TRITON_NEXT_VERSION"]
    try:
        folder = install(version)
    except subprocess.CalledProcessError as exc:
        print(f"test-triton-next: triton=={version} could not be installed ({exc})")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "pytest.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(folder), str(args.tree)]),
               VLLM_BUILD_TREE=str(args.tree.resolve()))
    print(f"test-triton-next: {', '.join(args.tests)} on Triton {version} ({folder}) ...", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               *args.tests], cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    tail = log.read_text().strip().splitlines()
    counts = next((line for line in reversed(tail) if re.search(r"\d+ (passed|failed|error)", line)),
                  tail[-1] if tail else "no output")
    failed = [line for line in tail if line.startswith(("FAILED", "ERROR"))]
    verdict = "OK" if proc.returncode == 0 else f"FAILURES (pytest exit {proc.returncode})"
    summary = f"Triton {version} leg: {verdict}: {counts.strip('= ')}"
    (args.out / "SUMMARY.txt").write_text("\n".join([summary, *failed, f"log: {log}"]) + "\n")
    print(summary)
    for line in failed:
        print(f"  {line}")
    print(f"  log: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

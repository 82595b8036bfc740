"""The ROCm image recipe (ci/Dockerfile.rocm, ci/image/*.sh) without a Docker engine.

pins.env reads the same in bash (the image steps source it) as in pins.py; the shell steps
pass ``bash -n`` and shellcheck (where installed); ``make image`` fails with one clear
message without an engine and otherwise runs ``docker build`` with the pinned tag.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "ci" / "image").glob("*.sh"))
sys.path.insert(0, str(REPO / "scripts"))

from seriestool.pins import load_pins  # noqa: E402


def test_pins_env_reads_the_same_in_bash():
    pins = load_pins(REPO)
    keys = " ".join(f'"${{{k}}}"' for k in pins)
    out = subprocess.run(["bash", "-c", f"set -eu; . ./pins.env; printf '%s\\n' {keys}"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == list(pins.values())


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_steps_parse_and_pass_shellcheck(script):
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("shellcheck"):
        proc = subprocess.run(["shellcheck", "-x", str(script.relative_to(REPO))], cwd=REPO,
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def _fake_docker(tmp_path: Path, info_ok: bool) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ $1 == info ]]; then exit {0 if info_ok else 1}; fi\n'
        f'printf "%s\\n" "$*" >> "{tmp_path / "docker.log"}"\n')
    (bin_dir / "docker").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_make_image_without_an_engine_is_one_clear_error(tmp_path):
    proc = subprocess.run(["make", "-s", "image"], cwd=REPO, capture_output=True, text=True,
                          env=_fake_docker(tmp_path, info_ok=False))
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("make image:")]
    assert proc.returncode != 0 and len(lines) == 1 and "no Docker engine reachable" in lines[0]
    assert not (tmp_path / "docker.log").exists()


def test_make_image_runs_docker_build_with_the_pinned_tag(tmp_path):
    pins = load_pins(REPO)
    subprocess.run(["make", "-s", "image", "BASE_IMAGE=example/rocm-base:1"], cwd=REPO,
                   env=_fake_docker(tmp_path, info_ok=True), check=True, capture_output=True)
    assert (tmp_path / "docker.log").read_text().strip() == (
        f"build -f ci/Dockerfile.rocm -t vllm-aiter-series:{pins['VLLM_VERSION']}-aiter-"
        f"{pins['AITER_REF']} --build-arg BASE_IMAGE=example/rocm-base:1 .")

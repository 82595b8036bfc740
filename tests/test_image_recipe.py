"""Static checks of the ROCm image recipe (ci/Dockerfile.rocm, ci/image/*.sh), no Docker engine.

Every version comes from pins.env (no second copy); every COPY source is in the build
context (present, kept by .dockerignore) and lands at the same path; every script a RUN
step calls was copied before it; the shell steps pass ``bash -n`` and shellcheck (where
installed); ``make image`` fails with one clear message without an engine and otherwise
runs ``docker build`` with the pinned tag.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "ci" / "Dockerfile.rocm"
SCRIPTS = sorted((REPO / "ci" / "image").glob("*.sh"))
sys.path.insert(0, str(REPO / "scripts"))

from seriestool.pins import load_pins  # noqa: E402


def instructions() -> list[tuple[str, list[str]]]:
    """(keyword, words) per instruction: continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n(\s*#[^\n]*\n)*", " ", DOCKERFILE.read_text())
    lines = [ln.split() for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    return [(words[0].upper(), words[1:]) for words in lines]


def dockerignored(rel: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns used here: the last match wins; '!' re-includes."""
    prefixes = ["/".join(rel.split("/")[:n]) for n in range(1, rel.count("/") + 2)]
    ignored = False
    for raw in patterns:
        pattern = raw.lstrip("!").strip("/").replace("**/", "")
        if any(fnmatch.fnmatch(p, pattern) or fnmatch.fnmatch(p.rsplit("/", 1)[-1], pattern)
               for p in prefixes):
            ignored = not raw.startswith("!")
    return ignored


def test_base_image_is_an_argument_and_every_run_step_is_a_linted_script():
    steps = instructions()
    assert steps[0][0] == "ARG" and re.fullmatch(r"BASE_IMAGE=\S+", " ".join(steps[0][1]))
    assert steps[1] == ("FROM", ["${BASE_IMAGE}"]) and [k for k, _ in steps].count("FROM") == 1
    runs = [words for keyword, words in steps if keyword == "RUN"]
    assert runs and all(len(w) == 2 and w[0] == "bash" and w[1] in
                        {str(s.relative_to(REPO)) for s in SCRIPTS} for w in runs)


def test_every_version_comes_from_pins_env():
    pins = load_pins(REPO)
    version_like = re.compile(r"(?<![\w.])v?\d+\.\d+(?:\.\d+)+(?![\w.])|\b(?=[0-9a-f]*\d)[0-9a-f]{7,64}\b")
    for path in [DOCKERFILE, *SCRIPTS, REPO / "ci" / "smoke_import.py"]:
        text = path.read_text()
        assert not [k for k, v in pins.items() if len(v) >= 4 and v in text], path
        assert not version_like.findall(text), f"{path}: hard-coded version-like values"
    for script in SCRIPTS:
        text = script.read_text()
        if any(re.search(rf"\${{?{k}\b", text) for k in pins):
            assert re.search(r"^\. \./pins\.env$", text, re.M), f"{script.name} does not source pins.env"
    # The image steps source pins.env with bash: it must read as pins.py reads it.
    keys = " ".join(f'"${{{k}}}"' for k in pins)
    out = subprocess.run(["bash", "-c", f"set -eu; . ./pins.env; printf '%s\\n' {keys}"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == list(pins.values())


def test_every_copy_source_is_in_the_build_context_before_it_runs():
    patterns = [ln.strip() for ln in (REPO / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    assert dockerignored(".venv/bin/python", patterns) and dockerignored("build/vllm/setup.py", patterns)
    assert not dockerignored("scripts/series.py", patterns)
    assert dockerignored("scripts/__pycache__/x.pyc", patterns)
    copied: list[str] = []
    for keyword, words in instructions():
        if keyword == "COPY":
            *sources, dest = words
            for source in sources:
                path = REPO / source
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
                rels = [p.relative_to(REPO).as_posix() for p in files]
                assert [r for r in rels if not dockerignored(r, patterns)], f"{source} not in the context"
                same = f"{Path(source).parent.as_posix()}/" if path.is_file() else source
                assert dest in (same, "./"), f"{source} -> {dest}"
                copied += rels
        if keyword == "RUN":
            assert words[1] in copied, f"{words[1]} runs before it is copied"


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

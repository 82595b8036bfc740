"""Static checks of the ROCm image recipe (ci/Dockerfile.rocm, ci/image/*.sh).

No Docker engine runs here, so what can be checked without one is: the
Dockerfile parses; every version it uses comes from pins.env (no second copy
in the Dockerfile or the scripts it runs); every COPY source is in the build
context (present, not excluded by .dockerignore) and lands at the same path;
every script a RUN step calls was copied before it; the shell steps pass
``bash -n`` and shellcheck (skipped, with the reason, where shellcheck is not
installed); and ``make image`` fails with one clear message without an engine.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "ci" / "Dockerfile.rocm"
SCRIPTS = sorted((REPO / "ci" / "image").glob("*.sh"))
RECIPE = [DOCKERFILE, *SCRIPTS, REPO / "ci" / "smoke_import.py"]
sys.path.insert(0, str(REPO / "scripts"))

from seriestool.pins import load_pins  # noqa: E402

INSTRUCTIONS = {"ADD", "ARG", "CMD", "COPY", "ENTRYPOINT", "ENV", "EXPOSE", "FROM", "HEALTHCHECK", "LABEL",
                "ONBUILD", "RUN", "SHELL", "STOPSIGNAL", "USER", "VOLUME", "WORKDIR"}


# --- a small Dockerfile parser ---------------------------------------------------------

@dataclass
class Instruction:
    lineno: int
    keyword: str
    args: str
    flags: dict[str, str] = field(default_factory=dict)

    def words(self) -> list[str]:
        """Arguments in shell or JSON form, without --flags."""
        if self.args.startswith("["):
            return json.loads(self.args)
        return self.args.split()


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Instruction]]:
    """(parser directives, instructions); continuation lines joined, comments dropped."""
    lines = text.splitlines()
    directives: dict[str, str] = {}
    i = 0
    while i < len(lines):  # directives: only before any other line, comment or blank
        match = re.match(r"^#\s*([a-zA-Z]+)\s*=\s*(\S+)\s*$", lines[i])
        if not match:
            break
        directives[match.group(1).lower()] = match.group(2)
        i += 1
    escape = directives.get("escape", "\\")
    instructions: list[Instruction] = []
    while i < len(lines):
        line = lines[i]
        start = i + 1
        i += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = []
        while True:
            stripped = line.rstrip()
            if stripped.endswith(escape):
                parts.append(stripped[:-1])
                # continuation: comment and blank lines inside it are skipped
                while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                    i += 1
                if i >= len(lines):
                    raise ValueError(f"line {start}: continuation runs past the end of the file")
                line = lines[i]
                i += 1
            else:
                parts.append(line)
                break
        joined = " ".join(p.strip() for p in parts)
        keyword, _, args = joined.partition(" ")
        if keyword.upper() not in INSTRUCTIONS:
            raise ValueError(f"line {start}: unknown instruction {keyword!r}")
        if "<<" in args and keyword.upper() in ("RUN", "COPY"):
            raise ValueError(f"line {start}: heredocs are not used here (put the step in ci/image/*.sh)")
        flags = {}
        args = args.strip()
        while args.startswith("--"):
            flag, _, args = args.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = value
            args = args.strip()
        if args.startswith("["):
            json.loads(args)  # exec form must be a JSON array
        instructions.append(Instruction(start, keyword.upper(), args, flags))
    return directives, instructions


def _variables(text: str) -> set[str]:
    return set(re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", text))


@pytest.fixture(scope="module")
def dockerfile() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())[1]


def test_parser_handles_continuations_comments_and_flags():
    text = ("# syntax=docker/dockerfile:1\n\n# a comment\nARG BASE=x\nFROM ${BASE} AS base\n"
            "RUN a \\\n    # inside\n    && b\nCOPY --chown=1:1 [\"a b\", \"c/\"]\n")
    directives, ins = parse_dockerfile(text)
    assert directives == {"syntax": "docker/dockerfile:1"}
    assert [(i.lineno, i.keyword) for i in ins] == [(4, "ARG"), (5, "FROM"), (6, "RUN"), (9, "COPY")]
    assert ins[2].args == "a && b"
    assert ins[3].flags == {"chown": "1:1"} and ins[3].words() == ["a b", "c/"]
    with pytest.raises(ValueError, match="unknown instruction 'RUNN'"):
        parse_dockerfile("FROM x\nRUNN y\n")


def test_dockerfile_structure(dockerfile):
    keywords = [i.keyword for i in dockerfile]
    first_non_arg = next(i for i in dockerfile if i.keyword != "ARG")
    assert first_non_arg.keyword == "FROM" and keywords.count("FROM") == 1
    assert first_non_arg.args == "${BASE_IMAGE}", "the base image is a build argument"
    before_from = {i.args.split("=", 1)[0] for i in dockerfile[:keywords.index("FROM")] if i.keyword == "ARG"}
    assert before_from == {"BASE_IMAGE"}
    base_default = next(i.args for i in dockerfile if i.keyword == "ARG" and i.args.startswith("BASE_IMAGE="))
    assert base_default.split("=", 1)[1], "BASE_IMAGE has a default (a ROCm vLLM base image)"
    # Every variable an instruction uses is declared (ARG/ENV) before it, or set by the base image.
    declared: set[str] = set()
    for ins in dockerfile:
        if ins.keyword == "ARG":
            declared.add(ins.args.split("=", 1)[0])
        if ins.keyword in ("FROM", "ENV", "COPY", "WORKDIR"):
            undeclared = _variables(ins.args) - declared
            assert not undeclared, f"line {ins.lineno}: {ins.keyword} uses undeclared {undeclared}"
        if ins.keyword == "ENV":
            declared |= set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=", ins.args))
    runs = [i for i in dockerfile if i.keyword == "RUN"]
    assert runs and all(re.fullmatch(r"bash ci/image/[a-z_]+\.sh", r.args) for r in runs), \
        "RUN steps call ci/image/*.sh scripts, so the shell steps are linted"


def test_every_version_comes_from_pins_env(dockerfile):
    pins = load_pins(REPO)
    version_like = re.compile(r"(?<![\w.])v?\d+\.\d+(?:\.\d+)+(?![\w.])|\b(?=[0-9a-f]*\d)[0-9a-f]{7,64}\b")
    for path in RECIPE:
        text = path.read_text()
        for key, value in pins.items():
            if len(value) >= 4:
                assert value not in text, f"{path.relative_to(REPO)} repeats pins.env's {key} ({value})"
        found = version_like.findall(text)
        assert not found, f"{path.relative_to(REPO)}: hard-coded version-like values {found}"
    # pins.env is in the image before the first RUN, and the steps that need a pin source it.
    copies = [i for i in dockerfile if i.keyword == "COPY"]
    first_run = next(i.lineno for i in dockerfile if i.keyword == "RUN")
    assert any(i.words()[0] == "pins.env" and i.lineno < first_run for i in copies)
    for script in SCRIPTS:
        text = script.read_text()
        uses = {k for k in pins if re.search(rf"\${{?{k}\b", text)}
        if uses:
            assert re.search(r"^\. \./pins\.env$", text, re.M), \
                f"{script.name} uses {uses} without sourcing pins.env"


def test_pins_env_reads_the_same_in_the_shell():
    """The image steps source pins.env with bash; it must mean what pins.py reads."""
    pins = load_pins(REPO)
    keys = " ".join(f'"${{{k}}}"' for k in pins)
    out = subprocess.run(["bash", "-c", f"set -eu; . ./pins.env; printf '%s\\n' {keys}"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == list(pins.values())


def _ignored(rel: str, patterns: list[str]) -> bool:
    """.dockerignore semantics: the last matching pattern wins; '!' re-includes."""
    parts = rel.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    ignored = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw[1:] if negate else raw
        pattern = pattern.strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*") \
            .replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates) or fnmatch.fnmatch(rel, pattern):
            ignored = not negate
    return ignored


def test_every_copy_source_is_in_the_build_context(dockerfile):
    ignore = REPO / ".dockerignore"
    patterns = [ln.strip() for ln in ignore.read_text().splitlines()
                if ln.strip() and not ln.lstrip().startswith("#")] if ignore.exists() else []
    assert patterns, "a .dockerignore keeps .venv/ and build/ out of the build context"
    assert _ignored(".venv/bin/python", patterns) and _ignored("build/vllm/setup.py", patterns)
    copied: list[str] = []
    for ins in dockerfile:
        if ins.keyword in ("COPY", "ADD"):
            assert "from" not in ins.flags, f"line {ins.lineno}: single-stage recipe"
            *sources, dest = ins.words()
            for source in sources:
                path = REPO / source
                assert path.exists(), f"line {ins.lineno}: COPY source {source} is not in the repository"
                files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
                rels = [p.relative_to(REPO).as_posix() for p in files]
                kept = [r for r in rels if not _ignored(r, patterns)]
                assert kept, f"line {ins.lineno}: .dockerignore excludes {source} from the build context"
                if path.is_file():
                    # same layout in the image: a file lands in its own folder (or ./ at the root)
                    assert dest in (f"{Path(source).parent.as_posix()}/", "./"), f"line {ins.lineno}: {dest}"
                else:
                    assert dest.rstrip("/") == source.rstrip("/"), f"line {ins.lineno}: {source} -> {dest}"
                copied += rels
        if ins.keyword == "RUN":
            script = ins.args.split()[1]
            assert script in copied, f"line {ins.lineno}: {script} is run before it is copied"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_steps_parse(script):
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert script.read_text().startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck not installed (apt-get install shellcheck); bash -n still ran")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shell_steps_pass_shellcheck(script):
    proc = subprocess.run(["shellcheck", "-x", str(script.relative_to(REPO))], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _fake_docker(tmp_path: Path, info_ok: bool) -> dict[str, str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "docker.log"
    (bin_dir / "docker").write_text(
        "#!/usr/bin/env bash\n"
        f'if [[ $1 == info ]]; then exit {0 if info_ok else 1}; fi\n'
        f'printf "%s\\n" "$*" >> "{log}"\n')
    (bin_dir / "docker").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_image_without_an_engine_is_one_clear_error(tmp_path):
    proc = subprocess.run(["make", "-s", "image"], cwd=REPO, capture_output=True, text=True,
                          env=_fake_docker(tmp_path, info_ok=False))
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("make image:")]
    assert lines == [lines[0]] and "no Docker engine reachable" in lines[0]
    assert not (tmp_path / "docker.log").exists()


@pytest.mark.skipif(shutil.which("make") is None, reason="make not installed")
def test_make_image_runs_docker_build_with_the_pinned_tag(tmp_path):
    pins = load_pins(REPO)
    env = _fake_docker(tmp_path, info_ok=True)
    subprocess.run(["make", "-s", "image", "BASE_IMAGE=example/rocm-base:1"], cwd=REPO, env=env, check=True,
                   capture_output=True)
    call = (tmp_path / "docker.log").read_text().strip()
    assert call == (f"build -f ci/Dockerfile.rocm -t vllm-aiter-series:{pins['VLLM_VERSION']}-aiter-"
                    f"{pins['AITER_REF']} --build-arg BASE_IMAGE=example/rocm-base:1 .")

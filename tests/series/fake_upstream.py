"""A small fake upstream and series repo, so the mechanics tests run fast and offline
(helpers here, not in conftest.py: `from conftest import` breaks across test folders)."""

from __future__ import annotations

import difflib
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FAKE_VERSION = "9.9.9"

ENVS_PY = "".join(f"# upstream line {i}\nVALUE_{i} = {i}\n" for i in range(1, 21))
UPSTREAM = {
    "vllm/__init__.py": '"""fake vllm"""\n',
    "vllm/envs.py": ENVS_PY,
    "vllm/utils.py": "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "requirements/common.txt": "numpy\n",
    "README.md": "fake upstream\n",
}

HEADER = """Subject: {subject}
Topic: {topic}
Why: because the test says so,
  on two lines.
How: by editing {path}.
Upstream: none
Drop when: never
Tested on: CPU (fake tree)"""


def commit_message(subject: str, topic: str = "fetch-kv", path: str = "vllm/utils.py") -> str:
    """A build-tree commit message that is a complete patch header (what make refresh requires)."""
    header = HEADER.format(subject=subject, topic=topic, path=path).splitlines()
    return header[0].removeprefix("Subject: ") + "\n\n" + "\n".join(header[1:]) + "\n"


def make_patch(subject: str, path: str, old: str, new: str, topic: str = "fetch-kv") -> str:
    diff = "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                        f"a/{path}", f"b/{path}", n=3))
    return HEADER.format(subject=subject, topic=topic, path=path) + f"\n---\ndiff --git a/{path} b/{path}\n" + diff


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def envs_edit_1(text: str) -> str:
    return text.replace("VALUE_3 = 3\n", "VALUE_3 = 3\nSERIES_FLAG = True\n")


def envs_edit_2(text: str) -> str:
    return text.replace("VALUE_15 = 15\n", "VALUE_15 = 15\nOTHER_FLAG = 1\n")


def utils_edit(text: str) -> str:
    return text.replace("return a - b", "return a - b  # checked")


@dataclass
class FakeSeries:
    root: Path
    cache: Path
    sdist: Path

    @property
    def build(self) -> Path:
        return self.root / "build" / "vllm"

    @property
    def patches(self) -> Path:
        return self.root / "patches"

    def run(self, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        full_env = {**os.environ, "SERIES_CACHE": str(self.cache), **(env or {})}
        return subprocess.run([sys.executable, str(REPO / "scripts" / "series.py"),
                               "--root", str(self.root), *args],
                              capture_output=True, text=True, env=full_env, timeout=300)

    def git(self, *args: str, cwd: Path | None = None) -> str:
        env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
                   GIT_COMMITTER_EMAIL="t@t")
        return subprocess.run(["git", "-C", str(cwd or self.build), *args], check=True,
                              capture_output=True, text=True, env=env).stdout.strip()

    def tree(self) -> str:
        return self.git("rev-parse", "HEAD^{tree}")

    def add_patch(self, name: str, text: str) -> None:
        """A patch file, listed last in patches/series."""
        (self.patches / name).write_text(text)
        with open(self.patches / "series", "a") as f:
            f.write(name + "\n")

    def commit(self, message: str = "the series") -> None:
        """Commit everything in the series repository."""
        self.git("add", "-A", cwd=self.root)
        self.git("commit", "-qm", message, cwd=self.root)

    def upstream(self, files: dict[str, str]) -> None:
        """Make the fake sdist hold these files instead, and pin its new sha256."""
        write_sdist(self.sdist, files)
        sha = hashlib.sha256(self.sdist.read_bytes()).hexdigest()
        pins = self.root / "pins.env"
        pins.write_text("".join(f"VLLM_SDIST_SHA256={sha}\n" if ln.startswith("VLLM_SDIST_SHA256=") else ln + "\n"
                                for ln in pins.read_text().splitlines()))


def write_sdist(path: Path, files: dict[str, str], version: str = FAKE_VERSION) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for rel, text in sorted(files.items()):
            data = text.encode()
            info = tarfile.TarInfo(f"vllm-{version}/{rel}")
            info.size = len(data)
            info.mode = 0o644
            info.mtime = 1_700_000_000
            tar.addfile(info, io.BytesIO(data))


def make_fake_series(tmp_path: Path) -> FakeSeries:
    """A series repo (2 patches, 1 overlay file) on a fake vLLM 9.9.9 sdist in its own cache."""
    cache = tmp_path / "cache"
    cache.mkdir()
    sdist = cache / f"vllm-{FAKE_VERSION}.tar.gz"
    write_sdist(sdist, UPSTREAM)
    sha = hashlib.sha256(sdist.read_bytes()).hexdigest()
    root = tmp_path / "series"
    (root / "patches").mkdir(parents=True)
    (root / "pins.env").write_text(
        f"# fake pins\nVLLM_VERSION={FAKE_VERSION}\nVLLM_SDIST_SHA256={sha}\n"
        "VLLM_COMMIT=gfake\nAITER_REF=v0.0.0\n")
    overlay = root / "vllm_overlay" / "vllm" / "ops"
    overlay.mkdir(parents=True)
    (overlay / "new_kernel.py").write_text("def kernel():\n    return 42\n")
    (root / "patches" / "overlay-topics").write_text("# overlay file -> topic\nvllm/ops/*.py fetch-kv\n")
    envs1 = envs_edit_1(ENVS_PY)
    (root / "patches" / "0001-add-series-flag.patch").write_text(
        make_patch("Add SERIES_FLAG", "vllm/envs.py", ENVS_PY, envs1, topic="mla-fusion"))
    (root / "patches" / "0002-check-sub.patch").write_text(
        make_patch("Comment sub", "vllm/utils.py", UPSTREAM["vllm/utils.py"],
                   utils_edit(UPSTREAM["vllm/utils.py"])))
    (root / "patches" / "series").write_text(
        "# The fake series.\n0001-add-series-flag.patch\n# utils\n0002-check-sub.patch\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    shutil.copy(REPO / ".gitignore", root / ".gitignore")
    return FakeSeries(root=root, cache=cache, sdist=sdist)

"""Fetch (with pip, hash-checked), verify and unpack the pinned vLLM sdist, cached outside
the tree (``$SERIES_CACHE``).  pip runs from a small tools venv with a stand-in ``torch``
(``VLLM_TARGET_DEVICE=empty``): vLLM's build requirements pin a CUDA torch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from . import SeriesError, progress

FETCH_TOOLS = ("setuptools>=77,<81", "setuptools-scm", "setuptools-rust", "packaging",
               "jinja2", "wheel")

_STANDIN_TORCH = {
    "torch/__init__.py": '__version__ = "2.14.0"\n\n\nclass version:\n'
                         "    cuda = None\n    hip = None\n    xpu = None\n",
    "torch/utils/__init__.py": "",
    "torch/utils/cpp_extension.py": "CUDA_HOME = None\nROCM_HOME = None\n",
}


def cache_dir() -> Path:
    if os.environ.get("SERIES_CACHE"):
        return Path(os.environ["SERIES_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm-aiter-series"


def sdist_path(pins: dict[str, str], cache: Path) -> Path:
    return cache / f"vllm-{pins['VLLM_VERSION']}.tar.gz"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def verify(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise SeriesError(
            f"{path}: sha256 mismatch, refusing to use it\n"
            f"  expected (pins.env) {expected}\n"
            f"  actual              {actual}\n"
            "Nothing was deleted. If the file is a bad download, remove it and run make apply again;\n"
            "if upstream re-released, update VLLM_SDIST_SHA256 in pins.env deliberately.")


def _run(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env)


def _last_error(proc: subprocess.CompletedProcess) -> str:
    lines = [ln.strip() for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors or lines or ["(no output)"])[-1]


def _tools_python(cache: Path) -> Path:
    venv = cache / "fetch-venv"
    python = venv / "bin" / "python"
    stamp = venv / ".tools"
    if python.exists() and stamp.exists() and stamp.read_text() == "\n".join(FETCH_TOOLS):
        return python
    shutil.rmtree(venv, ignore_errors=True)  # our own cache entry, rebuilt from scratch
    proc = _run([sys.executable, "-m", "venv", str(venv)])
    if proc.returncode == 0:
        proc = _run([str(python), "-m", "pip", "install", "-q", "--retries", "1", *FETCH_TOOLS])
    if proc.returncode != 0:
        raise SeriesError(f"could not prepare pip's download environment in {venv}: "
                          f"{_last_error(proc)}")
    stamp.write_text("\n".join(FETCH_TOOLS))
    return python


def fetch(pins: dict[str, str], cache: Path) -> Path:
    """Return the verified cached sdist, downloading it with pip if absent."""
    target = sdist_path(pins, cache)
    if not target.exists():
        try:
            _download(pins, cache, target)
        except SeriesError as exc:
            raise SeriesError(
                f"cannot get vllm=={pins['VLLM_VERSION']}: {exc}\n"
                f"No cached copy at {target}. Connect to PyPI, or put the verified sdist there.") from None
    verify(target, pins["VLLM_SDIST_SHA256"])
    return target


def _download(pins: dict[str, str], cache: Path, target: Path) -> None:
    """pip download of the sdist (hash-checked by pip) into target."""
    cache.mkdir(parents=True, exist_ok=True)
    progress.say("fetch", f"preparing pip's download environment in {cache / 'fetch-venv'} ...")
    python = _tools_python(cache)
    with tempfile.TemporaryDirectory(dir=cache, prefix="download-") as tmp:
        standin = Path(tmp) / "standin"
        for rel, text in _STANDIN_TORCH.items():
            (standin / rel).parent.mkdir(parents=True, exist_ok=True)
            (standin / rel).write_text(text)
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"vllm=={pins['VLLM_VERSION']} --hash=sha256:{pins['VLLM_SDIST_SHA256']}\n")
        env = dict(os.environ, PYTHONPATH=str(standin), VLLM_TARGET_DEVICE="empty", VLLM_SKIP_VERSION_SUFFIX="1")
        out = Path(tmp) / "out"
        progress.say("fetch", f"downloading vllm=={pins['VLLM_VERSION']} sdist with pip (hash-checked) "
                              f"into {cache} ...")
        proc = _run([str(python), "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                     "--no-build-isolation", "--require-hashes", "--retries", "1", "-r", str(req), "-d", str(out)],
                    env=env)
        if proc.returncode != 0:
            raise SeriesError(f"pip download failed: {_last_error(proc)}")
        if not (out / target.name).exists():
            raise SeriesError(f"pip download produced no {target.name} in {out}")
        os.replace(out / target.name, target)


def unpack(sdist: Path, dest: Path) -> None:
    """Extract the sdist into dest (made if absent), dropping its top-level ``vllm-X.Y.Z/`` folder."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(sdist) as tar:
        members = [member for member in tar.getmembers() if "/" in member.name.strip("/")]
        for member in members:
            member.name = member.name.split("/", 1)[1]
        tar.extractall(dest, members=members, filter="data")

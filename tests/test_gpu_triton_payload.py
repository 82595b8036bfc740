"""gpu_triton_payload.py on a small stand-in wheel: trimmed, split, stashed, assembled."""

from __future__ import annotations

import random
import sys
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import gpu_triton_payload as payload  # noqa: E402

FILES = {
    "triton/__init__.py": b"__version__ = '9.9.9'\n",
    "triton/_C/libtriton.so": random.Random(0).randbytes(20000),  # incompressible
    "triton/backends/nvidia/bin/ptxas": b"#!/bin/sh\n" * 100,
    "triton/backends/nvidia/bin/ptxas-blackwell": b"dropped",
    "triton/backends/nvidia/lib/cupti/libcupti.so": b"dropped",
    "triton/_C/libproton.so": b"dropped",
    "triton-9.9.9.dist-info/RECORD": b"dropped",
}


@pytest.fixture
def wheel(tmp_path: Path) -> Path:
    path = tmp_path / "triton-9.9.9-cp312-cp312-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in FILES.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o755 if "bin/" in name else 0o644) << 16
            zf.writestr(info, data)
    return path


def test_parts_stash_one_per_command_and_assemble_to_the_trimmed_wheel(wheel, tmp_path):
    out, stash, dest = tmp_path / "out", tmp_path / "stash", tmp_path / "dest"
    manifest = payload.build("9.9.9", wheel, out, part_bytes=4096)
    names = [p["name"] for p in manifest["parts"]]
    assert len(names) >= 2
    # A command that carries the first part and a corrupt copy of the second: only the first
    # is stashed, and assembling refuses to start.
    cmd = tmp_path / "cmd1"
    cmd.mkdir()
    (cmd / "MANIFEST.json").write_text((out / "MANIFEST.json").read_text())
    (cmd / names[0]).write_bytes((out / names[0]).read_bytes())
    (cmd / names[1]).write_bytes(b"x" + (out / names[1]).read_bytes()[1:])
    assert payload.stash(cmd, stash) == names[1:]
    with pytest.raises(SystemExit, match="parts not stashed yet"):
        payload.assemble(stash, dest)
    # A part corrupted past stash's check: the assembled archive is not extracted.
    for name in names[1:]:
        (stash / name).write_bytes((cmd / names[1]).read_bytes())
    with pytest.raises(SystemExit, match="does not match MANIFEST.json"):
        payload.assemble(stash, dest)
    assert payload.stash(out, stash) == []
    folder = payload.assemble(stash, dest)
    kept = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()} - {".complete"}
    assert kept == {"triton/__init__.py", "triton/_C/libtriton.so", "triton/backends/nvidia/bin/ptxas"}
    for name in kept:
        assert (folder / name).read_bytes() == FILES[name]
    assert (folder / "triton/backends/nvidia/bin/ptxas").stat().st_mode & 0o111
    assert payload.assemble(stash, dest) == folder  # complete: nothing redone

#!/usr/bin/env python3
"""A Triton release (a 250 MB wheel) for the GPU machine, which has no package index and
takes at most 64 MiB per command.  ``build`` (``make gpu-triton-payload``) drops what
compiling and launching for sm_90 does not need (DROP) and writes the rest as one tar.xz in
``.gpu_payload/triton/triton-<v>.tar.xz.<n>`` parts of at most 48 MiB, with ``MANIFEST.json``
(sha256 of the whole and of each part).  On the GPU machine (stdlib only), one command per
part, each carrying MANIFEST.json and its part::

    python3 scripts/gpu_triton_payload.py stash      # keeps the verified parts in /tmp
    python3 scripts/gpu_triton_payload.py assemble   # once all are there: verify, extract

``assemble`` prints the folder to put first on PYTHONPATH (``/tmp/triton-<v>``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from seriestool.sdist import cache_dir, sha256_of  # stdlib only, as on the GPU machine

REPO = Path(__file__).resolve().parents[1]

OUT = REPO / ".gpu_payload" / "triton"
STASH = Path("/tmp/triton-parts")
DROP = (
    "triton/backends/nvidia/lib/cupti/",
    "triton/backends/nvidia/lib/cupti-blackwell/",
    "triton/backends/nvidia/bin/ptxas-blackwell",
    "triton/backends/nvidia/bin/cuobjdump",
    "triton/backends/nvidia/bin/nvdisasm",
    "triton/_C/libproton.so",
    "triton/profiler/",
)


def build(version: str, wheel: Path, out: Path, part_bytes: int) -> dict:
    """Trim ``wheel``, pack and split it into ``out``; returns the manifest."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="gpu-triton-") as tmp:
        tar_path = Path(tmp) / f"triton-{version}.tar"
        with zipfile.ZipFile(wheel) as zf, tarfile.open(tar_path, "w") as tar:
            for info in zf.infolist():
                name = info.filename
                if info.is_dir() or not name.startswith("triton/") or name.startswith(DROP):
                    continue
                member = tarfile.TarInfo(name)
                member.size = info.file_size
                member.mode = 0o755 if (info.external_attr >> 16) & 0o111 else 0o644
                with zf.open(info) as src:
                    tar.addfile(member, src)
        print(f"gpu-triton-payload: compressing {tar_path.stat().st_size >> 20} MiB with xz ...",
              flush=True)
        subprocess.run(["xz", "-T0", "-6", str(tar_path)], check=True)
        packed = tar_path.with_suffix(".tar.xz")
        manifest = {"version": version, "wheel": wheel.name, "sha256": sha256_of(packed),
                    "bytes": packed.stat().st_size, "parts": []}
        with open(packed, "rb") as f:
            for n, block in enumerate(iter(lambda: f.read(part_bytes), b"")):
                part = out / f"triton-{version}.tar.xz.{n}"
                part.write_bytes(block)
                manifest["parts"].append({"name": part.name, "sha256": hashlib.sha256(block).hexdigest()})
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def stash(src: Path, stash_dir: Path) -> list[str]:
    """Copy the verified parts present in ``src`` into ``stash_dir``; return the names
    still missing there."""
    manifest = json.loads((src / "MANIFEST.json").read_text())
    stash_dir.mkdir(parents=True, exist_ok=True)
    (stash_dir / "MANIFEST.json").write_text(json.dumps(manifest))
    for part in manifest["parts"]:
        here = src / part["name"]
        if here.is_file() and sha256_of(here) == part["sha256"]:
            shutil.copyfile(here, stash_dir / f"{part['name']}.tmp")
            os.replace(stash_dir / f"{part['name']}.tmp", stash_dir / part["name"])
    return [p["name"] for p in manifest["parts"] if not (stash_dir / p["name"]).is_file()]


def assemble(stash_dir: Path, dest_root: Path) -> Path:
    """Verify the stashed parts and extract them to ``dest_root/triton-<v>`` (once)."""
    manifest = json.loads((stash_dir / "MANIFEST.json").read_text())
    dest = dest_root / f"triton-{manifest['version']}"
    done = dest / ".complete"
    if done.is_file() and done.read_text().strip() == manifest["sha256"]:
        return dest
    missing = [p["name"] for p in manifest["parts"] if not (stash_dir / p["name"]).is_file()]
    if missing:
        raise SystemExit(f"gpu-triton-payload: parts not stashed yet: {', '.join(missing)} "
                         "(run `stash` in a command that carries them)")
    archive = stash_dir / "whole.tar.xz"
    with open(archive, "wb") as f:
        for part in manifest["parts"]:
            f.write((stash_dir / part["name"]).read_bytes())
    if sha256_of(archive) != manifest["sha256"]:
        raise SystemExit("gpu-triton-payload: the assembled archive does not match MANIFEST.json")
    shutil.rmtree(dest, ignore_errors=True)
    with tarfile.open(archive, mode="r:xz") as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
    done.write_text(manifest["sha256"] + "\n")
    return dest


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="here: trim, pack and split a Triton wheel")
    b.add_argument("--version", help="default: pins.env TRITON_VERSION")
    b.add_argument("--wheel", type=Path, help="a cp312 wheel already at hand")
    b.add_argument("--out", type=Path, default=OUT)
    b.add_argument("--part-mib", type=int, default=48)
    s = sub.add_parser("stash", help="GPU machine: keep the parts this command carries")
    s.add_argument("--src", type=Path, default=OUT)
    s.add_argument("--stash", type=Path, default=STASH)
    a = sub.add_parser("assemble", help="GPU machine: verify and extract; prints the folder")
    a.add_argument("--stash", type=Path, default=STASH)
    a.add_argument("--dest", type=Path, default=Path("/tmp"))
    args = parser.parse_args()
    if args.verb == "build":
        from gpu_payload import cp312_wheels
        from seriestool.pins import load_pins

        version = args.version or load_pins(REPO)["TRITON_VERSION"]
        cache = cache_dir() / "gpu-wheels" / "cp312"
        wheel = args.wheel or cp312_wheels([f"triton=={version}"], cache)[0]
        manifest = build(version, wheel, args.out, args.part_mib << 20)
        print(f"gpu-triton-payload: {args.out}: {manifest['bytes'] >> 20} MiB in "
              f"{len(manifest['parts'])} parts; carry MANIFEST.json and one part per command")
    elif args.verb == "stash":
        missing = stash(args.src, args.stash)
        print(f"gpu-triton-payload: stashed in {args.stash}; missing: {', '.join(missing) or 'none'}")
    else:
        print(assemble(args.stash, args.dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Import smoke test of an installed vLLM that carries the AITER series.

The last step of the ROCm image (ci/Dockerfile.rocm, with --rocm) and of the
wheel test (tests/test_wheel.py, Python-only wheel).  Run it from outside any
source tree, so that ``import vllm`` finds the installed package.  Checks:

  * vllm is imported from an installed location, not from a source tree, and
    its version is pins.env's VLLM_VERSION with the series' local label;
  * every file of vllm_overlay/ was installed, and its module imports;
  * the upstream modules the series builds on import;
  * --rocm: torch is a ROCm build, vLLM's compiled extensions load, and AITER
    imports at the ref pins.env names (AITER_REF).

Exit status 1 lists every failure; 0 prints one line per check.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import re
import sys
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UPSTREAM_MODULES = (
    "vllm.envs",
    "vllm._aiter_ops",
    "vllm.v1.attention.backends.rocm_aiter_fa",
    "vllm.model_executor.layers.attention.mla_attention",
    "vllm.model_executor.layers.mla",
)
ROCM_EXTENSIONS = ("vllm._C", "vllm._rocm_C")


def read_pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            pins[key.strip()] = value.strip()
    return pins


def overlay_modules(overlay: Path) -> tuple[list[str], list[str]]:
    """(files under vllm/, importable module names) of the overlay."""
    files = sorted(p.relative_to(overlay).as_posix() for p in overlay.rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")
    files = [f for f in files if f.startswith("vllm/")]
    modules = [f[:-3].replace("/", ".").removesuffix(".__init__") for f in files if f.endswith(".py")]
    return files, modules


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pins", type=Path, default=REPO / "pins.env")
    parser.add_argument("--overlay", type=Path, default=REPO / "vllm_overlay")
    parser.add_argument("--rocm", action="store_true",
                        help="also require ROCm torch, vLLM's compiled extensions and AITER")
    args = parser.parse_args(argv)
    pins = read_pins(args.pins)
    failures: list[str] = []

    def check(what: str, fn) -> object:
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - every failure is reported, then exit 1
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
            if "-v" in sys.argv:
                traceback.print_exc()
            return None
        print(f"ok  {what}" + (f": {result}" if isinstance(result, str) else ""))
        return result

    vllm = check("import vllm", lambda: importlib.import_module("vllm"))
    if vllm is None:
        print("\n".join(failures), file=sys.stderr)
        return 1
    installed = Path(vllm.__file__).resolve().parent

    def where() -> str:
        if installed.is_relative_to(REPO) or (installed.parent / "setup.py").exists():
            raise RuntimeError(f"vllm came from a source tree ({installed}), not an installed package")
        return str(installed)

    def version() -> str:
        expected = re.escape(pins["VLLM_VERSION"]) + r"\+aiter\.series\.[a-z0-9.]+"
        if not re.fullmatch(expected, vllm.__version__):
            raise RuntimeError(f"vllm.__version__ is {vllm.__version__!r}, expected "
                               f"{pins['VLLM_VERSION']}+aiter.series.<label>")
        return vllm.__version__

    check("vllm is installed", where)
    check("vllm version", version)
    files, modules = overlay_modules(args.overlay)

    def overlay_installed() -> str:
        missing = [f for f in files if not (installed.parent / f).is_file()]
        if missing:
            raise RuntimeError(f"not in the installed package: {', '.join(missing)}")
        return f"{len(files)} files"

    check("overlay files installed", overlay_installed)
    for module in (*UPSTREAM_MODULES, *modules):
        check(f"import {module}", lambda m=module: importlib.import_module(m) and None)

    if args.rocm:
        def rocm_torch() -> str:
            import torch

            if not torch.version.hip:
                raise RuntimeError(f"torch {torch.__version__} is not a ROCm build")
            return f"torch {torch.__version__}, HIP {torch.version.hip}"

        def aiter_ref() -> str:
            importlib.import_module("aiter")
            got = importlib.metadata.version("amd-aiter")
            ref = pins["AITER_REF"]
            if re.fullmatch(r"v?\d+(\.\d+)+", ref) and re.split(r"[+]|\.dev", got)[0] != ref.lstrip("v"):
                raise RuntimeError(f"amd-aiter {got} installed, pins.env says AITER_REF={ref}")
            return f"amd-aiter {got}"

        check("ROCm torch", rocm_torch)
        for ext in ROCM_EXTENSIONS:
            check(f"import {ext}", lambda e=ext: importlib.import_module(e) and None)
        check("AITER at the pinned ref", aiter_ref)

    if failures:
        print(f"\nsmoke test: {len(failures)} failure(s)", file=sys.stderr)
        print("\n".join("  " + f for f in failures), file=sys.stderr)
        return 1
    print("smoke test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

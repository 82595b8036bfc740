"""What this Python and this machine have: the facts the prerequisites and the results read.

``probe(root)`` imports torch, Triton, AITER, pytest and pytest-benchmark in
this process (the one ``make validate-rocm`` runs the parts with) and never
raises: what does not import is recorded with its error.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import sys
from pathlib import Path

__all__ = ["probe", "gpu_arch"]


def _version(module: str, dist: tuple[str, ...] = ()) -> tuple[str | None, str | None]:
    """(version, error): the module's ``__version__`` or its distribution's version."""
    try:
        mod = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure is a fact
        return None, f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    version = getattr(mod, "__version__", None)
    for name in dist:
        if version:
            break
        try:
            version = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return str(version or "unknown"), None


def gpu_arch(torch) -> str | None:
    """gfx942 / gfx950 on ROCm (``gcnArchName`` without its feature flags),
    sm_XY on CUDA, None without a GPU."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    if torch.version.hip:
        return (getattr(props, "gcnArchName", "") or "").split(":")[0] or None
    return f"sm_{props.major}{props.minor}"


def _series_state(root: Path) -> dict:
    sys.path.insert(0, str(root))
    from benchmarks import provenance

    return provenance.series_state(root)


def probe(root: Path) -> dict:
    env: dict = {"python": sys.executable, "python_version": platform.python_version(),
                 "host": platform.node()}
    env["torch"], env["torch_error"] = _version("torch")
    env.update(hip=None, cuda=None, gpu_count=0, device=None, arch=None)
    if env["torch"] is not None:
        import torch

        env["hip"], env["cuda"] = torch.version.hip, torch.version.cuda
        try:
            env["gpu_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if env["gpu_count"]:
                env["device"] = torch.cuda.get_device_name(0)
                env["arch"] = gpu_arch(torch)
        except Exception as exc:  # noqa: BLE001
            env["gpu_error"] = f"{type(exc).__name__}: {exc}"[:300]
    env["triton"], env["triton_error"] = _version("triton")
    env["aiter"], env["aiter_error"] = _version("aiter", ("amd-aiter", "aiter"))
    env["pytest"], env["pytest_error"] = _version("pytest")
    env["pytest_benchmark"], env["pytest_benchmark_error"] = _version("pytest_benchmark")
    env["tree"] = (root / "build" / "vllm" / "vllm" / "__init__.py").is_file()
    env["rocm_smi"] = next((t for t in ("amd-smi", "rocm-smi")
                            if any((Path(p) / t).is_file()
                                   for p in os.environ.get("PATH", "").split(os.pathsep))), None)
    env.update(_series_state(root))
    return env

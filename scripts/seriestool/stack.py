"""make check: pins.env's target stack against what the pinned tree says it runs.

vLLM's own files name the stack it ships: ``requirements/cuda.txt`` pins the CUDA
torch (and that torch release requires one Triton minor), and
``docker/Dockerfile.rocm_base`` builds the ROCm torch and ROCm's Triton.  pins.env
records them (``TARGET_*``) and tests on ``TRITON_VERSION``; a finding when any of
them disagrees, so a rebase that moves upstream's stack cannot leave the tiers on
the old one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

_CUDA_TORCH = re.compile(r"^torch\s*==\s*([^\s#;]+)", re.M)
_ROCM_ARG = re.compile(r"^ARG\s+(TORCH_VERSION|TRITON_VERSION)\s*=\s*\"?([^\s\"#]+)", re.M)

CUDA_REQUIREMENTS = "requirements/cuda.txt"
ROCM_DOCKERFILE = "docker/Dockerfile.rocm_base"


def minor(version: str) -> str:
    """``3.8.0+git669b31ac`` -> ``3.8``."""
    return ".".join(version.split("+")[0].split(".")[:2])


def tree_reader(tree: Path) -> Callable[[str], str | None]:
    """``read`` for lint_target_stack: a file of ``tree``, or None."""

    def read(rel: str) -> str | None:
        path = tree / rel
        return path.read_text() if path.is_file() else None

    return read


def lint_target_stack(pins: dict[str, str], read: Callable[[str], str | None]) -> list[str]:
    """Findings (one line each); ``read(path)`` returns a file of the pinned tree
    (None when it has none).  Only what the tree names is compared: a tree
    without a CUDA torch pin or ROCm stack ARGs names no target for them."""
    named = {}
    cuda = _CUDA_TORCH.findall(read(CUDA_REQUIREMENTS) or "")
    if cuda:
        named["TARGET_TORCH_CUDA"] = (", ".join(cuda), f"{CUDA_REQUIREMENTS} pins torch")
    rocm = dict(_ROCM_ARG.findall(read(ROCM_DOCKERFILE) or ""))
    for key, arg in (("TARGET_TORCH_ROCM", "TORCH_VERSION"), ("TARGET_TRITON_ROCM", "TRITON_VERSION")):
        if arg in rocm:
            named[key] = (rocm[arg], f"{ROCM_DOCKERFILE} has ARG {arg}=")
    if not named:
        return []
    needed = [*named, "TRITON_VERSION"]
    if "TARGET_TORCH_CUDA" in named:
        needed.append("TARGET_TORCH_CUDA_TRITON")
    missing = [k for k in needed if not pins.get(k)]
    if missing:
        return [f"pins.env: missing {', '.join(missing)} (the target stack; see its comments)"]
    findings = []
    for key, (value, where) in named.items():
        if pins[key] != value:
            sep = "" if where.endswith("=") else " "
            findings.append(f"pins.env: {key}={pins[key]} but {where}{sep}{value}")
    tested = minor(pins["TRITON_VERSION"])
    tritons = [k for k in ("TARGET_TORCH_CUDA_TRITON", "TARGET_TRITON_ROCM") if k in needed]
    for key in tritons:
        if minor(pins[key]) != tested:
            findings.append(f"pins.env: TRITON_VERSION={pins['TRITON_VERSION']} (the CPU and compile "
                            f"tiers) is not the target's Triton {minor(pins[key])} ({key})")
    return findings

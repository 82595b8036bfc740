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
    (None when it has none: a tree with neither file names no stack)."""
    requirements, dockerfile = read(CUDA_REQUIREMENTS), read(ROCM_DOCKERFILE)
    if requirements is None and dockerfile is None:
        return []
    findings = []
    keys = ("TARGET_TORCH_CUDA", "TARGET_TORCH_CUDA_TRITON", "TARGET_TORCH_ROCM",
            "TARGET_TRITON_ROCM", "TRITON_VERSION")
    missing = [k for k in keys if not pins.get(k)]
    if missing:
        return [f"pins.env: missing {', '.join(missing)} (the target stack; see its comments)"]
    cuda = _CUDA_TORCH.findall(requirements or "")
    if cuda != [pins["TARGET_TORCH_CUDA"]]:
        findings.append(f"pins.env: TARGET_TORCH_CUDA={pins['TARGET_TORCH_CUDA']} but "
                        f"{CUDA_REQUIREMENTS} pins torch {', '.join(cuda) or '(none)'}")
    rocm = dict(_ROCM_ARG.findall(dockerfile or ""))
    for key, arg in (("TARGET_TORCH_ROCM", "TORCH_VERSION"), ("TARGET_TRITON_ROCM", "TRITON_VERSION")):
        if rocm.get(arg) != pins[key]:
            findings.append(f"pins.env: {key}={pins[key]} but {ROCM_DOCKERFILE} has "
                            f"ARG {arg}={rocm.get(arg, '(none)')}")
    tested = minor(pins["TRITON_VERSION"])
    for key in ("TARGET_TORCH_CUDA_TRITON", "TARGET_TRITON_ROCM"):
        if minor(pins[key]) != tested:
            findings.append(f"pins.env: TRITON_VERSION={pins['TRITON_VERSION']} (the CPU and compile "
                            f"tiers) is not the target's Triton {minor(pins[key])} ({key})")
    return findings

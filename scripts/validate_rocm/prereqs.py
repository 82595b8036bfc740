"""What each part needs, checked before anything runs; one line per missing thing.

A requirement is a name and a check ``(env, opts) -> problem or None`` over
the facts of ``environment.probe`` and the command line; each problem line
says how to get what is missing.  ``plan(parts, env, opts)`` returns the
parts to run, the parts skipped with their reason (ROCm-only parts on a CUDA
GPU under ``--allow-cuda``) and the missing lines (the run stops, exit 2,
when there is any).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["NEEDS", "ROCM_ONLY", "Options", "plan"]

IMAGE = "the ROCm image has it: `make image` (ci/Dockerfile.rocm), then run inside the container"


@dataclass
class Options:
    root: Path
    pins: dict
    allow_cuda: bool = False
    model: str | None = None
    upstream: str | None = None
    patched: str | None = None


def _rocm_torch(env, opts):
    if env.get("torch") is None:
        return f"torch does not import ({env.get('torch_error')}): a ROCm build of torch; {IMAGE}"
    if not env.get("hip"):
        return (f"torch {env['torch']} is not a ROCm build (torch.version.hip is None): a ROCm "
                f"torch; {IMAGE} (on a CUDA GPU: ALLOW_CUDA=1 runs the parts that can run)")
    return None


def _gpu(env, opts):
    if env.get("torch") is None:
        return f"torch does not import ({env.get('torch_error')}): {IMAGE}"
    if not env.get("gpu_count"):
        extra = env.get("gpu_error") or "torch.cuda.device_count() is 0"
        return (f"no GPU visible to torch {env['torch']} ({extra}): run on an MI300X / MI355X; a "
                "container needs --device /dev/kfd --device /dev/dri --group-add video")
    return None


def _amd_gpu(env, opts):
    problem = _rocm_torch(env, opts) or _gpu(env, opts)
    if problem:
        return problem
    if not str(env.get("arch") or "").startswith("gfx"):
        return f"the GPU ({env.get('device')}) reports no gfx arch (gcnArchName): not an AMD GPU"
    return None


def _pin_prefix(pin: str, parts: int) -> str:
    return ".".join(pin.lstrip("v").split(".")[:parts])


def _aiter(env, opts):
    pin = opts.pins.get("AITER_REF", "")
    how = (f"AITER {pin} (pins.env AITER_REF): {IMAGE}, or build it from "
           f"{opts.pins.get('AITER_REPO', 'https://github.com/ROCm/aiter.git')} at {pin}")
    if env.get("aiter") is None:
        return f"AITER does not import ({env.get('aiter_error')}): {how}"
    want = _pin_prefix(pin, 3)
    if env["aiter"] != "unknown" and not re.match(rf"v?{re.escape(want)}(?![0-9])", env["aiter"]):
        return f"AITER {env['aiter']} is not the pinned {pin}: {how}"
    return None


def _triton(env, opts):
    pin = opts.pins.get("TRITON_VERSION", "")
    want = _pin_prefix(pin, 2)
    if env.get("triton") is None:
        return f"Triton does not import ({env.get('triton_error')}): Triton {want}.x; {IMAGE}"
    if opts.allow_cuda and not env.get("hip"):
        return None  # a CUDA machine runs its own Triton (recorded, not pinned)
    if not re.match(rf"{re.escape(want)}(?![0-9])", env["triton"]):
        return (f"Triton {env['triton']} is not the pinned {want}.x (pins.env TRITON_VERSION="
                f"{pin}): ROCm Triton {want}; {IMAGE}")
    return None


def _tree(env, opts):
    if not env.get("tree"):
        return "build/vllm (the patched tree) is missing: run `make apply` here"
    return None


def _pytest(env, opts):
    if env.get("pytest") is None:
        return f"pytest does not import ({env.get('pytest_error')}): pip install pytest"
    return None


def _pytest_benchmark(env, opts):
    if env.get("pytest_benchmark") is None:
        return ("pytest-benchmark does not import "
                f"({env.get('pytest_benchmark_error')}): pip install pytest-benchmark")
    return None


def _model(env, opts):
    if not opts.model:
        return ("MODEL= is not given: the e2e part runs a model from a local directory (it never "
                "downloads), e.g. make validate-rocm MODEL=/models/Llama-3.1-8B-Instruct")
    path = Path(opts.model)
    if not (path / "config.json").is_file():
        return (f"MODEL={opts.model} is not a local model directory (no config.json there); the "
                "e2e part never downloads")
    return None


def _installs(env, opts):
    missing = [n for n, v in (("UPSTREAM", opts.upstream), ("PATCHED", opts.patched)) if not v]
    if missing:
        return (f"{' and '.join(m + '=' for m in missing)} not given: the e2e recipes compare two installs, each "
                "named by the command that runs its Python (scripts/e2e/README.md), e.g. "
                "UPSTREAM=/opt/vllm-upstream/bin/python PATCHED=python3")
    return None


REQUIREMENTS: dict[str, Callable] = {
    "rocm torch": _rocm_torch, "gpu": _gpu, "amd gpu": _amd_gpu, "aiter": _aiter,
    "triton": _triton, "patched tree": _tree, "pytest": _pytest,
    "pytest-benchmark": _pytest_benchmark, "model": _model, "installs": _installs,
}
_ROCM_STACK = ("rocm torch", "amd gpu", "aiter", "triton")
NEEDS = {
    "rocm-tests": (*_ROCM_STACK, "patched tree", "pytest"),
    "conformance": (*_ROCM_STACK, "patched tree", "pytest"),
    "kernels": ("gpu", "triton", "pytest"),
    "facts": ("gpu", "triton"),
    "bench": ("gpu", "triton", "pytest", "pytest-benchmark"),
    "e2e": (*_ROCM_STACK, "model", "installs"),
}
ROCM_ONLY = ("rocm-tests", "conformance", "e2e")


def plan(parts: list[str], env: dict, opts: Options) -> tuple[list[str], dict, list[str]]:
    """(parts to run, {skipped part: reason}, missing lines in order, no repeats)."""
    run, skipped, missing = [], {}, []
    on_cuda = bool(env.get("gpu_count")) and not env.get("hip")
    for part in parts:
        if opts.allow_cuda and on_cuda and part in ROCM_ONLY:
            skipped[part] = (f"needs ROCm and AITER; skipped under ALLOW_CUDA on "
                             f"{env.get('device')} ({env.get('arch')})")
            continue
        problems = [REQUIREMENTS[n](env, opts) for n in NEEDS[part]]
        problems = [p for p in problems if p]
        for p in problems:
            if p not in missing:
                missing.append(p)
        if not problems:
            run.append(part)
    return run, skipped, missing

"""Shared pytest setup for the series' tests.

Tiers (README "Test tiers"):
  * CPU   -- no CUDA/ROCm device: Triton kernels run under ``TRITON_INTERPRET=1``
             on small fp32/fp16 shapes.  This is what ``make test`` and CI run.
  * GPU   -- a CUDA or ROCm device: the same kernel tests compiled, at real
             sizes (tests marked ``gpu``).  ``make test-gpu``.
  * ROCm  -- AITER paths (tests marked ``rocm``); skipped elsewhere.

``TRITON_INTERPRET`` must be set before any ``@triton.jit`` is evaluated, so it
is decided here, before test modules import the kernels.
"""

import importlib
import os
import sys
import types
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# tests/fakes: fakes of vendor libraries (AITER), importable from every test
# folder and from an engine subprocess that puts this folder on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent / "fakes"))

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
    _IS_ROCM = _HAS_CUDA and torch.version.hip is not None
except ImportError:  # the series-mechanics tests need no torch
    torch = None
    _HAS_CUDA = _IS_ROCM = False

if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under the interpreter the kernels need the real Triton in vllm.triton_utils
# and the platform vLLM from source cannot detect (tests/fakes/vllm_from_source.py).
import vllm_from_source  # noqa: E402

vllm_from_source.bind()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA or ROCm GPU (compiled kernels, real sizes)")
    config.addinivalue_line("markers", "rocm: needs ROCm and AITER")
    config.addinivalue_line("markers", "slow: takes more than a few seconds on the CPU tier")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a GPU (CPU tier runs kernels under TRITON_INTERPRET=1)")
    skip_rocm = pytest.mark.skip(reason="needs ROCm with AITER")
    for item in items:
        if "gpu" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip_gpu)
        if "rocm" in item.keywords and not _IS_ROCM:
            item.add_marker(skip_rocm)


@pytest.fixture(scope="session")
def device() -> str:
    """The device kernels run on: the GPU when there is one, else the CPU interpreter."""
    return "cuda" if _HAS_CUDA else "cpu"


@pytest.fixture(scope="session")
def on_gpu() -> bool:
    return _HAS_CUDA


@pytest.fixture
def bench_pkg(monkeypatch):
    """The series' benchmarks/ as the package ``benchmarks`` (the patched vLLM tree on
    PYTHONPATH has its own ``benchmarks`` package); ``bench_pkg(name)`` imports
    ``benchmarks.<name>``; sys.modules restored afterwards."""
    saved = {k: v for k, v in sys.modules.items() if k == "benchmarks" or k.startswith("benchmarks.")}
    monkeypatch.setattr(sys, "path", list(sys.path))  # benchmarks/conftest.py prepends the repo
    for key in saved:
        del sys.modules[key]
    pkg = types.ModuleType("benchmarks")
    pkg.__path__ = [str(REPO / "benchmarks")]
    sys.modules["benchmarks"] = pkg
    try:
        yield lambda name: importlib.import_module(f"benchmarks.{name}")
    finally:
        for key in [k for k in sys.modules if k == "benchmarks" or k.startswith("benchmarks.")]:
            del sys.modules[key]
        sys.modules.update(saved)

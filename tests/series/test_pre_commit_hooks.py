"""make check runs upstream's pre-commit hooks on the files the series adds or changes.

The fake upstream carries the pinned tree's own ``tools/pre_commit/`` hook scripts
(read from build/vllm at test time, never committed here) and a
``.pre-commit-config.yaml`` that invokes them as upstream's does.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from fake_upstream import UPSTREAM, write_sdist

TREE = Path(os.environ.get("VLLM_BUILD_TREE", Path(__file__).resolve().parents[2] / "build" / "vllm"))
HOOKS = ("check_forbidden_imports.py", "check_torch_cuda.py", "check_spdx_header.py")
SPDX = ("# SPDX-License-Identifier: Apache-2.0\n"
        "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n")
CONFIG = """\
default_stages: [pre-commit, manual]
repos:
- repo: local
  hooks:
"""
SPDX_HOOK = """\
  - id: check-spdx-header
    name: Check SPDX headers
    entry: python tools/pre_commit/check_spdx_header.py
    language: python
    types_or: [python, rust, proto]
"""
IMPORT_HOOKS = """\
  - id: check-forbidden-imports
    name: Check for forbidden imports
    entry: python tools/pre_commit/check_forbidden_imports.py
    language: python
    types: [python]
    additional_dependencies: [regex]
  - id: check-torch-cuda-call
    name: "Prevent new 'torch.cuda' APIs call"
    entry: python tools/pre_commit/check_torch_cuda.py
    language: python
    types: [python]
    additional_dependencies: [regex]
"""


def _with_upstream_hooks(fs, hooks: str = IMPORT_HOOKS) -> None:
    if not all((TREE / "tools/pre_commit" / name).is_file() for name in HOOKS):
        pytest.skip(f"no pinned tree with tools/pre_commit/ at {TREE} (make apply)")
    files = {**UPSTREAM, ".pre-commit-config.yaml": CONFIG + hooks}
    for name in HOOKS:
        files[f"tools/pre_commit/{name}"] = (TREE / "tools/pre_commit" / name).read_text()
    write_sdist(fs.sdist, files)
    sha = hashlib.sha256(fs.sdist.read_bytes()).hexdigest()
    pins = fs.root / "pins.env"
    pins.write_text("".join(f"VLLM_SDIST_SHA256={sha}\n" if ln.startswith("VLLM_SDIST_SHA256=") else ln + "\n"
                            for ln in pins.read_text().splitlines()))


def test_a_forbidden_import_in_an_overlay_file_fails_make_check(fake_series):
    fs = fake_series
    _with_upstream_hooks(fs)
    kernel = fs.root / "vllm_overlay/vllm/ops/new_kernel.py"
    kernel.write_text(SPDX + "from vllm.triton_utils import triton\n\n\ndef kernel():\n    return triton\n")
    proc = fs.run("check")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "check-forbidden-imports" in proc.stderr  # it ran, and passed

    kernel.write_text(SPDX + "import triton\n\n\ndef kernel():\n    return triton\n")
    proc = fs.run("check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "pre-commit hook check-forbidden-imports failed (exit 1):" in proc.stdout
    assert ("vllm/ops/new_kernel.py:3: error: Found forbidden import: triton. "
            "Use 'from vllm.triton_utils import triton' instead.") in proc.stdout
    assert kernel.read_text().startswith(SPDX + "import triton\n")  # the checkout is untouched


def test_hooks_that_fix_files_fail_and_touch_nothing(fake_series):
    """The SPDX hook adds the header it finds missing: pre-commit counts that as a
    failure, and make check runs it on a scratch tree, so the overlay keeps its text."""
    fs = fake_series
    _with_upstream_hooks(fs, SPDX_HOOK)
    kernel = fs.root / "vllm_overlay/vllm/ops/new_kernel.py"
    text = kernel.read_text()
    assert "SPDX" not in text
    proc = fs.run("check")
    assert proc.returncode == 1
    assert "pre-commit hook check-spdx-header failed (exit 1, files were modified by this hook):" in proc.stdout
    assert "vllm/ops/new_kernel.py" in proc.stdout
    assert kernel.read_text() == text
    assert not (fs.build / "vllm/ops/new_kernel.py").exists() or "SPDX" not in (
        fs.build / "vllm/ops/new_kernel.py").read_text()


def test_a_torch_cuda_call_in_a_patched_file_fails_make_check(fake_series):
    fs = fake_series
    _with_upstream_hooks(fs)
    kernel = fs.root / "vllm_overlay/vllm/ops/new_kernel.py"
    kernel.write_text(SPDX + "import torch\n\n\ndef kernel():\n    return torch.cuda.current_device()\n")
    proc = fs.run("check")
    assert proc.returncode == 1
    assert "vllm/ops/new_kernel.py:7: error: Found torch.cuda API call." in proc.stdout
    assert "use torch.accelerator API instead" in proc.stdout

"""make check runs upstream's pre-commit hooks on the files the series adds or changes: the fake
upstream carries the pinned tree's ``tools/pre_commit/`` scripts (read from build/vllm, never committed)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from fake_upstream import REPO, UPSTREAM

sys.path.insert(0, str(REPO / "scripts"))

from seriestool import precommit  # noqa: E402

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
    fs.upstream(files)


def test_upstream_hooks_run_on_a_scratch_tree_and_report_every_failure(fake_series):
    """A forbidden import fails its hook; the SPDX hook adds the header it finds missing, which
    pre-commit counts as a failure; both are reported, and the overlay keeps its text."""
    fs = fake_series
    _with_upstream_hooks(fs, IMPORT_HOOKS + SPDX_HOOK)
    kernel = fs.root / "vllm_overlay/vllm/ops/new_kernel.py"
    kernel.write_text("import triton\n\n\ndef kernel():\n    return triton\n")
    proc = fs.run("check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "pre-commit hook check-forbidden-imports failed (exit 1):" in proc.stdout
    assert ("vllm/ops/new_kernel.py:1: error: Found forbidden import: triton. "
            "Use 'from vllm.triton_utils import triton' instead.") in proc.stdout
    assert "pre-commit hook check-spdx-header failed (exit 1, files were modified by this hook):" in proc.stdout
    assert kernel.read_text().startswith("import triton\n")  # the checkout is untouched
    kernel.write_text(SPDX + "from vllm.triton_utils import triton\n\n\ndef kernel():\n    return triton\n")
    proc = fs.run("check")   # the SPDX hook still finds the fake upstream's own files (no header)
    assert "check-forbidden-imports on 3 file(s)" in proc.stderr and "new_kernel.py" not in proc.stdout


def test_a_rev_frozen_to_a_sha_installs_the_version_its_comment_names(tmp_path):
    """`pre-commit autoupdate --freeze` (vLLM 0.34.0) pins a SHA and names the tag in a comment."""
    (tmp_path / ".pre-commit-config.yaml").write_text("""\
repos:
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: f368fb366ff7f2f808dd324b83a6d32267799e19  # frozen: v0.17.2
  hooks:
  - id: ruff-check
- repo: https://github.com/crate-ci/typos
  rev: "9023c1f779400877cafdd98052113fc777e2cfdc"   #  frozen: 1.51.1
  hooks:
  - id: typos
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: v0.14.0
  hooks:
  - id: ruff-format
""")
    hooks, _, _ = precommit.load_hooks(tmp_path)
    assert [hook["requirements"] for hook in hooks] == [["ruff==0.17.2"], ["typos==1.51.1"], ["ruff==0.14.0"]]

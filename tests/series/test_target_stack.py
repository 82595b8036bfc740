"""make check's target-stack rule (scripts/seriestool/stack.py) on hand-made trees
and on the real pinned tree."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
from seriestool.pins import load_pins  # noqa: E402
from seriestool.stack import lint_target_stack, tree_reader  # noqa: E402

PINS = {
    "TARGET_TORCH_CUDA": "2.14.0",
    "TARGET_TORCH_CUDA_TRITON": "3.8.0",
    "TARGET_TORCH_ROCM": "2.13.0+rocm10.0.0",
    "TARGET_TRITON_ROCM": "3.8.0+git669b31ac",
    "TRITON_VERSION": "3.8.0",
}
CUDA_TXT = "-r common.txt\nnumba == 0.65.0\ntorch==2.14.0\ntorchaudio==2.11.0\n"
DOCKERFILE = ('ARG TORCH_VERSION=2.13.0+rocm10.0.0\nARG TRITON_BRANCH="669b31ac"\n'
              "ARG TRITON_VERSION=3.8.0+git669b31ac\nARG TORCH_VERSION\n")


def _files(cuda=CUDA_TXT, dockerfile=DOCKERFILE):
    files = {"requirements/cuda.txt": cuda, "docker/Dockerfile.rocm_base": dockerfile}
    return files.get


def test_agreeing_pins_have_no_findings():
    assert lint_target_stack(PINS, _files()) == []


def test_tier_triton_behind_the_target_is_a_finding():
    (finding, again) = lint_target_stack({**PINS, "TRITON_VERSION": "3.6.0"}, _files())
    assert "TRITON_VERSION=3.6.0" in finding and "3.8" in finding and "TARGET_TORCH_CUDA_TRITON" in finding
    assert "TARGET_TRITON_ROCM" in again


@pytest.mark.parametrize("cuda, dockerfile, names", [
    (CUDA_TXT.replace("torch==2.14.0", "torch==2.15.0"), DOCKERFILE, ["TARGET_TORCH_CUDA"]),
    (CUDA_TXT, DOCKERFILE.replace("3.8.0+git669b31ac", "3.9.0+gitabc"), ["TARGET_TRITON_ROCM"]),
    (CUDA_TXT, DOCKERFILE.replace("2.13.0+rocm10.0.0", "2.14.0+rocm10.1.0"), ["TARGET_TORCH_ROCM"]),
], ids=["cuda_torch_moved", "rocm_triton_moved", "rocm_torch_moved"])
def test_a_moved_upstream_stack_is_a_finding(cuda, dockerfile, names):
    findings = lint_target_stack(PINS, _files(cuda, dockerfile))
    assert [n for n in names if any(f"{n}=" in f for f in findings)] == names


def test_missing_target_pins_are_a_finding():
    pins = {k: v for k, v in PINS.items() if k != "TARGET_TRITON_ROCM"}
    assert lint_target_stack(pins, _files()) == [
        "pins.env: missing TARGET_TRITON_ROCM (the target stack; see its comments)"]


def test_a_tree_that_names_no_stack_is_not_checked():
    assert lint_target_stack({}, {}.get) == []
    # A ROCm Dockerfile without the stack ARGs (an older layout) names none either.
    assert lint_target_stack({}, {"docker/Dockerfile.rocm_base": 'ARG AITER_BRANCH="v1"\n'}.get) == []


@pytest.mark.skipif(not os.environ.get("VLLM_BUILD_TREE"), reason="needs the patched tree (make test)")
def test_pins_env_agrees_with_the_pinned_tree():
    tree = Path(os.environ["VLLM_BUILD_TREE"])
    assert lint_target_stack(load_pins(ROOT), tree_reader(tree)) == []

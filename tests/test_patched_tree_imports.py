"""The patched tree (build/vllm) imports on CPU from source: every Python module a patch
touches or the overlay adds, plus the entry points BRIEF §2 lists."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
TREE = Path(os.environ.get("VLLM_BUILD_TREE", REPO / "build" / "vllm")).resolve()
sys.path.insert(0, str(REPO / "scripts"))

from seriestool import patchfile  # noqa: E402
from seriestool.buildtree import Layout, overlay_files  # noqa: E402
from seriestool.pins import load_pins  # noqa: E402

ENTRY_POINTS = [
    "vllm.envs",
    "vllm._aiter_ops",
    "vllm.v1.attention.backends.rocm_aiter_fa",
    "vllm.model_executor.layers.attention.mla_attention",
    "vllm.model_executor.layers.mla",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.worker.cpu.standalone_model_runner",
    "vllm.v1.worker.gpu.model_runner",
]


def series_modules() -> list[str]:
    layout = Layout(root=REPO, build=TREE)
    touched = set(overlay_files(layout))
    for name in patchfile.read_series(layout.patches):
        touched.update(patchfile.parse(layout.patches / name).files())
    modules = {rel[:-3].replace("/", ".").removesuffix(".__init__") for rel in touched
               if rel.startswith("vllm/") and rel.endswith(".py")}
    return sorted(modules | set(ENTRY_POINTS))


pytestmark = pytest.mark.skipif(not (TREE / ".git").exists(),
                                reason=f"{TREE} not built (run make apply)")


# Reads vLLM's compiled ops (torch.ops._C) at import, which the CPU tier has not;
# tests/mla/test_mla_rope_fusion_quant_pass.py imports it with placeholder ops.
NEEDS_COMPILED_OPS = "vllm.compilation.passes.fusion.mla_attn_quant_fusion"


@pytest.mark.parametrize("module", series_modules())
def test_series_module_imports_from_the_patched_tree(module):
    if module == NEEDS_COMPILED_OPS and not hasattr(torch.ops._C, "rotary_embedding"):
        pytest.skip(f"{module} reads torch.ops._C at import")
    imported = importlib.import_module(module)
    assert Path(imported.__file__).resolve().is_relative_to(TREE), (
        f"{module} came from {imported.__file__}, not from {TREE}: PYTHONPATH is wrong")


def test_patched_tree_is_the_pinned_release():
    import vllm

    assert vllm.__version__.startswith(load_pins(REPO)["VLLM_VERSION"])

"""The patched tree (build/vllm) imports on CPU, module by module, from source.

The modules checked are derived from the series itself: every Python file a
patch touches or the overlay adds, plus the entry points BRIEF §2 lists.
"""

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


def _module(rel: str) -> str | None:
    if not rel.startswith("vllm/") or not rel.endswith(".py"):
        return None
    mod = rel[:-3].replace("/", ".")
    return mod.removesuffix(".__init__")


def series_modules() -> list[str]:
    layout = Layout(root=REPO, build=TREE)
    touched = set(overlay_files(layout))
    for name in patchfile.read_series(layout.patches):
        touched.update(patchfile.parse(layout.patches / name).files())
    return sorted({m for m in map(_module, touched) if m} | set(ENTRY_POINTS))


pytestmark = pytest.mark.skipif(not (TREE / ".git").exists(),
                                reason=f"{TREE} not built (run make apply)")


# Modules that read vLLM's compiled ops at import, which the CPU tier has not.
NEEDS_COMPILED_OPS = {
    "vllm.compilation.passes.fusion.mla_attn_quant_fusion": (
        "its matcher_utils reads torch.ops._C at import; tests/mla/"
        "test_mla_rope_fusion_quant_pass.py imports it with placeholder ops"
    ),
}


@pytest.mark.parametrize("module", series_modules())
def test_series_module_imports_from_the_patched_tree(module):
    if module in NEEDS_COMPILED_OPS and not hasattr(torch.ops._C, "rotary_embedding"):
        pytest.skip(f"{module}: {NEEDS_COMPILED_OPS[module]}")
    imported = importlib.import_module(module)
    assert Path(imported.__file__).resolve().is_relative_to(TREE), (
        f"{module} came from {imported.__file__}, not from {TREE}: PYTHONPATH is wrong")


def test_patched_tree_is_the_pinned_release():
    import vllm

    assert vllm.__version__.startswith(load_pins(REPO)["VLLM_VERSION"])

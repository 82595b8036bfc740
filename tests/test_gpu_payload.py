"""make gpu-payload: the pruned vLLM sources and the wheels the GPU machine imports them with."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

import gpu_payload  # noqa: E402
from seriestool import SeriesError  # noqa: E402

TREE = Path(os.environ.get("VLLM_BUILD_TREE", REPO / "build" / "vllm")).resolve()


FAKE = {
    "vllm/__init__.py": "",
    "vllm/a.py": (
        "from typing import TYPE_CHECKING\n"
        "import vllm.b\n"
        "from .pkg import sub, CONSTANT\n"
        "try:\n    import vllm._C\nexcept ImportError:\n    pass\n"
        "if TYPE_CHECKING:\n    from vllm.typing_only import T\n"
        "def lazy():\n    from vllm.lazy import x\n"
        "class K:\n    import vllm.in_class\n"
    ),
    "vllm/b.py": "",
    "vllm/pkg/__init__.py": "CONSTANT = 1\n",
    "vllm/pkg/sub.py": "from ..b import *\n",
    "vllm/typing_only.py": "",
    "vllm/lazy.py": "",
    "vllm/in_class.py": "",
    "vllm/unrelated.py": "import vllm.b\n",
    "vllm/_C.abi3.so": "not python",
}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel, text in FAKE.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_closure_follows_module_level_imports_and_zips_their_files(tree):
    modules = gpu_payload.module_closure(tree, ["vllm.a"])
    # Function bodies and TYPE_CHECKING blocks do not run on import; a class
    # body and a guarded import of a compiled module do (the latter is no .py).
    assert modules == {"vllm", "vllm.a", "vllm.b", "vllm.pkg", "vllm.pkg.sub", "vllm.in_class"}
    # Runtime roots add what a function imports.
    assert "vllm.lazy" in gpu_payload.module_closure(tree, ["vllm.a", "vllm.lazy"])
    dest, again = tree / "vllm-src.zip", tree / "again.zip"
    assert gpu_payload.write_source_zip(tree, modules, dest) == 6
    assert sorted(zipfile.ZipFile(dest).namelist()) == [
        "vllm/__init__.py", "vllm/a.py", "vllm/b.py", "vllm/in_class.py", "vllm/pkg/__init__.py",
        "vllm/pkg/sub.py"]
    # Same modules, same bytes (fixed dates, sorted).
    gpu_payload.write_source_zip(tree, modules, again)
    assert dest.read_bytes() == again.read_bytes()


def test_a_module_the_tests_import_and_the_tree_lacks_is_refused(tree):
    test = tree / "test_y.py"
    test.write_text("from vllm.missing import thing\nfrom vllm.pkg import sub, CONSTANT\n")
    roots = gpu_payload.test_imports(tree, [test])
    assert roots == ["vllm.missing", "vllm.pkg", "vllm.pkg.sub"]  # CONSTANT: an attribute
    with pytest.raises(SeriesError, match="no module vllm.missing"):
        gpu_payload.module_closure(tree, roots)


def test_recompressed_wheel_keeps_every_member_byte_for_byte(tmp_path):
    """Same names, order and bytes (so the wheel's RECORD still holds), LZMA-compressed."""
    src = tmp_path / "pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(src, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("pkg/__init__.py", b"x = 1\n" * 200)
        zf.writestr("pkg/empty.py", b"")
        zf.writestr("pkg-1.0.dist-info/RECORD", b"pkg/__init__.py,sha256=...,1200\n")
    dest = tmp_path / "out.whl"
    gpu_payload.recompress(src, dest)
    with zipfile.ZipFile(src) as a, zipfile.ZipFile(dest) as b:
        assert a.namelist() == b.namelist()
        assert all(a.read(n) == b.read(n) for n in a.namelist())
        assert {i.compress_type for i in b.infolist() if i.file_size} == {zipfile.ZIP_LZMA}


@pytest.mark.skipif(not (TREE / "vllm" / "__init__.py").is_file(),
                    reason="needs the patched tree (make apply)")
def test_real_tree_payload_holds_the_backend_and_no_csrc(tmp_path):
    tests = sorted(p for t in gpu_payload.TESTS for p in (REPO / t).rglob("*.py"))
    roots = sorted(set(gpu_payload.ROOTS) | set(gpu_payload.RUNTIME_ROOTS)
                   | set(gpu_payload.test_imports(TREE, tests)))
    modules = gpu_payload.module_closure(TREE, roots)
    assert {"vllm.v1.attention.backends.rocm_aiter_fa", "vllm.v1.attention.ops.triton_fetch_kv",
            "vllm.model_executor.layers.attention.mla_rope_kv_cache",
            "vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope"} <= modules
    dest = tmp_path / "vllm-src.zip"
    gpu_payload.write_source_zip(TREE, modules, dest)
    names = zipfile.ZipFile(dest).namelist()
    assert all(n.startswith("vllm/") and n.endswith(".py") for n in names)
    assert not [n for n in names if "/tests/" in n or n.startswith("vllm/benchmarks/")]
    # A pruned copy, not the tree: a fraction of its ~3,000 modules.
    assert len(names) < 1000 and dest.stat().st_size < 4 << 20

"""The kernel files' host side reads like upstream's wrappers (issue #24).

No line of the series is kept out of the formatter (``# fmt: skip``). For
each Triton kernel file of the overlay: no wrapper writes a launch key by hand (the
checks are cached by ``triton_launcher.cached_launch``, whose key is made from
all of their arguments), and the host side (every non-blank line outside the
``@triton.jit`` functions, docstrings and comments included) is no longer than
the kernels.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "vllm_overlay/vllm/v1/attention/ops"


def _is_jit(decorator: ast.expr) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(node, ast.Attribute) and node.attr == "jit"


def line_counts(source: str) -> tuple[int, int]:
    """(host lines, kernel lines) of a module, blank lines not counted."""
    lines = source.splitlines()
    kernel = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and any(map(_is_jit, node.decorator_list)):
            start = min(d.lineno for d in node.decorator_list)
            kernel.update(range(start, node.end_lineno + 1))
    counted = [i for i, line in enumerate(lines, 1) if line.strip()]
    kernel_lines = sum(1 for i in counted if i in kernel)
    return len(counted) - kernel_lines, kernel_lines


KERNEL_FILES = sorted(p for p in OPS.glob("triton_*.py") if line_counts(p.read_text())[1])


def test_line_counts_split_at_the_jit_functions():
    source = "import x\n\n@triton.jit\ndef k(a):\n    pass\n\n\ndef host():\n    k[1](0)\n"
    assert line_counts(source) == (3, 3)


def test_there_are_kernel_files():
    names = {p.name for p in KERNEL_FILES}
    assert {"triton_fetch_kv.py", "triton_paged_context_attention.py"} <= names
    assert "triton_mla_rope_cache.py" in names


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_no_hand_written_keys(path):
    source = path.read_text()
    for name in ("LaunchCache", "tensor_geometry", "fast_path"):
        assert name not in source, f"{path.name} uses {name}: use cached_launch"


def _exemptions(path: Path, prefix: str = "") -> list[str]:
    """``path:line`` of each line starting with ``prefix`` kept out of the formatter."""
    return [
        f"{path.name}:{i}"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if line.startswith(prefix) and ("fmt: skip" in line or "fmt: off" in line)
    ]


def test_no_formatter_exemptions_anywhere_in_the_series():
    """No overlay file (the kernel files among them) and no line a patch adds
    is kept out of ruff format."""
    found = [e for p in sorted((ROOT / "vllm_overlay").rglob("*.py")) for e in _exemptions(p)]
    found += [e for p in sorted((ROOT / "patches").glob("*.patch")) for e in _exemptions(p, "+")]
    assert not found, f"formatter exemptions: {found}"


@pytest.mark.parametrize("path", KERNEL_FILES, ids=lambda p: p.name)
def test_host_side_no_longer_than_the_kernels(path):
    host, kernels = line_counts(path.read_text())
    assert host <= kernels, f"{path.name}: {host} host lines, {kernels} kernel lines"

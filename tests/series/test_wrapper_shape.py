"""No line of the series is kept out of the formatter (``# fmt: skip``).

(The kernel files' host side is tested by what it does, in tests/kernels:
results, errors, what a second layer of a step does not redo; issue 34
removed the line-count and identifier-absence checks that stood here.)
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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

"""The repository's own series: lint-clean, and the README table matches the headers."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from seriestool import readme  # noqa: E402


def test_make_check_passes_on_this_series():
    proc = subprocess.run([sys.executable, str(REPO / "scripts/series.py"), "check"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "series OK" in proc.stdout


def test_readme_series_table_is_current():
    text = (REPO / "README.md").read_text()
    assert readme.render(REPO, text) == text, "README.md is stale: run `make readme`"

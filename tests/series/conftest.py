"""Fixtures of the series-mechanics tests; the helpers are in fake_upstream.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_upstream import FakeSeries, make_fake_series


@pytest.fixture
def fake_series(tmp_path: Path) -> FakeSeries:
    return make_fake_series(tmp_path)

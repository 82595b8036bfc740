#!/usr/bin/env python3
"""Entry point of the end-to-end ROCm recipes; see docs/sweeps-and-e2e.md."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from e2e.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

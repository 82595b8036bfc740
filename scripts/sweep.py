#!/usr/bin/env python3
"""Entry point of the Ray benchmark sweep; see scripts/sweep/ and the README section
"Sweeps and end-to-end recipes"."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sweep.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

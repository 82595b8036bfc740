#!/usr/bin/env python3
"""Entry point of the series tooling; see scripts/seriestool/ and `make help`."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from seriestool.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

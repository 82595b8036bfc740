#!/usr/bin/env python3
"""Entry point of `make validate-rocm`; see scripts/validate_rocm/ and docs/rocm.md."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from validate_rocm.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

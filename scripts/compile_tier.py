#!/usr/bin/env python3
"""Entry point of the AMD compile tier; see scripts/compile_tier/ and docs/compile-tier.md."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from compile_tier.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Entry point of the AMD compile tier; see scripts/compile_tier/ and docs/compile-tier.md."""

import sys

from compile_tier.run import main

if __name__ == "__main__":
    sys.exit(main())

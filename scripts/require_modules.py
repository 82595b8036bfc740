#!/usr/bin/env python3
"""``require_modules.py VERB MODULE...``: exit 2 with one line on stderr naming the modules
this python lacks (e.g. `make test-gpu` on a machine without torch), else exit 0."""

import importlib.util
import sys

verb, modules = sys.argv[1], sys.argv[2:]
missing = [m for m in modules if importlib.util.find_spec(m) is None]
if missing:
    print(f"make {verb}: {sys.executable} lacks {', '.join(missing)} (needs {' + '.join(modules)}; "
          f"GPU_PYTHON=/path/to/python picks another interpreter)", file=sys.stderr)
    sys.exit(2)

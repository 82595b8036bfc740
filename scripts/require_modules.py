#!/usr/bin/env python3
"""Say in one line which Python modules a make verb needs and this python lacks.

    python3 scripts/require_modules.py VERB MODULE...

Exit 0 when every module is importable, else print one line on stderr and exit 2
(e.g. `make test-gpu` on a machine without torch).
"""

import importlib.util
import sys


def main(argv: list[str]) -> int:
    verb, modules = argv[0], argv[1:]
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        print(f"make {verb}: {sys.executable} lacks {', '.join(missing)} (needs {' + '.join(modules)}; "
              f"GPU_PYTHON=/path/to/python picks another interpreter)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

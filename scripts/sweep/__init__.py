"""Benchmark sweep on Ray (``scripts/sweep.py``; docs/sweeps-and-e2e.md).

  * ``config`` -- a YAML or TOML config expanded into cells;
  * ``cells``  -- what one Ray task runs: a fake, kernel or e2e cell, as a record;
  * ``run``    -- submit the cells as Ray tasks, write each record as it arrives,
                  resume, the merged REPORT.md, the command line.
"""


class SweepError(Exception):
    """A failure the user can act on: one message, no traceback."""

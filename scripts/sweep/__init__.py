"""Distributed benchmark sweep on Ray: ``scripts/sweep.py``.

A config file (YAML or TOML) lists a matrix of cells; every cell becomes one Ray
task that asks for the GPUs it needs; Ray places the tasks on the cluster (or a
local Ray on one machine).  Each finished cell is written at once as one JSON
file in the sweep's results folder; a re-run skips the cells that already have a
successful result; a failing cell is recorded with its error and traceback.
``report`` merges a folder into one Markdown table.

Modules:
  * ``config``  -- load a config, expand the matrix into :class:`config.Cell`\\ s;
  * ``cells``   -- what runs inside a Ray task, per cell kind (fake, kernel, e2e);
  * ``results`` -- the results folder: file names, resume index, atomic writes;
  * ``driver``  -- submit the cells to Ray and stream results as they finish;
  * ``report``  -- the merged Markdown report;
  * ``cli``     -- the command line.
"""


class SweepError(Exception):
    """A failure the user can act on; printed as one message, no traceback."""

"""The Ray benchmark sweep (``scripts/sweep.py``, docs/sweeps-and-e2e.md): ``config`` expands a
YAML config into cells, ``run`` runs them as Ray tasks and writes the records and REPORT.md."""


class SweepError(Exception):
    """A failure the user can act on: one message, no traceback."""

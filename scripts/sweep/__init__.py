"""Ray benchmark sweep: ``config`` (YAML to cells), ``run`` (Ray tasks, records, REPORT.md)."""

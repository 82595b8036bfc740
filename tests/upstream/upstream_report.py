"""pytest plugin for ``make test-upstream``: one outcome per test id, as JSON.

Loaded into the upstream tree's own pytest run with ``-p upstream_report``
(this folder on ``PYTHONPATH``); writes ``$UPSTREAM_REPORT``: ``{"tests":
{nodeid: outcome}, "messages": {nodeid: text}, "collect_errors": {path: message},
"seconds": {path: seconds}}`` with outcome one of
passed, failed, error (setup / teardown), skipped, xfailed, xpassed.  The
first lines of each failure's message are kept under ``"messages"``.
"""

import json
import os

_RANK = {"passed": 0, "skipped": 1, "xfailed": 1, "xpassed": 2, "failed": 3, "error": 3}


def _first_line(report) -> str:
    """The first three ``E`` lines of a failure (else its last line), shortened."""
    text = str(report.longrepr) if report.longrepr is not None else ""
    errors = [ln[1:].strip() for ln in text.splitlines() if ln.startswith("E ")]
    return " | ".join(errors[:3] or text.splitlines()[-1:])[:500]


class _Report:
    def __init__(self, path: str):
        self.path = path
        self.tests: dict[str, str] = {}
        self.messages: dict[str, str] = {}
        self.collect_errors: dict[str, str] = {}
        self.seconds: dict[str, float] = {}  # per test file: setup + call + teardown

    def _set(self, nodeid: str, outcome: str, report) -> None:
        old = self.tests.get(nodeid)
        if old is None or _RANK[outcome] > _RANK[old]:
            self.tests[nodeid] = outcome
            if outcome in ("failed", "error"):
                self.messages[nodeid] = _first_line(report)

    def pytest_runtest_logreport(self, report):
        path = report.nodeid.split("::")[0]
        self.seconds[path] = self.seconds.get(path, 0.0) + report.duration
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
            if report.when == "call" or report.skipped:
                self._set(report.nodeid, outcome, report)
            return
        if report.when == "call":
            self._set(report.nodeid, report.outcome, report)
        elif report.failed:
            self._set(report.nodeid, "error", report)
        elif report.skipped:
            self._set(report.nodeid, "skipped", report)

    def pytest_collectreport(self, report):
        if report.failed:
            self.collect_errors[report.nodeid] = _first_line(report)

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump({"tests": self.tests, "messages": self.messages,
                       "collect_errors": self.collect_errors,
                       "seconds": {k: round(v, 1) for k, v in self.seconds.items()}},
                      f, indent=0, sort_keys=True)


def pytest_configure(config):
    path = os.environ.get("UPSTREAM_REPORT")
    if path:
        config.pluginmanager.register(_Report(path), "upstream_report_writer")

"""Tooling for the vLLM AITER patch series: pin, fetch, apply, check, refresh, rebase.

Standard library only (plus git and pip as programs), so ``make apply`` works
with the system Python on a fresh machine.
"""


class SeriesError(Exception):
    """A failure the user can act on; printed as one message, no traceback."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while a verb ran; str() says what it left behind (one line)."""

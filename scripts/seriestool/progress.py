"""Progress lines on stderr; SIGTERM and SIGHUP raise KeyboardInterrupt as Ctrl-C does."""

from __future__ import annotations

import signal
import sys
from contextlib import contextmanager


def say(verb: str, text: str) -> None:
    print(f"{verb}: {text}", file=sys.stderr, flush=True)


@contextmanager
def stage(verb: str, what: str):
    say(verb, f"{what} ...")
    yield


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupts_raise() -> None:
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)

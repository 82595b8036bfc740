"""Progress lines for the slow steps, and interrupts that end in one line.

``with stage("apply", "unpacking vllm-0.34.0.tar.gz"):`` prints
``apply: unpacking vllm-0.34.0.tar.gz ...`` on stderr when the step starts; stdout
stays for results.  ``interrupts_raise()`` turns SIGTERM and SIGHUP into
``KeyboardInterrupt`` (as Ctrl-C is), so an interrupted verb runs its clean-up code
and the command line prints one line instead of a traceback.
"""

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

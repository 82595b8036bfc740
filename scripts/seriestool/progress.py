"""Progress lines for the slow steps, and interrupts that end in one line.

``with stage("apply", "unpacking vllm-0.34.0.tar.gz"):`` prints
``apply: unpacking vllm-0.34.0.tar.gz ...`` on stderr when the stage starts and,
while it runs, ``apply: unpacking ... (still running, 10 s)`` every
``TICK_S`` seconds, so no step is silent for long.  stdout stays for results.

``interrupts_raise()`` turns SIGTERM into ``KeyboardInterrupt`` (Ctrl-C already
is one), so an interrupted verb runs its clean-up code and the command line
prints one line instead of a traceback.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager

TICK_S = 5.0


def say(verb: str, text: str) -> None:
    print(f"{verb}: {text}", file=sys.stderr, flush=True)


@contextmanager
def stage(verb: str, what: str, tick_s: float = TICK_S):
    """Announce a step; repeat the announcement every tick_s seconds while it runs."""
    say(verb, f"{what} ...")
    done = threading.Event()
    start = time.monotonic()

    def ticker() -> None:
        while not done.wait(tick_s):
            say(verb, f"{what} (still running, {time.monotonic() - start:.0f} s)")

    thread = threading.Thread(target=ticker, name=f"progress-{verb}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def interrupts_raise() -> None:
    """SIGTERM (and SIGHUP) raise KeyboardInterrupt in the main thread, like Ctrl-C."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_interrupt)

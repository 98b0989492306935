"""Stopping a run cleanly on SIGINT / SIGTERM.

The first signal asks the loop to stop at the next update boundary: the update in progress
finishes, a checkpoint is written, and the command exits 130 with one line saying how to resume.
A second signal exits at once (SystemExit; the loop's `finally` still closes the reward pool).
Several ranks agree on the boundary (Dist.all_max of the flag once per update), so a launcher's
SIGTERM that reaches the ranks at slightly different times still stops them at the same update.
Handlers can only be installed from the main thread; elsewhere (a notebook's worker thread) the
run simply has none.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopOnSignal:
    """Context manager: `.requested` is the first stop signal's number (0 while none came)."""

    def __init__(self, announce: bool = True):
        self.requested = 0
        self.announce = announce
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise SystemExit(128 + signum)
        self.requested = signum
        if self.announce:
            print(f"{signal.Signals(signum).name}: stopping after this update and saving a checkpoint "
                  "(signal again to exit now)", file=sys.stderr, flush=True)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

"""Stopping a run cleanly on SIGINT / SIGTERM.

The first signal asks the loop to stop at the next update boundary: the update in progress
finishes, a checkpoint is written, and the command exits 130 with one line saying how to resume.
A second signal exits at once (SystemExit; the loop's `finally` still closes the reward pool).
Several ranks agree on the boundary (Dist.all_max of the flag once per update), so a launcher's
SIGTERM that reaches the ranks at slightly different times still stops them at the same update.
Handlers can only be installed from the main thread; elsewhere (a notebook's worker thread) the
run simply has none.
Before the first update there is nothing to finish: InterruptStart turns the first signal during
set-up and the format warm start into StartInterrupted, which the command line reports in one line
(exit 130); the run directory then holds no checkpoint, and a resume starts it over.
"""

from __future__ import annotations

import signal
import sys
import threading

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _SignalScope:
    """Context manager: self._handle takes SIGINT / SIGTERM inside (main thread only), the previous handlers after."""

    def _handle(self, signum, frame) -> None:
        raise NotImplementedError

    def __enter__(self):
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()


class StopOnSignal(_SignalScope):
    """Context manager: `.requested` is the first stop signal's number (0 while none came)."""

    def __init__(self, announce: bool = True):
        self.requested = 0
        self.announce = announce

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise SystemExit(128 + signum)
        self.requested = signum
        if self.announce:
            print(f"{signal.Signals(signum).name}: stopping after this update and saving a checkpoint "
                  "(signal again to exit now)", file=sys.stderr, flush=True)


class StartInterrupted(BaseException):
    """A stop signal came before the run's first update (BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class InterruptStart(_SignalScope):
    """Context manager: the first SIGINT / SIGTERM raises StartInterrupted where the main thread is."""

    def _handle(self, signum, frame) -> None:
        raise StartInterrupted(signum)

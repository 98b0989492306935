"""Pending: an environment's answer computed off the decode loop (a tool call), with a deadline.

An environment's step() may return Pending(work, then=..., timeout_s=..., on_timeout=...): `work()` runs
on a daemon thread while the engine keeps decoding the other sequences; the trajectory waits, parked
with its KV (rl/env/driver.py polls it after every engine step). When work() returns, then(result) runs
on the rollout thread and gives the answer (token ids, text, Observation or End, as step() would); past
the deadline on_timeout() does, and the thread's late result is dropped. Simplification: a thread that
hangs is abandoned, not killed (Python cannot kill a thread; a daemon never blocks the exit); tools that
must be killed belong in worker processes (rl/data/reward_pool.py).
"""

from __future__ import annotations

import threading
import time
from typing import Callable


class Pending:
    """A result in flight on its own thread; poll() -> the environment's answer once ready, else None."""

    def __init__(self, work: Callable, *, then: Callable, timeout_s: float, on_timeout: Callable):
        self.then, self.on_timeout = then, on_timeout
        self.deadline = time.monotonic() + timeout_s
        self._done = threading.Event()
        self._result = self._error = None
        threading.Thread(target=self._run, args=(work,), daemon=True, name="rlengine-tool").start()

    def _run(self, work: Callable) -> None:
        try:
            self._result = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the rollout thread, raised there
            self._error = exc
        self._done.set()

    def poll(self):
        if self._done.is_set():
            if self._error is not None:
                raise self._error
            return self.then(self._result)
        if time.monotonic() >= self.deadline:
            return self.on_timeout()
        return None

    def wait(self, seconds: float) -> None:
        """Block up to `seconds` for the result (the engine has nothing to decode meanwhile)."""
        self._done.wait(max(0.0, min(seconds, self.deadline - time.monotonic())))

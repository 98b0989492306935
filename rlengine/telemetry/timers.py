"""Wall-clock time per named phase: CUDA events on a GPU, perf_counter on the CPU.

The trainer wraps each stage of a boundary (generation, log-prob, forward-backward, optimizer)
in `with timer.phase(name):` and reads `totals()` at the boundary. On a GPU the phase start
and end are CUDA events on the current stream and the host synchronises on the end event when
the phase closes: that is the one sync per phase, so a phase's time includes the kernels it
queued. Nothing is synchronised inside a phase.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


class PhaseTimer:
    """Accumulates seconds and entry counts per phase name; `reset()` starts a new boundary."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.device = device
        self.use_cuda_events = device.type == "cuda" and torch.cuda.is_available()
        self._seconds: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._open: set[str] = set()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase `name`; synchronises on exit (GPU).

        Phases may nest (an outer "step" around inner "gen"/"train"); then the totals overlap
        and do not sum to wall time.
        """
        if name in self._open:
            raise RuntimeError(f"PhaseTimer: phase {name!r} is already open; a phase cannot contain itself")
        self._open.add(name)
        try:
            if self.use_cuda_events:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                try:
                    yield
                finally:
                    end.record()
                    end.synchronize()  # the phase boundary: the only host sync this timer makes
                    self._add(name, start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                try:
                    yield
                finally:
                    self._add(name, time.perf_counter() - t0)
        finally:
            self._open.discard(name)

    def _add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds
        self._counts[name] = self._counts.get(name, 0) + 1

    def total(self, name: str) -> float:
        """Seconds accumulated in phase `name` since the last reset (0.0 if never entered)."""
        return self._seconds.get(name, 0.0)

    def totals(self) -> dict[str, float]:
        """Seconds per phase since the last reset (a copy)."""
        return dict(self._seconds)

    def counts(self) -> dict[str, int]:
        """How many times each phase was entered since the last reset (a copy)."""
        return dict(self._counts)

    def reset(self) -> None:
        """Forget all totals (call at each boundary after reading them)."""
        if self._open:
            raise RuntimeError(f"PhaseTimer.reset() called while phase(s) {sorted(self._open)} are open")
        self._seconds.clear()
        self._counts.clear()

"""torch.profiler over a chosen window of steps, written as a Chrome / Perfetto trace.

`--profile DIR` on `rlengine bench ...` (and `rlengine train`) builds a StepProfiler; the loop
calls step() once per engine step (or per RL update). Steps before `window.start` run
unprofiled, the one before it is the profiler's warm-up, steps [start, stop) are recorded; then
DIR/{name}.pt.trace.json (open in https://ui.perfetto.dev or chrome://tracing) and
DIR/{name}.ops.txt (the top ops by self time) are written. While the window is open the given PhaseRanges emit
record_function labels, so the trace reads engine.forward / learner.optimizer rather than
only aten ops. On a CPU only CPU activity is recorded, and `note` says so.
Simplification: one window per run (torch's schedule with repeat=1); a second window means
a second run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from rlengine.telemetry.nvtx import PhaseRanges


@dataclass(frozen=True, slots=True)
class ProfileWindow:
    """Steps [start, stop) are recorded (0-based); step start - 1 is the profiler's warm-up."""

    start: int = 1   # first recorded step, >= 0
    stop: int = 4    # one past the last recorded step, > start

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise ValueError(f"ProfileWindow needs 0 <= start < stop, got start={self.start}, stop={self.stop}")

    @classmethod
    def parse(cls, text: str) -> "ProfileWindow":
        """'START:STOP' (e.g. '2:5' records steps 2, 3 and 4)."""
        try:
            start, stop = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"a profile window is START:STOP with integers, got {text!r}") from None
        return cls(start, stop)


class StepProfiler:
    """Record steps window.start..window.stop-1 of a loop that calls step() after each step."""

    def __init__(self, out_dir: str | Path, *, name: str = "trace", window: ProfileWindow = ProfileWindow(),
                 device: torch.device | str | None = None, ranges: Iterable[PhaseRanges] = (),
                 record_shapes: bool = True, with_stack: bool = False, profile_memory: bool = False):
        self.out_dir, self.name, self.window = Path(out_dir), name, window
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.ranges = list(ranges)
        self.options = dict(record_shapes=record_shapes, with_stack=with_stack, profile_memory=profile_memory)
        self.cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self.note = "" if self.cuda else f"CPU activity only: {self.device} is not a CUDA device"
        self.trace_path: Path | None = None
        self.table_path: Path | None = None
        self.steps = 0
        self._prof = None

    def start(self) -> "StepProfiler":
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        w = self.window
        with warnings.catch_warnings():  # start=0 asks for no warm-up step; torch warns about exactly that
            warnings.filterwarnings("ignore", message="Profiler won't be using warmup")
            schedule = torch.profiler.schedule(skip_first=max(0, w.start - 1), wait=0, warmup=min(1, w.start),
                                               active=w.stop - w.start, repeat=1)
        self._prof = torch.profiler.profile(activities=activities, schedule=schedule,
                                            on_trace_ready=self._write, **self.options)
        self._prof.start()
        self._label(self._in_window(0))
        return self

    def _in_window(self, step: int) -> bool:
        return self.window.start - 1 <= step < self.window.stop

    def _label(self, on: bool) -> None:
        for r in self.ranges:
            r.set_record(on)

    def step(self) -> None:
        """Mark the end of one step (host-side only: no device sync)."""
        if self._prof is None:
            return
        self.steps += 1
        self._prof.step()
        self._label(self._in_window(self.steps))

    def stop(self) -> None:
        """Stop profiling; a window cut short by the end of the loop is still written."""
        if self._prof is None:
            return
        self._prof.stop()
        self._prof = None
        self._label(False)

    def __enter__(self) -> "StepProfiler":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _write(self, prof) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.trace_path = self.out_dir / f"{self.name}.pt.trace.json"
        prof.export_chrome_trace(str(self.trace_path))
        sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        header = f"steps {self.window.start}..{self.window.stop - 1} of {self.name}"
        if self.note:
            header += f" ({self.note})"
        self.table_path = self.out_dir / f"{self.name}.ops.txt"
        self.table_path.write_text(header + "\n" + prof.key_averages().table(sort_by=sort, row_limit=30) + "\n")


class NullProfiler:
    """Stands in for StepProfiler when no --profile was given: every method is a no-op."""

    note, trace_path, table_path = "", None, None

    def start(self) -> "NullProfiler":
        return self

    def step(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def __enter__(self) -> "NullProfiler":
        return self

    def __exit__(self, *exc) -> None:
        pass


def step_profiler(out_dir: str | Path | None, **kwargs) -> StepProfiler | NullProfiler:
    """A StepProfiler writing under `out_dir`, or a NullProfiler when out_dir is None."""
    return NullProfiler() if out_dir is None else StepProfiler(out_dir, **kwargs)

"""What a training run prints while it works: status lines for the set-up phases, one line per update.

The trainer hands RunConsole the phases before the first update (building the job, the format warm
start, the first evaluation) through status(), and every update's metrics record through advance().
On a terminal an update rewrites ONE live line (rich's progress bar: nothing else is logged per
update); elsewhere (a log file, a pipe, CI) each update appends one compact line written straight
to the stream, so no console width wraps or pads it. Both show the update, N, J (the last one
measured), the mean score of the responses scored for the update, t_gen / t_train and, with
dynamic sampling, the fraction of groups the filter kept and whether it fell back to unfiltered
groups. Only rank 0 prints (enabled=False elsewhere, and with run.progress = false).
"""

from __future__ import annotations

import contextlib
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


def update_line(record: dict, *, total: int, last_j: float | None, filtering: bool) -> str:
    """The one-line summary of an update's metrics record (the reward shown: critic/score/mean, every
    scored response, falling back to reward_mean for a record without it)."""
    j = "-" if last_j is None else f"{last_j:.3f}"
    reward = record.get("critic/score/mean", record.get("reward_mean"))
    reward = "-" if reward is None else f"{reward:.3f}"
    line = (f"update {record['update']}/{total} N={record['N']} J={j} reward={reward} "
            f"t_gen={record['t_gen']:.2f}s t_train={record['t_train']:.2f}s")
    if filtering:
        line += f" kept={record['retained_fraction']:.2f}"
        if record.get("filter_fallback"):
            line += " filter_fallback"
    return line


class RunConsole:
    """A run's console output: status() around each set-up phase, updates() around the loop, advance() per update."""

    def __init__(self, *, enabled: bool, filtering: bool = False, console: Console | None = None,
                 stream: TextIO | None = None):
        """filtering: dynamic sampling is on (show the filter's state). console: where the live line
        goes on a terminal (default: stdout); stream: where lines go otherwise (default: the console's file)."""
        self.enabled, self.filtering = enabled, filtering
        self.console = console if console is not None else Console()
        self.stream = stream if stream is not None else self.console.file
        self.live = enabled and self.console.is_terminal
        self.bar, self.task, self.total, self.last_j = None, None, 0, None

    @contextlib.contextmanager
    def status(self, message: str):
        """`message ...` while the block runs, then its seconds: a spinner on a terminal, else one line."""
        if not self.enabled:
            yield
            return
        start = time.perf_counter()
        if self.live:
            with self.console.status(message):
                yield
            self.console.print(f"{message} ... {time.perf_counter() - start:.1f} s", highlight=False)
            return
        self.stream.write(f"{message} ... ")
        self.stream.flush()
        done = False
        try:
            yield
            done = True
        finally:  # on an error the traceback starts on a line of its own
            self.stream.write(f"{time.perf_counter() - start:.1f} s\n" if done else "failed\n")
            self.stream.flush()

    @contextlib.contextmanager
    def updates(self, total: int, *, start: int = 0):
        """The span of the update loop (total updates, `start` of them done already: a resume)."""
        self.total = total
        if not self.live:
            yield self
            return
        self.bar = RichProgress(BarColumn(bar_width=20), TextColumn("{task.fields[line]}", markup=False),
                                TimeElapsedColumn(), console=self.console)
        self.task = self.bar.add_task("train", total=total, completed=start, line=f"update {start}/{total}")
        with self.bar:
            yield self
        self.bar = None

    def advance(self, record: dict) -> None:
        if record.get("J") is not None:
            self.last_j = record["J"]
        if not self.enabled:
            return
        line = update_line(record, total=self.total, last_j=self.last_j, filtering=self.filtering)
        if self.bar is not None:
            self.bar.update(self.task, advance=1, line=line)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

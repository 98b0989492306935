"""A rich progress bar for training updates (disabled in tests and non-interactive runs)."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, *, start: int = 0, enabled: bool = True):
        self.enabled = enabled
        self.bar = RichProgress(TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                TextColumn("{task.fields[info]}"), disable=not enabled)
        self.task = self.bar.add_task("train", total=total, completed=start, info="")
        self.last_j = None

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        self.bar.__exit__(*exc)

    def advance(self, record: dict) -> None:
        if record.get("J") is not None:
            self.last_j = record["J"]
        j = "-" if self.last_j is None else f"{self.last_j:.2f}"
        info = (f"N={record['N']} reward={record['reward_mean']:.2f} J={j} "
                f"t_gen={record['t_gen']:.2f}s t_train={record['t_train']:.2f}s")
        self.bar.update(self.task, advance=1, info=info)
        if self.enabled:
            self.bar.console.log(f"update {record['update']}: {info}")

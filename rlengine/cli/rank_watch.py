"""The launcher's watch over its ranks: a rank that is stopped (SIGSTOP, a debugger, a frozen
container) never fails a collective by itself, so the others would wait the whole collective timeout
and the launcher would then wait for it again. The launcher's thread here finds its ranks (its
child processes, through /proc: Linux), kills one that has been stopped for longer than `limit_s`
so the job ends at once, and remembers it so the job's last line says what happened.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path


def child_ranks(parent: int) -> dict[int, tuple[int, str]]:
    """{pid: (RANK, state letter)} of `parent`'s child processes that have a RANK in their environment."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": state, ppid, ...
            if int(fields[1]) != parent:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_text().split("\0") if "=" in kv)
        except (OSError, ValueError, IndexError):  # gone meanwhile, or not ours to read
            continue
        if "RANK" in env:
            out[int(d.name)] = (int(env["RANK"]), fields[0])
    return out


class RankWatch:
    """with RankWatch(limit_s): ...; .killed = {rank: seconds it had been stopped} of the ranks it killed."""

    def __init__(self, limit_s: float, *, poll_s: float = 0.5, parent: int | None = None):
        self.limit_s, self.poll_s, self.parent = limit_s, poll_s, parent or os.getpid()
        self.killed: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="rlengine-rank-watch")

    def __enter__(self) -> RankWatch:
        if Path("/proc/self/stat").is_file():
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        since: dict[int, float] = {}
        last = time.monotonic()
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            if now - last > 10 * self.poll_s:  # the launcher itself was stopped (Ctrl-Z): so were its ranks
                since.clear()
            last = now
            ranks = child_ranks(self.parent)
            since = {pid: since.get(pid, now) for pid, (_, state) in ranks.items() if state == "T"}
            for pid, t0 in since.items():
                if now - t0 > self.limit_s and ranks[pid][0] not in self.killed:
                    rank = ranks[pid][0]
                    self.killed[rank] = now - t0
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass

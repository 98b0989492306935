"""`rlengine tune` killed with SIGKILL (as a job scheduler or a timeout kills it) takes its workers with it.

The real command, with two worker processes: once both are running their training jobs, the tune
process is SIGKILLed (only it: the workers are in its process group but get no signal from the test)
and each worker must be gone, or a zombie that stopped computing, within a few seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _children(pid: int) -> list[int]:
    """Live child processes of `pid` running rlengine.tune.worker."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] not in "ZX" and b"rlengine.tune.worker" in cmd:
            out.append(int(stat.parent.name))
    return out


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] in "ZX"
    except (FileNotFoundError, ProcessLookupError):
        return True


def test_sigkilled_tune_leaves_no_worker_running(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    tune = subprocess.Popen([sys.executable, "-m", "rlengine", "tune", "--workers", "2", "--threads", "1",
                             "--b-train", "64,128", "--seeds", "1", "--out", str(tmp_path / "tune")],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(workers) < 2 and time.monotonic() < deadline and tune.poll() is None:
            time.sleep(0.2)
            workers = _children(tune.pid)
        assert len(workers) == 2, f"tune started {len(workers)} workers (exit {tune.poll()})"
        time.sleep(2.0)  # past their imports: each worker is in its run, with end_with_parent armed
        assert all(not _stopped(w) for w in workers)
        tune.send_signal(signal.SIGKILL)
        tune.wait()
        for _ in range(100):
            if all(_stopped(w) for w in workers):
                return
            time.sleep(0.1)
        pytest.fail(f"workers {[w for w in workers if not _stopped(w)]} outlived the SIGKILLed tune")
    finally:
        if tune.poll() is None:
            tune.kill()
            tune.wait()
        for w in workers:
            if not _stopped(w):
                os.kill(w, signal.SIGKILL)

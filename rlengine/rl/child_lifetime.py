"""Child processes that end when their parent does, however the parent ends (SIGKILL included).

Worker processes (a tune run's worker, a reward pool's workers) call end_with_parent() first
thing. On Linux the kernel delivers SIGKILL to the child when the parent dies
(prctl PR_SET_PDEATHSIG, through ctypes: no dependency); elsewhere a daemon thread polls
os.getppid() once a second. Either way a parent that died before the call is noticed at once.
PR_SET_PDEATHSIG fires when the *thread* that started the child ends: both callers start their
workers from the thread that also waits for them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl_death_signal() -> bool:
    """Ask the kernel for SIGKILL at the parent's death; False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent_pid: int, period_s: float) -> None:
    while os.getppid() == parent_pid:
        time.sleep(period_s)
    os._exit(1)


def end_with_parent(parent_pid: int | None, period_s: float = 1.0) -> None:
    """End this process when process `parent_pid` (the one that started it) ends; None: nothing to watch."""
    if parent_pid is None:
        return
    if not _prctl_death_signal():
        threading.Thread(target=_watch, args=(parent_pid, period_s), daemon=True, name="parent-watch").start()
    if os.getppid() != parent_pid:  # the parent died before the call: no signal will come
        os._exit(1)

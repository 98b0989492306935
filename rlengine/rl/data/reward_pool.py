"""Reward runners: where reward calls execute — in this process, or in a pool of spawned workers.

Both runners take batches of RewardCalls (submit() -> a ticket) and hand back RewardOutcomes in
submission order (gather(ticket)); the rollout submits a group's calls as soon as its responses
finish and gathers them when the group is needed, so scoring overlaps decoding. InlineRunner
(task.reward_workers = 0) computes at submit time; it cannot interrupt a slow call.
RewardPool (task.reward_workers > 0) runs calls in worker processes started with the "spawn"
context (a thread cannot be stopped; fork would copy the model and CUDA state), one call per
worker at a time, each with a deadline of task.reward_timeout seconds from when it was handed
over. A call past its deadline scores as a failure (counted by the RewardScorer like an
exception) and its worker is killed and replaced, so a hung reward never clogs the pool. A
worker receives the parent's sys.path and imports the reward by "module:qualname", so plugin
modules import in the child as they did in the parent. Workers are daemons and close()
terminates them: a hung call never keeps the process from exiting; a parent that is killed takes
its workers with it (rlengine.rl.child_lifetime).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from collections import deque
from multiprocessing.connection import wait as wait_connections

from rlengine.model.config import ConfigError
from rlengine.rl.data.rewards import (RewardCall, RewardFn, RewardOutcome, _takes_four, call_reward, importable_spec,
                                      resolve_reward)

IMPORT_TIMEOUT_S = 120.0  # a spawned worker that has not imported the reward by then is a config error


class InlineRunner:
    """Reward calls in this process, computed at submit() (task.reward_workers = 0)."""

    def __init__(self, reward_fn: RewardFn):
        self.reward_fn, self.four = reward_fn, _takes_four(reward_fn)
        self._results: dict[int, list[RewardOutcome]] = {}
        self._next = 0

    def submit(self, calls: list[RewardCall]) -> int:
        ticket, self._next = self._next, self._next + 1
        self._results[ticket] = [call_reward(self.reward_fn, c, self.four) for c in calls]
        return ticket

    def done(self, ticket: int) -> bool:
        return True

    def gather(self, ticket: int) -> list[RewardOutcome]:
        return self._results.pop(ticket)

    def discard(self, ticket: int) -> None:
        self._results.pop(ticket, None)

    def close(self) -> None:
        self._results.clear()


def _worker_main(conn, sys_path: list[str], spec: str, parent_pid: int | None = None) -> None:
    """A worker process: import the reward, say ready, then answer (id, call) -> (id, outcome) forever.
    It ends with its parent process, even in the middle of a call (rlengine.rl.child_lifetime)."""
    from rlengine.rl.child_lifetime import end_with_parent

    end_with_parent(parent_pid)
    sys.path[:] = sys_path
    try:
        fn = resolve_reward(spec)
        four = _takes_four(fn)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it as a ConfigError
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):  # the parent went away
            return
        if msg is None:
            return
        call_id, call = msg
        conn.send((call_id, call_reward(fn, call, four)))


class _Worker:
    """One spawned process, its pipe, and the call it is running (id, deadline) if any."""

    def __init__(self, ctx, spec: str):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, list(sys.path), spec, os.getpid()), daemon=True,
                                name="rlengine-reward")
        self.proc.start()
        child.close()
        self.ready = False
        self.started = time.monotonic()
        self.call: tuple[int, float] | None = None

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    """`workers` spawned processes running `spec` ("module:qualname" or a registered name), one call
    each at a time, `timeout` seconds per call (a timed-out or crashed worker is replaced)."""

    def __init__(self, spec: str, *, workers: int, timeout: float):
        if workers < 1:
            raise ValueError(f"RewardPool needs >= 1 worker, got {workers}")
        self.spec, self.num_workers, self.timeout = spec, workers, timeout
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker] = []
        self._queue: deque[tuple[int, RewardCall]] = deque()   # calls not yet handed to a worker
        self._outcomes: dict[int, RewardOutcome] = {}          # call id -> outcome
        self._tickets: dict[int, range] = {}                   # ticket -> its call ids
        self._dropped: set[int] = set()                        # call ids of discarded tickets
        self._next_call = self._next_ticket = 0
        self.timeouts = 0                                      # calls killed at their deadline
        self.start()

    def start(self) -> None:
        """Spawn the workers (again, after close()); returns without waiting for them to import."""
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.spec))

    # ---- the runner interface ----------------------------------------------------------------
    def submit(self, calls: list[RewardCall]) -> int:
        self.start()
        ids = range(self._next_call, self._next_call + len(calls))
        self._next_call += len(calls)
        self._queue.extend(zip(ids, calls))
        ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
        self._tickets[ticket] = ids
        self._pump(0.0)
        return ticket

    def done(self, ticket: int) -> bool:
        """Non-blocking: are all of the ticket's outcomes in? (Collects whatever has arrived.)"""
        self._pump(0.0)
        return all(i in self._outcomes for i in self._tickets[ticket])

    def gather(self, ticket: int) -> list[RewardOutcome]:
        """The ticket's outcomes in submission order; blocks until every call finished or timed out."""
        ids = self._tickets.pop(ticket)
        while not all(i in self._outcomes for i in ids):
            self._pump(0.05)
        return [self._outcomes.pop(i) for i in ids]

    def discard(self, ticket: int) -> None:
        """Forget a ticket (its group was dropped before it was needed)."""
        for i in self._tickets.pop(ticket, range(0)):
            if self._outcomes.pop(i, None) is None:
                self._dropped.add(i)

    def close(self) -> None:
        """Stop every worker (a hung one is killed); calls not answered yet fail. Idempotent."""
        for w in self._workers:
            try:
                w.conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 0.5
        for w in self._workers:
            w.proc.join(timeout=max(0.0, deadline - time.monotonic()))
            w.kill()
            if w.call is not None:
                self._store(w.call[0], RewardOutcome(error="RewardPoolClosed: the pool closed during this call\n"))
        self._workers.clear()
        for call_id, _ in self._queue:
            self._store(call_id, RewardOutcome(error="RewardPoolClosed: the pool closed before this call ran\n"))
        self._queue.clear()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: multiprocessing may be half torn down
            pass

    # ---- scheduling ----------------------------------------------------------------------------
    def _pump(self, wait_s: float) -> None:
        """Hand queued calls to idle ready workers, collect answers, enforce deadlines."""
        self._dispatch()
        busy = {w.conn: w for w in self._workers if w.call is not None or not w.ready}
        if not busy:
            return
        now = time.monotonic()
        deadlines = [w.call[1] - now if w.call is not None else w.started + IMPORT_TIMEOUT_S - now
                     for w in busy.values()]
        wait_s = max(0.0, min([wait_s, *deadlines]))
        for conn in wait_connections(list(busy), timeout=wait_s):
            self._receive(busy[conn])
        now = time.monotonic()
        if any(not w.ready and now >= w.started + IMPORT_TIMEOUT_S for w in self._workers):
            self.close()
            raise ConfigError(f"task.reward = {self.spec!r}: a reward worker process did not finish importing "
                              f"the reward within {IMPORT_TIMEOUT_S:g} s (does the module hang at import?)")
        for w in list(self._workers):
            if w.call is not None and now >= w.call[1]:
                self.timeouts += 1
                self._fail(w, f"RewardTimeout: the call ran past task.reward_timeout = {self.timeout:g} s; "
                              "its worker process was killed and replaced")
        self._dispatch()

    def _receive(self, w: _Worker) -> None:
        try:
            tag, value = w.conn.recv()
        except (EOFError, OSError):  # the worker died (a crash in native code, os._exit, OOM kill)
            w.proc.join(timeout=1.0)  # the pipe closes before the process is reaped: exitcode would read None
            code = w.proc.exitcode
            if not w.ready:
                self._replace(w)
                raise ConfigError(f"task.reward = {self.spec!r}: the reward worker process exited with code "
                                  f"{code} while importing the reward") from None
            self._fail(w, f"RewardWorkerDied: the worker process exited with code {code} during this call")
            return
        if tag == "ready":
            w.ready = True
        elif tag == "failed":
            self.close()
            raise ConfigError(f"task.reward = {self.spec!r}: a reward worker process could not load it ({value})")
        else:
            self._store(tag, value)
            w.call = None

    def _store(self, call_id: int, outcome: RewardOutcome) -> None:
        if call_id in self._dropped:
            self._dropped.discard(call_id)
        else:
            self._outcomes[call_id] = outcome

    def _fail(self, w: _Worker, why: str) -> None:
        call_id = w.call[0]
        self._replace(w)
        self._store(call_id, RewardOutcome(error=why + "\n"))

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._workers[self._workers.index(w)] = _Worker(self._ctx, self.spec)

    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._queue:
                return
            if w.ready and w.call is None:
                call_id, call = self._queue.popleft()
                try:
                    w.conn.send((call_id, call))
                except OSError:  # the idle worker died (an OOM kill, say): replace it, the call waits for a worker
                    self._queue.appendleft((call_id, call))
                    self._replace(w)
                    continue
                w.call = (call_id, time.monotonic() + self.timeout)


def make_runner(reward_fn: RewardFn, spec: str, *, workers: int, timeout: float):
    """InlineRunner (workers = 0) or a RewardPool over the importable spec of `reward_fn`.

    `spec` is task.reward ("" = the task's own reward). A pool needs the function importable in a
    child process: a plugin spec, a built-in, or a module-level registered function; a closure or
    a function defined in __main__ is a ConfigError (use task.reward_workers = 0 for those).
    """
    if workers == 0:
        return InlineRunner(reward_fn)
    child_spec = spec if ":" in spec else importable_spec(reward_fn)
    if child_spec is None:
        raise ConfigError(f"task.reward_workers = {workers}: the reward {spec or reward_fn!r} cannot be imported "
                          "in a worker process (a lambda, closure or __main__ function); make it a module-level "
                          "function and name it task.reward = 'module:function', or set task.reward_workers = 0")
    return RewardPool(child_spec, workers=workers, timeout=timeout)

"""The tool environment: a model turn's calls run (off the decode loop), their results come back as an observation.

ToolBox is what the trajectories of one job share: the tools (tools.py), the call format
(tool_calls.py), the task's reward, the per-call timeout and the counts; calling it with a prompt row
makes that trajectory's ToolEnv (the driver's make_env). Each model turn:
- no call: the turn is the final answer; End(task reward of its text);
- calls: each is checked (a known tool, arguments that fit its schema); the good ones run one after the
  other on a thread (pending.py: the trajectory waits, the others decode), and every result, error or
  bad call comes back in one observation. Nothing the model or a tool does raises: a BadCall, an unknown
  tool, arguments that do not fit, a tool that raises or returns something that is not text or JSON is
  an error observation counted in tool_errors; a turn past timeout_s per call is tool_timeouts.
Counts (running totals, TrajectoryDriver.counts): tool_calls, tool_errors, tool_timeouts, tool_seconds,
tool_trajectories (ended: by an answer or a limit);
all are updated on the rollout thread (the work thread only returns its numbers).
"""

from __future__ import annotations

import json
import time
from collections import Counter

from rlengine.rl.env.api import End, Environment, ModelTurn
from rlengine.rl.env.pending import Pending
from rlengine.rl.env.tool_calls import BadCall, ToolCall
from rlengine.rl.env.tools import Tool


class ToolBox:
    """The shared part of a job's tool trajectories; ToolBox(...)(problem) -> ToolEnv."""

    def __init__(self, tools: list[Tool], fmt, reward_fn, *, timeout_s: float = 5.0, counts: Counter | None = None):
        self.tools = {t.name: t for t in tools}
        self.fmt, self.reward_fn, self.timeout_s = fmt, reward_fn, timeout_s
        self.counts = counts if counts is not None else Counter()

    def __call__(self, problem) -> "ToolEnv":
        return ToolEnv(problem, self)

    @property
    def schemas(self) -> list[dict]:
        """The tools' schemas, as chat templates take them (apply_chat_template(tools=...))."""
        return [t.schema for t in self.tools.values()]

    def prepare(self, call: ToolCall | BadCall) -> tuple[Tool, dict] | str:
        """(tool, arguments) ready to run, or the error text of a call that cannot."""
        if isinstance(call, BadCall):
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(self.tools)}"
        args = call.args
        if isinstance(args, list):  # compact positional arguments, in schema order, typed from their text
            if len(args) > len(tool.params):
                return f"error: {tool.name} takes {len(tool.params)} arguments"
            args = dict(zip(tool.params, args))
        if self.fmt.name == "compact":
            props = tool.schema["function"]["parameters"]["properties"]
            args = {k: _typed(v, props.get(k, {})) for k, v in args.items()}
        why = tool.check_args(args)
        return f"error: {why}" if why else (tool, args)

    def score(self, problem, text: str) -> float:
        try:
            r = self.reward_fn(text, problem.answer, problem.prompt, dict(problem.extra))
            return float(r["score"] if isinstance(r, dict) else r)
        except Exception:  # noqa: BLE001 - counted; the trajectory scores 0
            self.counts["reward_errors"] += 1
            return 0.0


def _typed(text, spec: dict):
    if not isinstance(text, str):
        return text
    kind = spec.get("type", "string")
    try:
        return int(text) if kind == "integer" else float(text) if kind == "number" else text
    except ValueError:
        return text  # check_args names the mismatch


def run_calls(problem, ready: list) -> tuple[list[str], int, float]:
    """Run the prepared calls in order (on the work thread): (result texts, errors, seconds)."""
    results, errors, seconds = [], 0, 0.0
    for item in ready:
        if isinstance(item, str):
            results.append(item)
            continue
        tool, args = item
        t0 = time.perf_counter()
        try:
            out = tool.fn(problem, **args) if tool.needs_problem else tool.fn(**args)
            results.append(out if isinstance(out, str) else json.dumps(out))
        except Exception as exc:  # noqa: BLE001 - a tool's failure is the model's observation
            errors += 1
            results.append(f"error: {type(exc).__name__}: {exc}")
        seconds += time.perf_counter() - t0
    return results, errors, seconds


class ToolEnv(Environment):
    """One trajectory with tools."""

    def __init__(self, problem, box: ToolBox):
        super().__init__(problem)
        self.box = box
        self.calls = 0

    def step(self, turn: ModelTurn):
        box = self.box
        calls = box.fmt.parse(turn.text)
        if not calls:
            box.counts["tool_trajectories"] += 1
            return End(box.score(self.problem, box.fmt.answer(turn.text)), {"tool_calls": self.calls})
        self.calls += len(calls)
        ready = [box.prepare(c) for c in calls]
        bad = sum(isinstance(r, str) for r in ready)
        box.counts["tool_calls"] += len(calls)
        box.counts["tool_errors"] += bad
        if bad == len(ready):  # nothing to run: answer at once
            return box.fmt.observation(ready)
        timeout = box.timeout_s * (len(ready) - bad)
        return Pending(lambda: run_calls(self.problem, ready), then=self._done, timeout_s=timeout,
                       on_timeout=lambda: self._timed_out(len(ready), timeout))

    def on_cut(self, reason: str) -> float:
        self.box.counts["tool_trajectories"] += 1
        return 0.0

    def _done(self, out) -> str:
        results, errors, seconds = out
        self.box.counts["tool_errors"] += errors
        self.box.counts["tool_seconds"] += seconds
        return self.box.fmt.observation(results)

    def _timed_out(self, n: int, timeout: float) -> str:
        self.box.counts["tool_timeouts"] += 1
        self.box.counts["tool_seconds"] += timeout
        return self.box.fmt.observation([f"error: timed out after {timeout:g} s"] * n)

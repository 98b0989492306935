"""TrajectoryDriver: environments <-> the engine's waiting trajectories, with the limits and their counts.

The rollout loop calls advance(llm) after every engine step. Each model turn that ended (LLM.take_turns)
goes to its trajectory's environment (rl/env/api.py); an observation is appended to the sequence still
resident in the engine (LLM.continue_turn: one chunk prefill, the history stays cached), an End or a
limit ends it (LLM.end_trajectory). The record kept per trajectory is what the learner packs: every
token after the prompt with its role (1 model, 0 observation), behaviour log-probs on model tokens
(0.0 on observation tokens, which the loss mask leaves out), the weight versions of model tokens, the
turn-by-turn segments samples.jsonl shows, and the reward.
Limits (TrajectoryLimits): model turns, tokens per model turn, tokens per observation, tokens per
trajectory (after the prompt), and the engine's max_model_len. An observation longer than its limit is
CUT to it and counted (obs_truncated), never refused: tool output is often long. Each limit that ends
a trajectory is counted under its reason (cut_max_turns, cut_max_total_tokens, cut_max_model_len).
An environment may answer with a Pending (rl/env/pending.py: a tool call on its own thread): the
trajectory stays parked and is polled after every engine step while the others decode; when the engine
has nothing else to run, advance() waits briefly for a result instead of spinning.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field

from rlengine.model.config import ConfigError
from rlengine.rl.env.api import Environment, EnvError, ModelTurn, as_action
from rlengine.rl.env.pending import Pending


@dataclass(frozen=True, slots=True, kw_only=True)
class TrajectoryLimits:
    """Where a trajectory is cut (each cut counted with its reason)."""

    max_turns: int = 4              # model turns per trajectory
    max_turn_tokens: int = 64       # tokens per model turn (the engine's max_tokens of each turn)
    max_obs_tokens: int = 256       # tokens per observation; longer ones are cut to it (counted)
    max_total_tokens: int = 1024    # model + observation tokens per trajectory, prompt excluded

    def __post_init__(self):
        for name in ("max_turns", "max_turn_tokens", "max_obs_tokens", "max_total_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ConfigError(f"env.{name} must be an integer >= 1, got {getattr(self, name)!r}")


@dataclass(slots=True)
class Trajectory:
    """One trajectory after its prompt: tokens with roles, behaviour log-probs, turns, reward."""

    env: Environment
    tokens: list[int] = field(default_factory=list)      # [L] every token after the prompt
    roles: list[int] = field(default_factory=list)       # [L] 1 model, 0 observation
    logprobs: list[float] = field(default_factory=list)  # [L] behaviour log-probs, 0.0 on observation tokens
    versions: list[int] = field(default_factory=list)    # weight version of each MODEL token
    segments: list[tuple[str, int, int]] = field(default_factory=list)  # (role, start, end) in tokens
    turns: int = 0                                       # model turns
    reward: float = 0.0
    end_reason: str = ""                                 # "env" or the limit that cut it
    finish_reason: str = "stop"                          # the last model turn's ("stop" | "length")
    info: dict = field(default_factory=dict)             # End.info
    obs_truncated: int = 0                               # observations cut to max_obs_tokens


class TrajectoryDriver:
    """The live trajectories of one engine, keyed by (request id, sample index)."""

    def __init__(self, make_env, tokenizer, limits: TrajectoryLimits, name: str = "env", counts: Counter | None = None):
        """counts: a Counter shared with the environments (a ToolBox's tool_* counts), or a new one."""
        self.make_env, self.tok, self.limits, self.name = make_env, tokenizer, limits, name
        self.live: dict[tuple[str, int], Trajectory] = {}
        self.done: dict[str, dict[int, Trajectory]] = {}
        self.waiting: dict[tuple[str, int], tuple[Pending, int, str]] = {}  # Pending answers: (it, room, where)
        self.counts: Counter = counts if counts is not None else Counter()  # cut_<reason>, obs_truncated, ...
        self._last: Counter = Counter()  # counts at the last snapshot()

    def add(self, request_id: str, n: int, problem) -> None:
        """n trajectories of one prompt row (a request of n samples), each with its own environment."""
        for i in range(n):
            self.live[(request_id, i)] = Trajectory(self.make_env(problem))

    def first_turn(self, params):
        """The request's SamplingParams with the first turn's token limit."""
        cap = min(self.limits.max_turn_tokens, self.limits.max_total_tokens)
        return dataclasses.replace(params, max_tokens=cap)

    def advance(self, llm) -> None:
        """Hand every ended model turn to its environment; continue or end each trajectory."""
        self._poll(llm)
        for turn in llm.take_turns():
            key = (turn.request_id, turn.index)
            traj = self.live[key]
            start = len(traj.tokens)
            traj.tokens += turn.token_ids
            traj.roles += [1] * len(turn.token_ids)
            traj.logprobs += turn.logprobs
            traj.versions += turn.versions
            traj.segments.append(("model", start, len(traj.tokens)))
            traj.finish_reason = turn.finish_reason
            traj.turns += 1
            where = f"{self.name}: {type(traj.env).__name__}.step (turn {traj.turns})"
            text = self.tok.decode(turn.token_ids) if self.tok is not None else ""
            result = traj.env.step(ModelTurn(traj.turns - 1, turn.token_ids, text, turn.finish_reason))
            if isinstance(result, Pending):
                self.waiting[key] = (result, turn.room, where)
            else:
                self._answer(llm, key, traj, result, turn.room, where)
        if self.waiting and not llm.core.has_work:  # only tools are running: wait for one, do not spin
            min(self.waiting.values(), key=lambda w: w[0].deadline)[0].wait(0.01)
            self._poll(llm)

    def _poll(self, llm) -> None:
        for key, (pending, room, where) in list(self.waiting.items()):
            result = pending.poll()
            if result is not None:
                del self.waiting[key]
                self._answer(llm, key, self.live[key], result, room, where)

    def _answer(self, llm, key, traj: Trajectory, result, room: int, where: str) -> None:
        """Apply an environment's answer: append the observation and continue, or end the trajectory."""
        kind, value, info = as_action(result, self._encode, where)
        if kind == "end":
            traj.reward, traj.info, traj.end_reason = value, info, "env"
            self._end(llm, key, traj)
            return
        obs = value
        if len(obs) > self.limits.max_obs_tokens:
            obs = obs[:self.limits.max_obs_tokens]
            traj.obs_truncated += 1
            self.counts["obs_truncated"] += 1
        budget = min(self.limits.max_total_tokens - len(traj.tokens) - len(obs), room - len(obs))
        reason = ("max_turns" if traj.turns >= self.limits.max_turns else
                  "max_model_len" if room - len(obs) < 1 else
                  "max_total_tokens" if budget < 1 else None)
        if reason is not None:
            traj.reward, traj.end_reason = float(traj.env.on_cut(reason)), reason
            self.counts[f"cut_{reason}"] += 1
            self._end(llm, key, traj)
            return
        try:  # token ids outside the vocabulary: the trajectory stays waiting, the run stops with one line
            llm.continue_turn(key[0], key[1], obs, min(self.limits.max_turn_tokens, budget))
        except ValueError as exc:
            raise EnvError(f"{where}: its observation was refused: {exc}") from None
        s = len(traj.tokens)
        traj.tokens += obs
        traj.roles += [0] * len(obs)
        traj.logprobs += [0.0] * len(obs)
        traj.segments.append(("observation", s, len(traj.tokens)))

    def snapshot(self) -> dict:
        """The running counts, plus tools/<name>: each tool_* count's change since the last snapshot (an update's)."""
        out = dict(self.counts)
        for k, v in self.counts.items():
            if k.startswith("tool_"):
                out[f"tools/{k[5:]}"] = v - self._last[k]
        self._last = Counter(self.counts)
        return out

    def _encode(self, text: str) -> list[int]:
        if self.tok is None:
            raise ConfigError(f"{self.name}: an environment returned text, and this engine has no tokenizer")
        return self.tok.encode(text)

    def _end(self, llm, key: tuple[str, int], traj: Trajectory) -> None:
        del self.live[key]
        self.done.setdefault(key[0], {})[key[1]] = traj
        llm.end_trajectory(*key)

    def pop(self, request_id: str) -> list[Trajectory]:
        """The ended trajectories of a finished request, in sample order."""
        done = self.done.pop(request_id)
        return [done[i] for i in sorted(done)]

    def drop(self, request_id: str) -> int:
        """Forget a request's trajectories (aborted in flight: stale, a checkpoint boundary); counted."""
        keys = [k for k in self.live if k[0] == request_id]
        for k in keys:
            del self.live[k]
            self.waiting.pop(k, None)  # a tool still running: its result is dropped
        n = len(keys) + len(self.done.pop(request_id, {}))
        self.counts["dropped_in_flight"] += n
        return n

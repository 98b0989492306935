"""The environment API of multi-turn rollouts: what a user writes, and how it is loaded.

One Environment object per trajectory, made from the trajectory's prompt row (`Name(problem)`, a
data.tasks.Problem: prompt, answer, extra). After every model turn it gets a ModelTurn (token ids
and their text) and returns what comes next:
- an observation to append: token ids (list[int], the core: no text round trip), text (str,
  encoded with the run's tokenizer, no special tokens added), or Observation(token_ids= / text=);
- End(reward): the episode is over, with its reward.
Anything else stops the run with EnvError (a ConfigError: one line, exit 2). When a limit ends a
trajectory first (rl/env/driver.py: turns, tokens, max_model_len) the environment's on_cut(reason)
gives its reward (default 0.0). User environments load from "package.module:Name", as reward plugins
do (data/rewards.load_plugin). step() runs on the rollout loop's thread, between engine steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlengine.model.config import ConfigError
from rlengine.rl.data.rewards import import_object


class EnvError(ConfigError):
    """An environment that cannot load, or returned something outside the contract."""


@dataclass(frozen=True, slots=True)
class ModelTurn:
    """One model turn, as the environment receives it."""

    index: int                  # 0 for the first model turn of the trajectory
    token_ids: list[int]        # the turn's sampled tokens (its stop token included)
    text: str                   # their text (special tokens skipped)
    finish_reason: str          # "stop" (a stop / EOS token) | "length" (the turn's token limit)


@dataclass(frozen=True, slots=True)
class Observation:
    """An observation to append: token ids, or text the rollout encodes."""

    token_ids: list[int] | None = None
    text: str | None = None


@dataclass(frozen=True, slots=True)
class End:
    """The episode is over."""

    reward: float
    info: dict = field(default_factory=dict)  # free-form, shown in samples.jsonl


class Environment:
    """Base class of an environment: one trajectory, made from its prompt row."""

    def __init__(self, problem):
        self.problem = problem  # data.tasks.Problem: prompt, answer, source, extra

    def step(self, turn: ModelTurn) -> list[int] | str | Observation | End:
        raise NotImplementedError

    def on_cut(self, reason: str) -> float:
        """A limit ended the trajectory ("max_turns", "max_total_tokens", "max_model_len"): its reward."""
        return 0.0


def as_action(result, encode, where: str) -> tuple[str, list[int] | float, dict]:
    """An environment's return -> ("obs", token ids, {}) | ("end", reward, info); EnvError otherwise."""
    if isinstance(result, End):
        if isinstance(result.reward, bool) or not isinstance(result.reward, (int, float)):
            raise EnvError(f"{where}: End.reward must be a number, got {type(result.reward).__name__}")
        return "end", float(result.reward), dict(result.info)
    if isinstance(result, Observation):
        if (result.token_ids is None) == (result.text is None):
            raise EnvError(f"{where}: an Observation has token_ids or text, exactly one")
        result = result.token_ids if result.token_ids is not None else result.text
    if isinstance(result, str):
        return "obs", list(encode(result)), {}
    if isinstance(result, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in result):
        return "obs", list(result), {}
    raise EnvError(f"{where}: step() returned {type(result).__name__}; an environment returns token ids "
                   "(list[int]), text (str), Observation or End(reward)")


def load_environment(spec: str):
    """The environment class (or factory) named "package.module:Name"; EnvError naming the spec otherwise."""
    where = f"env = {spec!r}"
    obj = import_object(spec, where, EnvError, what="Name")
    if not callable(obj):
        raise EnvError(f"{where}: {spec.partition(':')[2]!r} is a {type(obj).__name__}, not a class or callable")
    return obj

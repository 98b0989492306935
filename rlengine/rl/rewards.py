"""Reward functions, their registry, and the scorer that bounds how often they may fail.

A reward function maps (completion text, reference answer) -> float. Built-ins: exact match
on the first answer token run ("exact"), and a math-answer reward built on math-verify
("math"), which parses both sides and checks mathematical equivalence (so "0.5" matches
"\\frac{1}{2}"). Register custom ones with @register_reward("name"); a reward that needs an
optional package names it (requires=(module, pip name)) and get_reward checks it is
importable, so a missing package stops the run at start instead of scoring every response 0.
All scoring goes through a RewardScorer, one per batch (a collect() call, one evaluation): a
call that raises or returns a non-finite value scores 0.0 and is counted; above
max_error_frac of the batch the scorer raises RewardError with the first traceback.
"""

from __future__ import annotations

import importlib.util
import math
import traceback
from typing import TYPE_CHECKING, Callable

from rlengine.config import ConfigError

if TYPE_CHECKING:
    from rlengine.engine.outputs import RequestOutput
    from rlengine.model.tokenizer import Tokenizer
    from rlengine.rl.tasks import Problem

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}
REQUIRES: dict[str, tuple[str, str]] = {}    # reward name -> (module it imports, package to pip install)


class RewardError(RuntimeError):
    """More reward calls of one batch failed than task.max_reward_error_frac allows."""


def register_reward(name: str, *, requires: tuple[str, str] | None = None):
    """Decorator: make `fn(completion, answer) -> float` available as task.reward = name.

    requires = (module, pip name) of an optional package the function imports when called.
    """
    def wrap(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        if requires is not None:
            REQUIRES[name] = requires
        else:
            REQUIRES.pop(name, None)
        return fn
    return wrap


def get_reward(name: str) -> RewardFn:
    """The registered reward `name`; ConfigError when it is unknown or its package is missing."""
    if name not in REWARDS:
        raise ConfigError(f"unknown reward {name!r}; registered: {', '.join(sorted(REWARDS))}")
    if name in REQUIRES:
        module, pip_name = REQUIRES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"reward {name!r} needs the {pip_name} package ({module} is not importable); "
                              f"install it with `pip install {pip_name}`")
    return REWARDS[name]


class RewardScorer:
    """Scores responses with one reward function and counts the calls that fail.

    A failure (an exception, or a non-finite return value) scores 0.0; the first one's
    formatted traceback is kept for the error message. check() raises RewardError when
    errors / total > max_error_frac. Use one scorer per batch.
    """

    def __init__(self, reward_fn: RewardFn, max_error_frac: float):
        self.reward_fn = reward_fn
        self.max_error_frac = max_error_frac
        self.total = 0
        self.errors = 0
        self.first_error = ""          # formatted traceback of the first failure

    def score(self, completion: str, answer: str) -> float:
        self.total += 1
        try:
            reward = float(self.reward_fn(completion, answer))
            if not math.isfinite(reward):
                raise ValueError(f"reward function returned a non-finite value ({reward})")
        except Exception:  # noqa: BLE001 - any failure of user code is counted, bounded and reported
            self.errors += 1
            if not self.first_error:
                self.first_error = traceback.format_exc()
            return 0.0
        return reward

    @property
    def error_frac(self) -> float:
        return self.errors / self.total if self.total else 0.0

    def merge_ranks(self, dist) -> None:
        """Sum the counts of every rank (a Dist; all ranks call it) and keep the first rank's first
        traceback, so every rank decides alike and the failing rank's traceback is the one reported."""
        if dist is None or not dist.enabled:
            return
        parts = dist.all_gather_objects((self.errors, self.total, self.first_error))
        self.errors, self.total = sum(p[0] for p in parts), sum(p[1] for p in parts)
        self.first_error = next((p[2] for p in parts if p[2]), self.first_error)

    def check(self, where: str) -> None:
        """Raise RewardError when this batch's failure fraction is above the limit."""
        if self.error_frac > self.max_error_frac:
            raise RewardError(
                f"{where}: {self.errors} of {self.total} reward calls failed ({self.error_frac:.2%}), above "
                f"task.max_reward_error_frac = {self.max_error_frac}; the first failure was:\n{self.first_error}")


def score_outputs(reward_fn: RewardFn, tokenizer: Tokenizer, problems: list[Problem], outputs: list[RequestOutput],
                  max_error_frac: float, where: str = "evaluation", dist=None) -> tuple[float, int]:
    """Mean reward over every sample of `outputs` (outputs[i] answers problems[i]) and the failure count.

    With a multi-rank `dist` (rlengine.rl.distributed.Dist), each rank passes its shard and gets the
    global mean and count. Raises RewardError when more than max_error_frac of the calls failed.
    """
    if len(problems) != len(outputs):
        raise ValueError(f"score_outputs: {len(outputs)} outputs for {len(problems)} problems")
    scorer = RewardScorer(reward_fn, max_error_frac)
    total = 0.0
    for problem, out in zip(problems, outputs):
        for c in out.outputs:
            total += scorer.score(tokenizer.decode(c.token_ids), problem.answer)
    if dist is not None and dist.enabled:
        total = dist.all_sum([total])[0]
        scorer.merge_ranks(dist)
    scorer.check(where)
    return total / max(1, scorer.total), scorer.errors


@register_reward("exact")
def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion (whitespace-stripped) equals the answer, else 0.0."""
    return float(completion.strip() == answer.strip())


@register_reward("math", requires=("math_verify", "math-verify"))
def math_answer(completion: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's final answer equivalent to the reference."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(completion)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred))

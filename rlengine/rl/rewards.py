"""Reward functions and their registry.

A reward function maps (completion text, reference answer) -> float. Built-ins: exact match
on the first answer token run ("exact"), and a math-answer reward built on math-verify
("math"), which parses both sides and checks mathematical equivalence (so "0.5" matches
"\\frac{1}{2}"). Register custom ones with @register_reward("name"). A reward function that
raises is the trainer's business: it counts and logs the failure and scores the response 0.
"""

from __future__ import annotations

from typing import Callable

RewardFn = Callable[[str, str], float]
REWARDS: dict[str, RewardFn] = {}


def register_reward(name: str):
    """Decorator: make `fn(completion, answer) -> float` available as task.reward = name."""
    def wrap(fn: RewardFn) -> RewardFn:
        REWARDS[name] = fn
        return fn
    return wrap


def get_reward(name: str) -> RewardFn:
    if name not in REWARDS:
        raise KeyError(f"unknown reward {name!r}; registered: {', '.join(sorted(REWARDS))}")
    return REWARDS[name]


@register_reward("exact")
def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion (whitespace-stripped) equals the answer, else 0.0."""
    return float(completion.strip() == answer.strip())


@register_reward("math")
def math_answer(completion: str, answer: str) -> float:
    """1.0 when math-verify finds the completion's final answer equivalent to the reference."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(completion)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred))

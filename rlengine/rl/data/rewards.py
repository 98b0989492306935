"""Reward functions: the registry, user plugins, and one call's outcome.

A reward maps one response to a score. Built-ins (registered names): "exact" (the stripped
completion equals the answer), "positions" (partial credit: the fraction of answer positions the
completion gets right, for the long digit-string tasks), "math" (math-verify parses both sides and checks mathematical
equivalence, so "0.5" matches "\\frac{1}{2}") and "format" (1.0 when the completion states a
final answer in a recognised format, \\boxed{...} or a GSM8K "#### N" line). Plugins:
task.reward = "package.module:function" imports the function (importlib, never eval), with the
documented signature

    fn(completion: str, answer: str, prompt: str, extra: dict) -> float | dict

(a dict must hold "score"; its other numeric keys are logged as reward components
reward/<key>). A two-argument fn(completion, answer) is accepted too (the registry's older
contract). Loading fails with a ConfigError naming the spec. A registered reward that needs an
optional package names it (requires=(module, pip name)) and get_reward checks it is importable,
so a missing package stops the run at start instead of scoring every response 0.
call_reward turns one call into a RewardOutcome (a score, or the failure's traceback); scoring.py
counts a batch's outcomes and bounds its failures, reward_pool.py runs calls in worker processes.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import re
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

from rlengine.model.config import ConfigError

RewardFn = Callable[..., Any]   # fn(completion, answer[, prompt, extra]) -> float | {"score": float, ...}
REWARDS: dict[str, RewardFn] = {}
REQUIRES: dict[str, tuple[str, str]] = {}    # reward name -> (module it imports, package to pip install)


class RewardError(RuntimeError):
    """More reward calls of one batch failed than task.max_reward_error_frac allows."""


def register_reward(name: str, *, requires: tuple[str, str] | None = None):
    """Decorator: make `fn(completion, answer[, prompt, extra]) -> float` available as task.reward = name.

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
        raise ConfigError(f"unknown reward {name!r}; registered: {', '.join(sorted(REWARDS))}, "
                          "or a plugin 'package.module:function'")
    if name in REQUIRES:
        module, pip_name = REQUIRES[name]
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"reward {name!r} needs the {pip_name} package ({module} is not importable); "
                              f"install it with `pip install {pip_name}`")
    return REWARDS[name]


def import_object(spec: str, where: str, error: type[Exception] = ConfigError, *, what: str = "function"):
    """The object named by `spec` = "package.module:name" (attribute paths "mod:obj.fn" too): reward
    plugins, environments (rl/env/api.py) and tools (rl/env/tools.py) load this way.

    `error` (a ConfigError: one line, exit 2) prefixed with `where` when the spec is malformed, the
    module does not import or the attribute is missing. Imports run the module's top-level code,
    exactly as `import` would.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise error(f"{where}: a plugin is written 'package.module:{what}'")
    try:
        obj = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure of user code is a config error
        raise error(f"{where}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise error(f"{where}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_plugin(spec: str) -> RewardFn:
    """The reward function named by `spec` = "package.module:function"; ConfigError naming the spec when
    it does not import, is missing or is not callable."""
    where = f"task.reward = {spec!r}"
    obj = import_object(spec, where)
    if not callable(obj):
        raise ConfigError(f"{where}: {spec.partition(':')[2]!r} is a {type(obj).__name__}, not a callable")
    return obj


def resolve_reward(spec: str) -> RewardFn:
    """task.reward -> the function: a plugin "module:function" or a registered name."""
    return load_plugin(spec) if ":" in spec else get_reward(spec)


def importable_spec(fn: RewardFn) -> str | None:
    """"module:qualname" under which a child process can import `fn`, or None (a lambda, a closure,
    a function defined in __main__)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not qualname or "<" in qualname:
        return None
    return f"{module}:{qualname}"


@dataclass(slots=True)
class RewardCall:
    """The inputs of one reward call (what a worker process receives)."""

    completion: str                      # decoded response text
    answer: str                          # the problem's reference answer
    prompt: str = ""                     # the problem's prompt text (before any chat template)
    extra: dict = field(default_factory=dict)   # the problem's other fields (JSONL columns)


@dataclass(slots=True)
class RewardOutcome:
    """What one reward call produced: a score, or the failure that scores it 0."""

    score: float = 0.0
    components: dict = field(default_factory=dict)   # other numeric keys of a dict return value
    error: str = ""                      # formatted traceback (or timeout message); "" = success


def _takes_four(fn: RewardFn) -> bool:
    """True when fn accepts (completion, answer, prompt, extra) positionally (the plugin signature)."""
    try:
        inspect.signature(fn).bind("", "", "", {})
    except (TypeError, ValueError):
        return False
    return True


def call_reward(fn: RewardFn, call: RewardCall, four: bool | None = None) -> RewardOutcome:
    """Run fn on one call; any exception or non-finite/ill-formed result becomes a failed outcome."""
    try:
        four = _takes_four(fn) if four is None else four
        value = fn(call.completion, call.answer, call.prompt, call.extra) if four else fn(call.completion, call.answer)
        components = {}
        if isinstance(value, dict):
            if "score" not in value:
                raise ValueError(f"reward function returned a dict without 'score' (keys: {sorted(value)})")
            components = {k: float(v) for k, v in value.items()
                          if k != "score" and isinstance(v, (int, float)) and not isinstance(v, bool)}
            value = value["score"]
        reward = float(value)
        if not math.isfinite(reward):
            raise ValueError(f"reward function returned a non-finite value ({reward})")
    except Exception:  # noqa: BLE001 - any failure of user code is counted, bounded and reported
        return RewardOutcome(error=traceback.format_exc())
    return RewardOutcome(reward, components)


@register_reward("exact")
def exact_match(completion: str, answer: str, prompt: str = "", extra: dict | None = None) -> float:
    """1.0 when the completion (whitespace-stripped) equals the answer, else 0.0."""
    return float(completion.strip() == answer.strip())


@register_reward("positions")
def position_match(completion: str, answer: str, prompt: str = "", extra: dict | None = None) -> float:
    """Partial credit: the number of positions where the (stripped) completion has the answer's
    character, over the longer of the two lengths, in [0, 1]; 1.0 exactly when they are equal. A
    completion too short or too long loses the positions it misses or adds."""
    c, a = completion.strip(), answer.strip()
    if not a and not c:
        return 1.0
    return sum(x == y for x, y in zip(c, a)) / max(len(c), len(a))


@register_reward("math", requires=("math_verify", "math-verify"))
def math_answer(completion: str, answer: str, prompt: str = "", extra: dict | None = None) -> float:
    """1.0 when math-verify finds the completion's final answer equivalent to the reference."""
    from math_verify import parse, verify

    gold = parse(answer if "$" in answer or "\\" in answer else f"${answer}$")
    pred = parse(completion)
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred))


_BOXED = re.compile(r"\\boxed\{\s*[^{}\s][^{}]*\}")
_HASHES = re.compile(r"^\s*####\s*-?[\d,]*\.?\d+\s*$", re.MULTILINE)


@register_reward("format")
def final_answer_format(completion: str, answer: str = "", prompt: str = "", extra: dict | None = None) -> float:
    """1.0 when the completion states a final answer as \\boxed{...} (non-empty) or on a GSM8K line
    "#### N" (N a number, commas allowed), else 0.0. Correctness is not checked: use it beside
    (or instead of, early on) "math" to reward the format the answer is parsed from."""
    return float(bool(_BOXED.search(completion) or _HASHES.search(completion)))


@register_reward("letter-share")
def letter_share(completion: str, answer: str = "", prompt: str = "", extra: dict | None = None) -> float:
    """The share of ASCII letters among the completion's non-space characters (0.0 when it has none): a
    reward that differs between random responses, for jobs that exercise the machinery, not learning."""
    chars = [c for c in completion if not c.isspace()]
    return sum(c.isascii() and c.isalpha() for c in chars) / len(chars) if chars else 0.0

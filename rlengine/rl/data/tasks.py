"""Tasks: prompts with verifiable answers, built-in (procedural) or from JSONL.

A Task holds a train split and a held-out eval split of Problems (prompt text, answer text)
and a reward function. Built-in tasks use the tiny built-in tokenizer's alphabet:
  first-digit  "5830271694:" -> "5" one-token answers; the format warm start teaches "answer
  last-digit   "5830271694:" -> "4" with some digit of the prompt" (about 20% correct), RL
                                     has to find the right one
  addition     "12+34=" -> "46"  (multi-digit arithmetic; harder, for longer runs)
  copy-digits  "58302716...:" -> "58302716..." long answers (24 digits + <eos> = 25 tokens by
  reverse-digits                -> "...61720385"  default): the long-response job, where generation
  shift-digits                  -> "69413827..."  dominates. Trained on per-position partial credit
                                     ("positions"), evaluated by exact match (J); the warm start
                                     answers with prompt digits drawn at random positions, so it
                                     teaches "n prompt digits, then <eos>" but not which ones
                                     (copy-digits: all but the first, the one read from ":")
User data: JSONL with one {"prompt": str, "answer": str} object per line (GSM8K rows,
{"question", "answer": "...#### N"}, map to prompt = question, answer = N: gsm8k_row; a row's
other fields travel as Problem.extra to plugin rewards); a malformed row
(bad JSON, an empty prompt, a non-string answer) is an error naming the file and line number,
and each Problem keeps that origin (`source`) so later checks (Task.check_prompts: prompts
too long for the model) can name the line too. All of this runs before training starts.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Callable
from pathlib import Path

from rlengine.model.config import ConfigError
from rlengine.rl.data.rewards import RewardFn, get_reward, resolve_reward


@dataclass(slots=True, frozen=True)
class Problem:
    prompt: str
    answer: str
    source: str = ""                    # where it came from, "path:line" for JSONL rows; "" for built-ins
    # the row's other fields (JSONL columns; GSM8K's full solution), passed to plugin rewards as `extra`
    extra: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(slots=True)
class Task:
    name: str
    train: list[Problem]
    eval: list[Problem]
    reward_fn: RewardFn
    answer_alphabet: str = "0123456789"   # what the format warm start draws random answers from
    answer_len: int = 1
    # Warm-start answer for a problem, independent of the task's rule (default: random alphabet string).
    format_answer: Callable[[Problem, random.Random], str] | None = None
    # What J (evaluation) scores with when it is not the training reward: the long tasks train on
    # partial credit but J stays the exact-match rate. None = reward_fn.
    eval_reward_fn: RewardFn | None = None
    # Per-token credit (train.credit = "token"): (the response's tokens as text, "" for <eos>; the
    # answer) -> one credit in [0, 1] per token. None: the task has only a sequence reward.
    token_credit: Callable[[list[str], str], list[float]] | None = None

    def warmstart_answer(self, problem: Problem, rng: random.Random) -> str:
        if self.format_answer is not None:
            return self.format_answer(problem, rng)
        return "".join(rng.choice(self.answer_alphabet) for _ in range(self.answer_len))

    def check_prompts(self, encode: Callable[[str], list[int]], max_prompt_tokens: int,
                      limit: str = "max_prompt_tokens") -> None:
        """Raise DatasetError naming every problem (train and eval) whose prompt encodes to no
        tokens or to more than max_prompt_tokens; `limit` says where the bound comes from."""
        found = []
        for split, problems in (("train", self.train), ("eval", self.eval)):
            for i, problem in enumerate(problems):
                n = len(encode(problem.prompt))
                if n == 0 or n > max_prompt_tokens:
                    where = problem.source or f"{self.name} {split}[{i}]"
                    found.append((_file_order(problem.source, split, i),
                                  f"{where}: prompt encodes to no tokens" if n == 0 else
                                  f"{where}: prompt is {n} tokens, more than the {max_prompt_tokens} allowed ({limit})"))
        bad = [msg for _, msg in sorted(found)]  # in file order: the split shuffled the rows
        if bad:
            more = f"\n(and {len(bad) - 5} more)" if len(bad) > 5 else ""
            raise DatasetError(f"{len(bad)} prompt(s) do not fit the model, first {bad[0]}:\n" + "\n".join(bad[:5])
                               + more)


def _file_order(source: str, split: str, index: int) -> tuple:
    """Sort key of a problem: (path, line) for a JSONL row ("path:line"), after them (split, index)."""
    path, _, line = source.rpartition(":")
    if path and line.isdigit():
        return (0, path, int(line), "", 0)
    return (1, "", 0, split, index)


def _random_prompt_digit(problem: Problem, rng: random.Random) -> str:
    """A digit of the prompt at a uniformly random position: format + "copy some digit", not the rule."""
    return rng.choice([ch for ch in problem.prompt if ch.isdigit()])


def _random_prompt_digits(problem: Problem, rng: random.Random) -> str:
    """As many digits as the answer has, each one of the prompt's digits at a uniformly random position:
    the long tasks' format (length, alphabet, <eos>) without their rule."""
    digits = [ch for ch in problem.prompt if ch.isdigit()]
    return "".join(rng.choice(digits) for _ in problem.answer)


def _first_digit_then_random(problem: Problem, rng: random.Random) -> str:
    """copy-digits' warm-start answer: the answer's first digit, then prompt digits at random positions.
    The first digit is the only one read from ":" rather than from a digit the copy rule already
    reads; left to RL, that read sharpened onto a wrong prompt position on some seeds (all G samples
    agreeing, no signal) while the other 23 slots learned. Exact match after this warm start stays
    at chance: 23 of the 24 digits are still random."""
    digits = [ch for ch in problem.prompt if ch.isdigit()]
    return problem.answer[0] + "".join(rng.choice(digits) for _ in problem.answer[1:])


def position_credit(token_texts: list[str], answer: str) -> list[float]:
    """Credit of each response token of a digit-string task: 1.0 where token t is answer[t], and for
    the <eos> ("") right after the last answer character; 0.0 for a wrong digit or an <eos> too
    early; -1.0 for each token past the answer's <eos> slot (what the answer should not have).
    Together with the empty slots' 0 (grpo_token_advantages), the sum is the exact-match score's
    per-position form: right slots minus extra tokens."""
    n = len(answer)
    return [-1.0 if t > n else float(t < n and text == answer[t] or t == n and text == "")
            for t, text in enumerate(token_texts)]


class DatasetError(ConfigError):
    """A dataset file is missing or has a malformed row (user input: the CLI prints one line)."""


def _split(problems: list[Problem], num_eval: int, seed: int) -> tuple[list[Problem], list[Problem]]:
    rng = random.Random(seed)
    problems = list(problems)
    rng.shuffle(problems)
    if len(problems) <= num_eval:
        raise DatasetError(f"task.num_eval = {num_eval} needs more than {num_eval} problems to hold out an eval "
                           f"split, got {len(problems)}")
    return problems[num_eval:], problems[:num_eval]


def _digit_task(name: str, position: int, num_train: int, num_eval: int, seed: int, digits: int) -> Task:
    rng = random.Random(seed)
    numbers = rng.sample(range(10 ** (digits - 1), 10 ** digits), num_train + num_eval)
    problems = [Problem(f"{n}:", str(n)[position]) for n in numbers]
    train, held = _split(problems, num_eval, seed)
    return Task(name, train, held, get_reward("exact"), format_answer=_random_prompt_digit)


def first_digit_task(num_train: int, num_eval: int, seed: int, digits: int = 10) -> Task:
    return _digit_task("first-digit", 0, num_train, num_eval, seed, digits)


def last_digit_task(num_train: int, num_eval: int, seed: int, digits: int = 10) -> Task:
    return _digit_task("last-digit", -1, num_train, num_eval, seed, digits)


def addition_task(num_train: int, num_eval: int, seed: int, digits: int = 2) -> Task:
    if num_train + num_eval > 100 ** digits:
        raise DatasetError(f"task.num_train + task.num_eval = {num_train + num_eval} is more than the "
                           f"{100 ** digits} distinct {digits}-digit additions")
    rng = random.Random(seed)
    seen, problems = set(), []
    while len(problems) < num_train + num_eval:
        a, b = rng.randrange(10 ** digits), rng.randrange(10 ** digits)
        if (a, b) not in seen:
            seen.add((a, b))
            problems.append(Problem(f"{a}+{b}=", str(a + b)))
    train, held = _split(problems, num_eval, seed)
    return Task("addition", train, held, get_reward("exact"), answer_len=digits + 1)


# Digit-string rules of the long tasks: prompt digits -> answer digits, position by position.
DIGIT_RULES: dict[str, Callable[[str], str]] = {
    "copy-digits": lambda s: s,
    "reverse-digits": lambda s: s[::-1],
    "shift-digits": lambda s: "".join(str((int(c) + 1) % 10) for c in s),
}


def digit_string_task(name: str, num_train: int, num_eval: int, seed: int, digits: int = 24) -> Task:
    """`digits` random digits + ":" -> DIGIT_RULES[name] of them (digits answer tokens + <eos>).

    Reward: "positions" (the fraction of answer positions right, over the longer of answer and
    completion) for training; J: exact match."""
    if name not in DIGIT_RULES:
        raise ConfigError(f"unknown digit-string task {name!r}; known: {', '.join(DIGIT_RULES)}")
    if digits < 1:
        raise ConfigError(f"{name}: digits must be >= 1, got {digits}")
    rng = random.Random(seed)
    seen, problems = set(), []
    while len(problems) < num_train + num_eval:
        s = "".join(rng.choice("0123456789") for _ in range(digits))
        if s not in seen:
            seen.add(s)
            problems.append(Problem(f"{s}:", DIGIT_RULES[name](s)))
    train, held = _split(problems, num_eval, seed)
    return Task(name, train, held, get_reward("positions"), answer_len=digits,
                format_answer=_first_digit_then_random if name == "copy-digits" else _random_prompt_digits,
                eval_reward_fn=get_reward("exact"), token_credit=position_credit)


def gsm8k_row(row: dict) -> dict:
    """GSM8K's shape -> ours: "question" stands in for a missing "prompt", and an answer string with a
    "#### N" line (a GSM8K solution) becomes N (commas dropped: "1,200" -> "1200"), the full solution
    kept as extra["solution"]. Other rows (an answer with nothing after "####" too) pass through unchanged."""
    row = dict(row)
    if "prompt" not in row and isinstance(row.get("question"), str):
        row["prompt"] = row.pop("question")
    answer = row.get("answer")
    final = answer.rsplit("####", 1)[1].strip().replace(",", "") if isinstance(answer, str) and "####" in answer else ""
    if final:  # "####" with nothing after it is no GSM8K solution: the answer stays as written
        row["solution"] = answer
        row["answer"] = final
    return row


def data_path(path: str) -> Path:
    """A dataset path; "rlengine:REL" names a file shipped inside the package (rlengine/REL)."""
    if path.startswith("rlengine:"):
        from importlib import resources

        return Path(str(resources.files("rlengine") / path.removeprefix("rlengine:")))
    return Path(path)


def read_jsonl(path: str | Path) -> list[Problem]:
    """Problems from JSONL; raises DatasetError naming the file and line of any malformed row."""
    path = Path(path)
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory, not a JSONL dataset file")
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); JSONL is UTF-8") from None
    problems = []
    # split on "\n" only: str.splitlines also splits at U+0085, U+2028, ... which JSON strings may hold raw
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else "nested too deeply"
            raise DatasetError(f"{path}:{lineno}: not valid JSON ({reason})") from None
        shape = 'each row must be an object {"prompt": "...", "answer": "..."}'
        if not isinstance(row, dict):
            raise DatasetError(f"{path}:{lineno}: {shape}, got a JSON {type(row).__name__}")
        row = gsm8k_row(row)
        missing = [k for k in ("prompt", "answer") if k not in row]
        if missing:
            raise DatasetError(f"{path}:{lineno}: no {' or '.join(repr(k) for k in missing)}; {shape}")
        if not isinstance(row["prompt"], str):
            raise DatasetError(f"{path}:{lineno}: 'prompt' must be a string, got {type(row['prompt']).__name__}")
        if not row["prompt"].strip():
            raise DatasetError(f"{path}:{lineno}: the prompt is empty")
        answer = row["answer"]
        if not isinstance(answer, str):
            # No silent str(): 0.50 would become "0.5", 1e3 "1000.0", true "True".
            raise DatasetError(f"{path}:{lineno}: 'answer' must be a string, got {type(answer).__name__} "
                               f"{json.dumps(answer)} (write it quoted, as in the file's other rows)")
        extra = {k: v for k, v in row.items() if k not in ("prompt", "answer")}
        problems.append(Problem(row["prompt"], answer, f"{path}:{lineno}", extra))
    if not problems:
        raise DatasetError(f"{path}: no rows")
    return problems


def _call_then_a_visible_digit(problem: Problem, rng: random.Random) -> str:
    """key-lookup's warm-start text after the prompt: the right call, its result, a digit in view."""
    key, decoys = problem.prompt[:2], problem.prompt[3:-1]
    return f"lookup({key})<eos>={problem.answer}{rng.choice(decoys + problem.answer)}"


LOOKUP_KEYS = [a + b for a in "abcdefghijklmnopqrstuvwxyz" for b in "abcdefghijklmnopqrstuvwxyz"]


def lookup_task(num_train: int, num_eval: int, seed: int, decoys: int = 4) -> Task:
    """key-lookup, the built-in tool task (configs/grpo_tools.toml): "qx?3815:" -> call lookup(qx), see "=7",
    answer "7". Each row's table (5 keys, distinct digits; Problem.extra["table"]) is read only by the
    `lookup` tool (rl/env/tools.py); the prompt's digits are the other keys' values, never the answer, so
    without the tool a policy scores at most chance. The warm start answers with a digit in view at random
    (decoys or the tool's result): it teaches the call and the answer format, not which digit."""
    rng = random.Random(seed)
    problems = []
    for _ in range(num_train + num_eval):
        keys = rng.sample(LOOKUP_KEYS, decoys + 1)
        values = rng.sample(range(10), decoys + 1)
        prompt = f"{keys[0]}?{''.join(str(v) for v in values[1:])}:"
        problems.append(Problem(prompt, str(values[0]), extra={"table": dict(zip(keys, values))}))
    train, held = _split(problems, num_eval, seed)
    return Task("key-lookup", train, held, get_reward("exact"), format_answer=_call_then_a_visible_digit)


# what build_task accepts as task.name
TASK_NAMES = ("first-digit", "last-digit", "addition", *DIGIT_RULES, "key-lookup", "jsonl")


def build_task(name: str, *, path: str = "", eval_path: str = "", reward: str = "", num_train: int = 2000,
               num_eval: int = 128, seed: int = 1234) -> Task:
    if name == "first-digit":
        task = first_digit_task(num_train, num_eval, seed)
    elif name == "last-digit":
        task = last_digit_task(num_train, num_eval, seed)
    elif name == "addition":
        task = addition_task(num_train, num_eval, seed)
    elif name in DIGIT_RULES:
        task = digit_string_task(name, num_train, num_eval, seed)
    elif name == "key-lookup":
        task = lookup_task(num_train, num_eval, seed)
    elif name == "jsonl":
        if not path:
            raise DatasetError("task.name = 'jsonl' needs task.path")
        problems = read_jsonl(data_path(path))
        if eval_path:
            train, held = problems, read_jsonl(data_path(eval_path))
        else:
            train, held = _split(problems, min(num_eval, max(1, len(problems) // 5)), seed)
        task = Task("jsonl", train, held, resolve_reward(reward or "math"))
    else:
        raise ConfigError(f"task.name: unknown task {name!r}; known: {', '.join(TASK_NAMES)}")
    if reward:
        task.reward_fn = resolve_reward(reward)
    return task


def assign_token_credits(groups, task: Task, tok) -> None:
    """train.credit = "token": each response token's credit from the task (Task.token_credit), set on
    the groups (RolloutGroup.token_credits) for the per-token GRPO advantages."""
    for g in groups:
        answer = task.train[g.problem_index].answer
        g.token_credits = [task.token_credit([tok.decode([i]) for i in c], answer) for c in g.completions]

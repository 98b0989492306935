"""Rewards that fail: counted and scored 0 within task.max_reward_error_frac, a RewardError with the
first traceback above it (rollout collection and evaluation alike), and a missing optional
package caught when the reward is looked up, not at the first call."""

import importlib.util
import json
import math

import pytest

from rlengine import LLM, SamplingParams
from rlengine.model.config import ConfigError, preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.data import rewards
from rlengine.rl.data.rewards import RewardError, get_reward
from rlengine.rl.data.scoring import RewardScorer, score_outputs
from rlengine.rl.rollout.collector import CollectStats, PrioritySampler, RolloutCollector
from rlengine.rl.data.tasks import Problem, Task, build_task

G, P = 8, 16                    # 128 responses per batch: 1 failure is 0.8% (< 1%), 3 are 2.3%
PROBLEMS = [Problem(f"{i}:", str(i % 10)) for i in range(20)]


def _backend_call(completion):
    # A named frame: it shows up only in the traceback, not in the exception's message.
    raise ConnectionError("reward server down (sentinel-7731)")


def _failing_reward(fail_on: set[int], bad_value=None):
    """Reward that fails on the given (0-based) call numbers: raises, or returns bad_value."""
    calls = {"n": 0}

    def reward(completion, answer):
        n, calls["n"] = calls["n"], calls["n"] + 1
        if n in fail_on:
            if bad_value is None:
                _backend_call(completion)
            return bad_value
        return 1.0 + len(completion)       # >= 1: a 0.0 marks a failed call
    return reward


def _collector(reward_fn, **kw):
    tok = Tokenizer.builtin()
    task = Task("t", PROBLEMS, PROBLEMS[:2], reward_fn)
    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=1), max_num_seqs=G * P, attention_backend="torch")
    # dynamic sampling off, coupled mode: one collect() scores exactly P groups = 128 responses
    return RolloutCollector(llm, tok, task, group_size=G, b_train=G * P, b_gen=G * P,
                            params=SamplingParams(n=G, temperature=1.0, max_tokens=2), sampler=PrioritySampler(20, 0),
                            dynamic_sampling=False, max_lag=0, **kw)


def test_one_failure_in_128_is_counted_and_scores_zero():
    stats = CollectStats()
    groups = _collector(_failing_reward({5})).collect(stats)
    assert sum(len(g.rewards) for g in groups) == 128
    assert stats.reward_errors == 1 and sum(g.reward_errors for g in groups) == 1
    assert [r for g in groups for r in g.rewards].count(0.0) == 1


def test_three_failures_in_128_stop_with_the_first_traceback():
    with pytest.raises(RewardError) as info:
        _collector(_failing_reward({5, 60, 100})).collect(CollectStats())
    msg = str(info.value)
    assert "3 of 128" in msg and "task.max_reward_error_frac = 0.01" in msg
    assert "Traceback (most recent call last)" in msg and "_backend_call" in msg and "sentinel-7731" in msg


def test_limit_is_the_collector_keyword():
    # the same 3 failures pass under a looser limit
    stats = CollectStats()
    _collector(_failing_reward({5, 60, 100}), max_reward_error_frac=0.05).collect(stats)
    assert stats.reward_errors == 3


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_reward_is_an_error(bad):
    stats = CollectStats()
    groups = _collector(_failing_reward({7}, bad)).collect(stats)
    assert stats.reward_errors == 1
    assert all(math.isfinite(r) for g in groups for r in g.rewards)
    with pytest.raises(RewardError, match="non-finite"):
        _collector(_failing_reward({1, 2, 3}, bad)).collect(CollectStats())


@pytest.fixture(scope="module")
def eval_outputs():
    tok = Tokenizer.builtin()
    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=2), max_num_seqs=G * P, attention_backend="torch")
    problems = PROBLEMS[:P]
    outs = llm.generate([tok.encode(p.prompt) for p in problems], SamplingParams(n=G, seed=0, max_tokens=3))
    return tok, problems, outs


def test_evaluation_scores_through_the_same_limit(eval_outputs):
    tok, problems, outs = eval_outputs
    texts = [tok.decode(c.token_ids) for out in outs for c in out.outputs]
    assert len(texts) == 128
    # reference: the plain loop, with call 5 scoring 0
    expected = sum(0.0 if i == 5 else 1.0 + len(t) for i, t in enumerate(texts)) / 128
    mean, errors = score_outputs(_failing_reward({5}), tok, problems, outs, 0.01)
    assert errors == 1 and mean == pytest.approx(expected, rel=1e-12)
    with pytest.raises(RewardError, match="evaluation: 3 of 128") as info:
        score_outputs(_failing_reward({5, 60, 100}), tok, problems, outs, 0.01)
    assert "sentinel-7731" in str(info.value) and "_backend_call" in str(info.value)
    _, errors = score_outputs(_failing_reward({9}, math.nan), tok, problems, outs, 0.01)
    assert errors == 1


def test_scorer_boundary_and_zero_limit():
    scorer = RewardScorer(_failing_reward({0}), 0.01)
    for _ in range(100):
        scorer.score("x", "y")
    scorer.check("here")                      # exactly 1% is not above the limit
    scorer.score("x", "y")
    scorer.check("here")
    strict = RewardScorer(_failing_reward({3}), 0.0)
    for _ in range(1000):
        strict.score("x", "y")
    with pytest.raises(RewardError, match="1 of 1000"):
        strict.check("here")
    RewardScorer(_failing_reward(set()), 0.0).check("nothing scored")


def _hide(monkeypatch, module):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


def test_missing_math_verify_fails_at_lookup(monkeypatch, tmp_path):
    _hide(monkeypatch, "math_verify")
    with pytest.raises(ConfigError, match=r"math-verify.*pip install math-verify"):
        get_reward("math")
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}/2=", "answer": str(i / 2)}) + "\n" for i in range(10)))
    with pytest.raises(ConfigError, match="pip install math-verify"):
        build_task("jsonl", path=str(path), num_eval=2)
    # a task that does not use the math reward does not need the package
    assert build_task("jsonl", path=str(path), num_eval=2, reward="exact").reward_fn is rewards.exact_match
    assert get_reward("exact") is rewards.exact_match


def test_requirement_checked_only_when_missing(monkeypatch):
    # control: with the spec lookup answering, the same lookup succeeds (math_verify itself need not be installed)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    assert get_reward("math") is rewards.math_answer
    with pytest.raises(ConfigError, match="unknown reward 'nope'"):
        get_reward("nope")

"""Batch knobs of the RL loop: the LR rule, the priority prompt sampler, dynamic sampling and N."""

import random

import pytest

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.config import TrainSection
from rlengine.rl.rollout.collector import CollectStats, PrioritySampler, RolloutCollector
from rlengine.rl.data.tasks import Problem, Task


@pytest.mark.parametrize("rule,expected", [("sqrt", 2 ** 0.5 * 1e-3), ("linear", 2e-3), ("none", 1e-3)])
def test_lr_rule(rule, expected):
    # eta = eta0 * (B_train / B0)^p: B_train = 32 * 8 = 256 against B0 = 128
    cfg = TrainSection(lr=1e-3, b0=128, prompts_per_step=32, group_size=8, lr_rule=rule)
    assert cfg.b_train == 256
    assert cfg.lr_effective == pytest.approx(expected, rel=1e-12)


def test_priority_sampler_prefers_pass_rate_near_half():
    s = PrioritySampler(3, seed=0)
    for _ in range(20):
        s.update(0, [1.0] * 8)          # always passes
        s.update(1, [1.0, 0.0] * 4)     # passes half the time
        s.update(2, [0.0] * 8)          # always fails
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[s.sample()] += 1
    assert counts[1] > 5 * counts[0] and counts[1] > 5 * counts[2]
    assert min(counts) > 0              # the floor keeps every prompt reachable
    state = s.state_dict()
    again = PrioritySampler(3, seed=99)
    again.load_state_dict(state)
    assert [again.sample() for _ in range(20)] == [s.sample() for _ in range(20)]


def _collector(reward_fn, *, dynamic=True, G=4, P=2):
    tok = Tokenizer.builtin()
    problems = [Problem(f"{i}:", str(i % 10)) for i in range(20)]
    task = Task("t", problems, problems[:2], reward_fn)
    llm = LLM(Qwen3ForCausalLM(preset("tiny"), seed=1), max_num_seqs=G * P, attention_backend="torch")
    return RolloutCollector(llm, tok, task, group_size=G, b_train=G * P, b_gen=G * P,
                            params=SamplingParams(n=G, temperature=1.0, max_tokens=3), sampler=PrioritySampler(20, 0),
                            dynamic_sampling=dynamic, max_lag=0, max_filter_factor=4)


def test_dynamic_sampling_keeps_only_mixed_groups():
    rng = random.Random(0)
    stats = CollectStats()
    groups = _collector(lambda c, a: float(rng.random() < 0.5)).collect(stats)
    assert len(groups) == 2
    assert all(len(set(g.rewards)) > 1 for g in groups)   # every retained group has a learning signal
    assert stats.groups_scored >= 2 and not stats.filter_fallback


def test_dynamic_sampling_gives_up_after_its_budget():
    stats = CollectStats()
    groups = _collector(lambda c, a: 1.0).collect(stats)   # every group all-pass: nothing would be retained
    assert len(groups) == 2 and stats.filter_fallback
    assert stats.groups_dropped == 8                        # max_filter_factor * P groups tried first

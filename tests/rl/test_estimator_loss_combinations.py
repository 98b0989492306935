"""Every advantage estimator x policy loss x critic choice either runs one learner update on a small
batch of real rollouts (finite loss, weights moved) or is refused with one ConfigError line naming the
conflict (train.adv_estimator / train.policy_loss and why); the CLI turns that into exit 2.
An inner span of one response gets loss mask 0 (an observation of a multi-turn trajectory); that the
estimators and losses ignore such tokens is checked against verl in test_verl_parity.py.
"""

import math

import pytest
import torch

from rlengine import LLM
from rlengine.cli import main
from rlengine.model.config import ConfigError, preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.algo.registry import ESTIMATORS, POLICY_LOSSES
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.batching import estimate_batch
from rlengine.rl.learner.learner import Learner
from tests.rl.test_learner import _rollouts

P, G = 3, 3


@pytest.fixture(scope="module")
def rollouts():
    model = Qwen3ForCausalLM(preset("tiny"), seed=5)
    llm = LLM(model, max_num_seqs=16, attention_backend="torch")
    groups = _rollouts(llm, P, G, seed=6)
    gen = torch.Generator().manual_seed(7)
    for g in groups:
        g.rewards = torch.rand(G, generator=gen).tolist()
        g.baseline = 0.5  # the reward of the prompt's greedy response, which remax reads (rollout/baseline.py)
    return model, groups


def _observation_span(batch):
    """Zero the loss mask of an inner span of the longest response (an observation in a trajectory)."""
    lengths = [int(batch.loss_mask[a:e].sum()) for a, e in zip(batch.cu_seqlens, batch.cu_seqlens[1:])]
    b = max(range(len(lengths)), key=lengths.__getitem__)
    e = batch.cu_seqlens[b + 1]
    span = slice(e - lengths[b] + 1, e - lengths[b] + 3) if lengths[b] >= 4 else slice(0, 0)
    batch.loss_mask[span] = 0.0
    return span


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("loss", list(POLICY_LOSSES))
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_combination_runs_one_update_or_names_the_conflict(rollouts, estimator, loss, algo):
    model0, groups = rollouts
    extra = {"dro_beta": 0.1} if loss == "dro" else {}
    try:
        t = TrainSection(algo=algo, adv_estimator=estimator, policy_loss=loss, prompts_per_step=P, group_size=G,
                         lr=1e-2, **extra)
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and "train.adv_estimator" in msg
        assert ESTIMATORS[estimator].critic != (algo == "ppo") or ESTIMATORS[estimator].needs
        return
    assert t.algorithm.estimator_name == estimator and t.algorithm.loss_name == loss
    model = Qwen3ForCausalLM(preset("tiny"), seed=5)
    model.load_state_dict(model0.state_dict())
    batch = estimate_batch(groups, t.algorithm.estimator, t)
    _observation_span(batch)
    learner = Learner(model, t)
    before = [p.detach().clone() for p in model.parameters()]
    metrics = learner.step(batch)
    assert math.isfinite(metrics["loss"]) and not metrics["skipped"]
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_the_cli_refuses_a_conflict_with_exit_2_and_one_line(capsys):
    assert main(["config", "show", "--train.adv_estimator", "gae"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "train.adv_estimator = 'gae' needs a critic" in last


def test_config_show_lists_each_shorthands_combination(capsys):
    assert main(["config", "show"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if "train.algo " in x)
    assert "grpo = grpo + vanilla, no critic" in line and "ppo = gae + vanilla + critic" in line

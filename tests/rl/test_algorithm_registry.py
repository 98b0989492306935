"""The algorithm registry: an algorithm registered from outside the package runs an update, unknown and
misplaced options are refused, and no code below the registry branches on the algorithm's name."""

import re
from pathlib import Path

import pytest
import torch

from rlengine.model.config import ConfigError
from rlengine.rl.algo import registry
from rlengine.rl.algo.registry import ALGORITHMS, ESTIMATORS, Algorithm, algorithm, register_algorithm, register_estimator
from rlengine.rl.trainer import Trainer

from tests.support.short_runs import short_run_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def leave_one_out():
    """An RLOO-style estimator and an algorithm over it, registered here and removed after the test."""
    calls = []

    @register_estimator("test_leave_one_out")
    def loo(rewards_PG, opts):
        calls.append(rewards_PG.clone())
        G = rewards_PG.shape[1]
        return rewards_PG - (rewards_PG.sum(1, keepdim=True) - rewards_PG) / (G - 1)

    register_algorithm(Algorithm(name="test_loo", estimator_name="test_leave_one_out", default_group_size=4))
    yield calls
    del ALGORITHMS["test_loo"], ESTIMATORS["test_leave_one_out"]


def test_an_algorithm_registered_by_a_test_module_runs_one_update(tmp_path, leave_one_out):
    cfg = short_run_config(tmp_path, "loo", ["--train.algo", "test_loo", "--train.group_size", "0",
                                             "--train.updates", "1", "--train.dynamic_sampling", "false"])
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    history = trainer.run()
    assert [r["update"] for r in history] == [0, 1]
    assert len(leave_one_out) == 1 and leave_one_out[0].shape == (4, 4)  # P = 4 prompts, G = its default 4
    assert trainer.learner.critic is None and not history[1]["critic_only"]
    moved = any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    # leave-one-out advantages are 0 only when every group's rewards are all equal
    signal = any(bool((r != r[:, :1]).any()) for r in leave_one_out)
    assert moved == signal


def test_the_builtin_entries_say_what_they_are():
    assert algorithm("grpo").estimator.name == "grpo" and not algorithm("grpo").critic
    assert algorithm("grpo").group_relative and algorithm("grpo").default_group_size == 8
    assert algorithm("ppo").estimator.name == "gae" and algorithm("ppo").critic
    assert not algorithm("ppo").group_relative and algorithm("ppo").default_group_size == 1
    assert algorithm("grpo").loss.fn is algorithm("ppo").loss.fn


def test_unknown_algorithm_and_misplaced_options_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.algo must be one of grpo\|ppo.*'dpo'"):
        short_run_config(tmp_path, "x", ["--train.algo", "dpo"])
    with pytest.raises(ConfigError, match=r"train\.critic_warmup is an option of train\.algo = 'ppo'"):
        short_run_config(tmp_path, "x", ["--train.critic_warmup", "3"])
    with pytest.raises(ConfigError, match=r"train\.credit = 'token' needs an estimator with per-token credit"):
        short_run_config(tmp_path, "x", ["--train.algo", "ppo", "--train.group_size", "1", "--train.credit", "token"])
    with pytest.raises(ValueError, match="unknown estimator 'nope'"):
        register_algorithm(Algorithm(name="broken", estimator_name="nope", default_group_size=2))
    assert "broken" not in ALGORITHMS


_BRANCH = re.compile(r"""\balgo(?:rithm)?\s*(?:==|!=)|\.algo\s+(?:not\s+)?in\s*[(\[{]|==\s*["'](?:grpo|ppo)["']""")


def branches_on_the_algorithm_name(root: Path) -> list[str]:
    """file:line of every comparison of an algorithm's name outside the registry."""
    hits = []
    for path in sorted((root / "rlengine").rglob("*.py")):
        if path == root / "rlengine" / "rl" / "algo" / "registry.py":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if _BRANCH.search(line.split("#")[0]):
                hits.append(f"{path.relative_to(root)}:{i}")
    return hits


def test_no_branch_on_the_algorithm_name_outside_the_registry(tmp_path):
    assert branches_on_the_algorithm_name(ROOT) == []
    # the scan finds one when there is one
    planted = tmp_path / "rlengine" / "rl" / "trainer"
    planted.mkdir(parents=True)
    (planted / "loop.py").write_text("if t.algo == 'grpo':\n    pass\n")
    assert branches_on_the_algorithm_name(tmp_path) == ["rlengine/rl/trainer/loop.py:1"]


def test_the_registry_module_is_where_the_names_live():
    assert set(registry.ALGORITHMS) >= {"grpo", "ppo"}
    assert set(registry.ESTIMATORS) >= {"grpo", "gae"} and "vanilla" in registry.POLICY_LOSSES

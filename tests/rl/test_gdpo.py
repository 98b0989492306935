"""gdpo: named reward components, each normalised in its group, weighted, whitened over tokens.

Against verl 0.9.1's compute_gdpo_outcome_advantage (the fixture's "gdpo" part, tools/verl_golden.py)
within 1e-10 in float64 (verl takes each component's group statistics in float32; so does rlengine),
on rows with observation holes, groups of four and groups of one, and verl's fallback without keys
(the reward as the one component); each weight and each component changes the result. From a reward plugin's dict to the packed batch: estimate_batch reads the groups'
components (RolloutGroup.components, one list per key) and the config asks for them by name.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlengine.model.config import ConfigError
from rlengine.rl.algo.estimators import gdpo
from rlengine.rl.config import TrainSection

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "verl_core_algos.json").read_text())["gdpo"]


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _gdpo(case, keys=None, weights=None, comps=None):
    opts = SimpleNamespace(gdpo_reward_keys=tuple(case["keys"] if keys is None else keys), normalize_std=True,
                           gdpo_reward_weights=tuple(case["weights"] if weights is None else weights))
    mask = _t(case["mask"])
    rewards = _t(case["rewards"]) if "rewards" in case else torch.zeros_like(mask)
    return gdpo(rewards, mask, case["index"], opts,
                components_B={k: _t(v) for k, v in (comps or case.get("components", {})).items()})


@pytest.mark.parametrize("case", FIXTURE, ids=lambda c: c["case"])
def test_matches_verl(case):
    torch.testing.assert_close(_gdpo(case), _t(case["advantages"]), rtol=1e-10, atol=1e-10)
    if not case["keys"]:  # the fallback: the reward is the one component
        return
    # each term matters: equal weights, one component alone, a component shuffled
    assert not torch.allclose(_gdpo(case, weights=(1.0, 1.0)), _t(case["advantages"]), atol=1e-3)
    assert not torch.allclose(_gdpo(case, keys=["accuracy"], weights=(1.0,)), _t(case["advantages"]), atol=1e-3)
    shuffled = {**case["components"], "format": case["components"]["format"][::-1]}
    assert not torch.allclose(_gdpo(case, comps=shuffled), _t(case["advantages"]), atol=1e-3)


def test_missing_component_is_named():
    with pytest.raises(ValueError, match="'format'"):
        _gdpo(FIXTURE[0], comps={"accuracy": FIXTURE[0]["components"]["accuracy"]})


def test_config_asks_for_the_components_by_name():
    t = TrainSection(adv_estimator="gdpo", gdpo_reward_keys=("accuracy", "format"), gdpo_reward_weights=(1.0, 0.5))
    assert t.algorithm.estimator_name == "gdpo"
    for kw, named in ((dict(adv_estimator="gdpo", gdpo_reward_keys=("a",), gdpo_reward_weights=(1.0, 2.0)),
                       "train.gdpo_reward_weights"),
                      (dict(gdpo_reward_keys=("a",)), "train.gdpo_reward_keys")):
        with pytest.raises(ConfigError, match=named):
            TrainSection(**kw)


PLUGIN = '''
def parts(completion, answer, prompt, extra):
    exact = float(completion.strip() == answer)
    short = float(len(completion) <= 3)
    return {"score": exact + short, "exact": exact, "short": short}
'''


def test_a_run_feeds_the_plugins_components_to_gdpo_and_logs_them(tmp_path, monkeypatch):
    """A reward plugin returning named components: the learner's batch gets gdpo's advantages from exactly
    those per-response values, and metrics.jsonl logs each under reward/<key>."""
    import dataclasses
    import sys

    from rlengine.rl.algo import registry
    from rlengine.rl.config import load_job_config
    from rlengine.rl.trainer import Trainer

    (tmp_path / "rl_gdpo_plugin.py").write_text(PLUGIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []

    def spy(rewards_BT, mask_BT, index_B, opts, *, components_B):
        seen.append({k: v.tolist() for k, v in components_B.items()})
        return gdpo(rewards_BT, mask_BT, index_B, opts, components_B=components_B)

    monkeypatch.setitem(registry.ESTIMATORS, "gdpo", dataclasses.replace(registry.ESTIMATORS["gdpo"], token_level_fn=spy))
    cfg = load_job_config("grpo", ["--warmstart.steps", "0", "--train.updates", "1", "--train.prompts_per_step", "2",
                                   "--train.group_size", "4", "--eval.every", "100", "--task.num_eval", "2",
                                   "--task.num_train", "20", "--run.progress", "false", "--train.dynamic_sampling",
                                   "false", "--task.reward", "rl_gdpo_plugin:parts", "--train.adv_estimator", "gdpo",
                                   "--train.gdpo_reward_keys", '["exact", "short"]', "--run.out_dir", str(tmp_path / "r")])
    history = [r for r in Trainer(cfg).run() if r["update"] > 0]
    assert len(seen) == 1 and set(seen[0]) == {"exact", "short"} and len(seen[0]["short"]) == 8
    assert all(v in (0.0, 1.0) for vs in seen[0].values() for v in vs)
    assert history[0]["reward/short"] == pytest.approx(sum(seen[0]["short"]) / 8)
    assert history[0]["reward/exact"] == pytest.approx(sum(seen[0]["exact"]) / 8)
    del sys.modules["rl_gdpo_plugin"]

"""rlengine's advantage estimators and policy losses against values verl 0.9.1 computed itself.

The fixture (tests/rl/fixtures/verl_core_algos.json) is written by tools/verl_golden.py, which runs
verl's own core_algos.py on fixed random float64 inputs: masked observation tokens inside responses,
right padding, a fully masked response, an all-equal group, a tie at the top, G = 1, length-1
responses. Here the same inputs go through the registry's functions in float64; values and gradients
must agree within 1e-10 (float64 arithmetic over a few dozen tokens is exact to ~1e-15; the margin
covers summation order, not a formula difference, which shows at 1e-3 or more).
"""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlengine.rl.algo.registry import ESTIMATORS, POLICY_LOSSES

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "verl_core_algos.json").read_text())
TOL = 1e-10
SHARED = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "tau_pos", "tau_neg")


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def rlengine_advantages(case, name=None):
    """The registry estimator's [B, T] advantages on a fixture case (group fns: broadcast over tokens)."""
    est = ESTIMATORS[name or case["estimator"]]
    rewards, mask = _t(case["rewards"]), _t(case["mask"])
    opts = SimpleNamespace(gamma=case["gamma"], normalize_std=case["normalize_std"])
    if est.token_level_fn is None:
        G = case["index"].count(case["index"][0])
        adv_PG = est.fn(rewards.sum(dim=1).view(-1, G), opts)
        return adv_PG.reshape(-1, 1) * mask
    extra = {}
    if est.needs:
        extra = {"old_logp_BT": _t(case["old_log_probs"]), "sum_pi_squared_BT": _t(case["sum_pi_squared"])}
    return est.token_level_fn(rewards, mask, torch.tensor(case["index"]), opts, **extra)


def rlengine_loss(case, name=None, **overrides):
    """(loss, d loss / d logp [B, T]) of the registry loss on a fixture case, packed row by row."""
    loss = POLICY_LOSSES[name or case["loss"]]
    s = {**case["settings"], **overrides}
    mask, old, adv = _t(case["mask"]), _t(case["old_logp"]), _t(case["advantages"])
    logp = _t(case["logp"]).requires_grad_(True)
    B, T = mask.shape
    seq_ids = torch.arange(B).repeat_interleave(T)
    kw = {k: s[k] for k in loss.options}
    value, _ = loss.fn(logp.reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1), seq_ids,
                       clip_low=s["clip_ratio_low"], clip_high=s["clip_ratio_high"], clip_ratio_c=s["clip_ratio_c"],
                       agg="token-mean", **kw)
    (grad,) = torch.autograd.grad(value, logp, allow_unused=True)
    return value, torch.zeros_like(logp) if grad is None else grad


ESTIMATOR_CASES = FIXTURE["estimators"]
LOSS_CASES = FIXTURE["losses"]


@pytest.mark.parametrize("case", ESTIMATOR_CASES, ids=[f"{c['estimator']}-{c['case']}" for c in ESTIMATOR_CASES])
def test_estimator_matches_verl(case):
    got = rlengine_advantages(case)
    torch.testing.assert_close(got, _t(case["advantages"]), atol=TOL, rtol=0)


@pytest.mark.parametrize("case", LOSS_CASES, ids=[f"{c['loss']}-{c['case']}" for c in LOSS_CASES])
def test_loss_and_gradient_match_verl(case):
    value, grad = rlengine_loss(case)
    torch.testing.assert_close(value, _t(case["value"]), atol=TOL, rtol=0)
    torch.testing.assert_close(grad, _t(case["grad"]), atol=TOL, rtol=0)


def test_every_registered_verl_name_has_fixture_cases():
    # gdpo reads named reward components, remax greedy baselines: their cases are the fixture's "gdpo" and
    # "remax" parts (tests/rl/test_gdpo.py, tests/rl/test_remax.py)
    apart = {c["estimator"] for c in FIXTURE["gdpo"] + FIXTURE["remax"]}
    assert {c["estimator"] for c in ESTIMATOR_CASES} | apart == set(ESTIMATORS) - {"grpo", "gae"}
    assert {c["loss"] for c in LOSS_CASES} == set(POLICY_LOSSES)


def test_vanilla_reproduces_verl_only_with_verls_dual_clip():
    """verl's vanilla loss always applies dual-clip (c = 3); rlengine's default is off (clip_ratio_c unset).
    Setting clip_ratio_c = 3 reproduces verl (the parametrised test above); unset differs on a case where
    a token with A < 0 has a ratio above 3."""
    case = next(c for c in LOSS_CASES if c["loss"] == "vanilla" and c["case"] == "mixed")
    ratio = (_t(case["logp"]) - _t(case["old_logp"])).exp()
    assert bool(((ratio > 3) & (_t(case["advantages"]) < 0) & (_t(case["mask"]) > 0)).any())
    value, _ = rlengine_loss(case, clip_ratio_c=None)
    assert abs(float(value) - case["value"]) > 1e-3

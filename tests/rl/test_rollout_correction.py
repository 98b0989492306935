"""Rollout correction (IS weights, rejection masks, mismatch metrics) against values verl 0.9.1 computed.

The fixture's "rollout_correction" part (tests/rl/fixtures/verl_core_algos.json, written by
tools/verl_golden.py) runs verl's rollout_corr_helper.py on fixed float64 learner / engine log-probs
with right padding, a row with no trained token, observation holes, policy lag on two rows and ratios
past verl's +-20 clamp, for token and sequence IS (TIS, IcePop, batch normalisation) and every
rejection criterion alone and chained. rlengine's rollout_correction must give the same weights and
masks on the trained tokens, and every metric verl logs, within 1e-10 relative in float64 (the
metrics reach 1e16 through the extreme ratios). Each criterion's defining term, removed, changes
its case (test_each_criterion_depends_on_its_statistic).
"""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from rlengine.rl.algo import rollout_rs
from rlengine.rl.algo.rollout_correction import CorrectionSpec, rollout_correction
from rlengine.rl.algo.rollout_is import parse_threshold, rollout_is_weights

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "verl_core_algos.json").read_text())["rollout_correction"]
TOL = 1e-10


def _t(x):
    return torch.tensor(x, dtype=torch.float64)


def _spec(case) -> CorrectionSpec:
    opts = SimpleNamespace(rollout_is=case["rollout_is"] or "none", rollout_is_cap=2.0,
                           rollout_is_threshold=str(case["rollout_is_threshold"] or ""),
                           rollout_is_batch_normalize=case["rollout_is_batch_normalize"],
                           rollout_rs=case["rollout_rs"] or "", rollout_rs_threshold=case["rollout_rs_threshold"] or "")
    return CorrectionSpec.from_options(opts)


def _run(case):
    return rollout_correction(_t(FIXTURE["learner_logp"]), _t(FIXTURE["engine_logp"]), _t(FIXTURE["mask"]), _spec(case))


def _name(case):
    return f"{case['rollout_is']}-{case['rollout_is_threshold']}-{case['rollout_rs']}-{case['rollout_is_batch_normalize']}"


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_name)
def test_matches_verl(case):
    mask = _t(FIXTURE["mask"])
    weights, new_mask, metrics = _run(case)
    if case["weights"] is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights * mask, _t(case["weights"]) * mask, rtol=TOL, atol=TOL)
    assert torch.equal(new_mask, _t(case["mask"]))
    assert set(metrics) == set(case["metrics"])
    for k, want in case["metrics"].items():
        assert math.isclose(metrics[k], want, rel_tol=TOL, abs_tol=TOL), (k, metrics[k], want)


@pytest.mark.parametrize("case", [c for c in FIXTURE["cases"] if c["rollout_rs"] and "," not in c["rollout_rs"]],
                         ids=lambda c: c["rollout_rs"])
def test_each_criterion_depends_on_its_statistic(case):
    # Each single-criterion case rejects by its upper bound (and a k1 case by its lower bound too), so
    # test_matches_verl fails when either comparison is dropped; and it keeps something.
    name, m = case["rollout_rs"], case["metrics"]
    assert m[f"rollout_corr/rollout_rs_{name}_fraction_high"] > 0
    assert not name.endswith("k1") or m[f"rollout_corr/rollout_rs_{name}_fraction_low"] > 0
    mask = _t(FIXTURE["mask"])
    assert 0 < int((mask - _run(case)[1]).sum()) < int(mask.sum())
    # the statistic's level matters: the same bound on another aggregation gives another mask
    other = ("seq_max" if name[-2:] != "k1" else "seq_mean") if name.startswith("token") else "token"
    got = _run({**case, "rollout_rs": f"{other}_{name[-2:]}"})[1]
    assert not torch.equal(got, _t(case["mask"]))


@pytest.mark.parametrize("spec,want", [("2", (2.0, None)), (3.5, (3.5, None)), ("0.5:2", (2.0, 0.5)),
                                       ("0.5_2", (2.0, 0.5)), (" 1:1 ", (1.0, 1.0))])
def test_threshold_specification(spec, want):
    assert parse_threshold(spec) == want


@pytest.mark.parametrize("spec,match", [("two", "does not parse"), ("0.5:x", "does not parse"), ("-1", "> 0"),
                                        ("3:2", "lower 3.0 > upper 2.0"), ("0:2", "> 0"), ("nan", "> 0")])
def test_bad_threshold_specification(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_threshold(spec)


@pytest.mark.parametrize("criteria,thr,match", [("token_k9", "1", "unknown rollout rejection criterion"),
                                                ("token_k1,seq_max_k1", "2", "unknown"), ("seq_sum_k3", "0.1_0.2",
                                                                                           "does not parse"),
                                                ("token_k1", "2:1", "lower 2.0 > upper 1.0"),
                                                ("token_k2,token_k3", "1,2,3", "one per criterion"),
                                                (" , ", "1", "name none")])
def test_bad_rejection_specification(criteria, thr, match):
    with pytest.raises(ValueError, match=match):
        rollout_rs.parse_criteria(criteria, thr)


def test_tis_with_the_cap_keeps_the_old_packed_weights():
    # rollout_is_cap as the upper bound: the [B, L] path gives the packed path's truncated weights
    learner, engine, mask = _t(FIXTURE["learner_logp"]), _t(FIXTURE["engine_logp"]), _t(FIXTURE["mask"])
    for level in ("token", "sequence"):
        spec = CorrectionSpec(level, 1.7, None, False)
        w, _, _ = rollout_correction(learner, engine, mask, spec)
        seq_ids = torch.arange(mask.shape[0]).repeat_interleave(mask.shape[1])
        old, _ = rollout_is_weights(learner.flatten(), engine.flatten(), mask.flatten(), seq_ids, level=level, cap=1.7)
        valid = mask.flatten() > 0
        torch.testing.assert_close(w.flatten()[valid].float(), old[valid], rtol=1e-6, atol=0)


@pytest.mark.parametrize("kw,named", [
    (dict(rollout_is="token", rollout_is_threshold="3:2"), "train.rollout_is_threshold"),
    (dict(rollout_is="token", rollout_is_threshold="2", rollout_is_cap=3.0), "both set"),
    (dict(rollout_is_batch_normalize=True), "train.rollout_is_batch_normalize"),
    (dict(rollout_rs="token_k1"), "train.rollout_rs_threshold"),
    (dict(rollout_rs="seq_max_k1", rollout_rs_threshold="2"), "train.rollout_rs"),
])
def test_config_refuses_a_bad_correction_with_one_line(kw, named):
    from rlengine.model.config import ConfigError
    from rlengine.rl.config import TrainSection

    with pytest.raises(ConfigError, match=named) as e:
        TrainSection(**kw)
    assert "\n" not in str(e.value)
    # the same settings written correctly resolve to the specification the learner uses
    spec = CorrectionSpec.from_options(TrainSection(rollout_is="sequence", rollout_is_threshold="0.5:2",
                                                    rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="2,0.1"))
    assert (spec.level, spec.upper, spec.lower) == ("sequence", 2.0, 0.5)
    assert spec.criteria == (("token_k1", 0.5, 2.0), ("seq_max_k3", None, 0.1))

"""optimal_token_baseline with the learner's per-token sum of squared probabilities.

sum_v pi_v^2 against verl 0.9.1's calculate_sum_pi_squared_from_logits (the fixture's sum_pi_squared
part, tools/verl_golden.py) within 1e-10 in float64; the estimator itself against verl is in
test_verl_parity.py. In the learner: the advantages Learner.prepare writes equal the estimator on
rows laid out by hand, with sum_v pi_v^2 from a full softmax of the model's logits and the pre-update
log-probs (fp32 model: 1e-5), the pass split into micro-batches (an update of every estimator x
loss pairing runs in test_estimator_loss_combinations.py).
"""

import copy
import json
from pathlib import Path

import torch

from rlengine.rl.algo import estimators
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.batching import estimate_batch
from rlengine.rl.learner.learner import Learner
from rlengine.rl.learner.token_baseline import sum_pi_squared_from_logits
from tests.rl.test_update_passes import _logp, _setup

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "verl_core_algos.json").read_text())["sum_pi_squared"]


def test_sum_pi_squared_matches_verl():
    logits = torch.tensor(FIXTURE["logits"], dtype=torch.float64)
    got = sum_pi_squared_from_logits(logits, FIXTURE["temperature"])
    torch.testing.assert_close(got, torch.tensor(FIXTURE["sum_pi_squared"], dtype=torch.float64), rtol=1e-10, atol=1e-10)
    # the temperature is part of the definition
    assert not torch.allclose(sum_pi_squared_from_logits(logits, 1.0), got, rtol=1e-3)


def test_learner_computes_the_optimal_token_baseline():
    model, groups = _setup(seed=9)
    cfg = TrainSection(prompts_per_step=3, group_size=3, adv_estimator="optimal_token_baseline", micro_batch=2)
    batch = estimate_batch(groups, cfg.algorithm.estimator, cfg)
    assert not batch.advantages.any()  # left to the learner
    learner = Learner(copy.deepcopy(model), cfg)
    prepared = copy.deepcopy(batch)
    learner.prepare(prepared)

    old = _logp(model, batch)
    with torch.no_grad():
        logits = model(batch.input_ids, cu_seqlens=batch.cu_seqlens, head=lambda h, w: h.float() @ w.float().T)
    pi2 = torch.softmax(logits.double(), dim=-1).square().sum(-1)
    cu, valid = batch.cu_seqlens, batch.loss_mask > 0
    lengths = [int(valid[a:e].sum()) for a, e in zip(cu, cu[1:])]  # single-turn: trained tokens end the segment
    L = max(lengths)
    rows = {k: torch.zeros(len(lengths), L, dtype=torch.float64) for k in ("r", "m", "old", "pi2")}
    for b, (e, n) in enumerate(zip(cu[1:], lengths)):
        rows["m"][b, :n], rows["old"][b, :n], rows["pi2"][b, :n] = 1.0, old[e - n:e].double(), pi2[e - n:e]
        rows["r"][b, n - 1] = float(batch.rewards[b])
    want_BL = estimators.optimal_token_baseline(rows["r"], rows["m"], torch.arange(len(lengths)) // 3,
                                                old_logp_BT=rows["old"], sum_pi_squared_BT=rows["pi2"])
    want = torch.cat([want_BL[b, :n] for b, n in enumerate(lengths)])
    got = prepared.advantages[valid].double()
    assert want.abs().max() > 0.1
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

"""Rollout correction inside Learner.step and a training run: the packed batch's correction equals
rollout_correction on hand-laid rows, the loss is the surrogate with those weights over the kept
tokens, and in batch-invariant mode without policy lag the correction does nothing.

Tolerances: fp32 log-probs through the tiny model, losses summed over ~60 tokens: 1e-5 relative.
"""

import copy

import pytest
import torch

from rlengine.rl.algo.rollout_correction import CorrectionSpec, rollout_correction
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.batching import grpo_batch
from rlengine.rl.learner.learner import Learner
from rlengine.rl.trainer import Trainer
from tests.rl.test_update_passes import RTOL, _assert_grads_close, _hand_surrogate, _logp, _setup
from tests.support.short_runs import short_run_config

OPTS = dict(rollout_is="token", rollout_is_threshold="0.8:1.3", rollout_is_batch_normalize=True,
            rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="0.75:1.4,0.12")


def _rows(batch, *values_T):
    """Each sequence's packed segment as a right-padded row, by a plain loop (the test's own layout)."""
    cu = batch.cu_seqlens
    L = max(e - a for a, e in zip(cu, cu[1:]))
    out = []
    for x in values_T:
        rows = torch.zeros(len(cu) - 1, L, dtype=torch.float64)
        for b, (a, e) in enumerate(zip(cu, cu[1:])):
            rows[b, :e - a] = x[a:e].double()
        out.append(rows)
    return out


def test_learner_weights_rejects_and_reports_as_rollout_correction():
    model, groups = _setup(seed=9)
    batch = grpo_batch(groups, normalize_std=True)
    gen = torch.Generator().manual_seed(10)
    # an engine whose log-probs are off from the learner's (other kernels, older weights)
    batch.old_logprobs = batch.old_logprobs + (torch.rand(batch.old_logprobs.shape, generator=gen) - 0.5) * 0.6
    cfg = TrainSection(prompts_per_step=3, group_size=3, **OPTS)
    learner = Learner(copy.deepcopy(model), cfg)
    got = learner.compute_grads(b := copy.deepcopy(batch))

    learner_old = _logp(model, batch)
    lr_BL, en_BL, m_BL = _rows(batch, learner_old, batch.old_logprobs, batch.loss_mask)
    w_BL, keep_BL, metrics = rollout_correction(lr_BL, en_BL, m_BL, CorrectionSpec.from_options(cfg))
    inside = _rows(batch, torch.ones_like(batch.loss_mask))[0] > 0
    w, keep = w_BL[inside].float(), keep_BL[inside].float()
    rejected = int((batch.loss_mask - keep).sum())
    assert 0 < rejected < int(batch.loss_mask.sum()) and bool((w[keep > 0] == 0).any())  # both bounds act
    torch.testing.assert_close(b.loss_mask, keep, rtol=0, atol=0)
    torch.testing.assert_close(b.is_weights * keep, w * keep, rtol=RTOL, atol=1e-6)
    for k, v in metrics.items():
        assert got[k] == pytest.approx(v, rel=RTOL, abs=1e-6), k
    assert got["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected / float(batch.loss_mask.sum()))
    # the loss: the surrogate against learner_old, weighted, over the kept tokens (their count normalises)
    kept = copy.deepcopy(batch)
    kept.loss_mask = keep
    want = _hand_surrogate(_logp(learner.model, kept, grad=True), learner_old, kept, w=w)
    assert got["loss"] == pytest.approx(float(want.detach()), rel=RTOL)
    _assert_grads_close(learner.model, want, list(learner.model.parameters()))


def test_batch_invariant_mode_without_lag_makes_the_correction_a_no_op(tmp_path):
    """gen.batch_invariant and gen.b_gen = B_train: the learner recomputes the engine's log-probs bit for
    bit, so with a tight IcePop band and tight rejection bounds every weight is exactly 1 and no token
    is rejected (the default mode's rounding would fail both: test_batch_invariant_training.py)."""
    extra = ["--gen.batch_invariant", "true", "--gen.b_gen", "16", "--model.dtype", "bfloat16", "--train.updates", "2",
             "--warmstart.steps", "0", "--eval.every", "100", "--task.num_eval", "2",
             "--train.rollout_is", "sequence", "--train.rollout_is_threshold", "0.99999:1.00001",
             "--train.rollout_rs", "token_k1,seq_max_k3", "--train.rollout_rs_threshold", "0.99999:1.00001,1e-12"]
    history = [r for r in Trainer(short_run_config(tmp_path, "inv", extra)).run() if r["update"] > 0]
    assert len(history) == 2
    for r in history:
        assert r["rollout_corr/rollout_is_min"] == r["rollout_corr/rollout_is_max"] == 1.0
        assert r["rollout_corr/rollout_is_ratio_fraction_high"] == r["rollout_corr/rollout_is_ratio_fraction_low"] == 0.0
        assert r["rollout_corr/rollout_rs_masked_fraction"] == r["rollout_corr/rollout_rs_seq_masked_fraction"] == 0.0
        assert r["rollout_corr/kl"] == r["rollout_corr/k3_kl"] == r["rollout_corr/log_ppl_abs_diff"] == 0.0
        assert r["logprob_diff"] == 0.0

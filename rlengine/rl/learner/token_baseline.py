"""Estimators that need the learner's view of each token: optimal_token_baseline (verl 0.9.1).

Its per-token weight w_t = 1 - 2 pi_t + sum_v pi_v^2 needs the policy's full distribution at every
trained position, which only a forward pass over the vocabulary has. The learner already runs one
without grad before its passes (the pre-update log-probs, Learner.prepare); SumPiSquaredTap rides on
it: it wraps the module so that the same head call also returns sum_v pi_v^2 of the tempered logits,
chunked over rows (no [T, V] tensor kept), as verl's calculate_sum_pi_squared_from_logits:
exp(logsumexp(2 z) - 2 logsumexp(z)), z = logits / temperature. The advantages are then computed on
the batch laid out as batching._token_level lays it (rows from each response's first trained token,
the reward on its last, groups of train.group_size consecutive responses) and written back packed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlengine.analysis.activations import head_chunk_tokens


def sum_pi_squared_from_logits(logits_TV: Tensor, temperature: float = 1.0) -> Tensor:
    """sum_v softmax(logits / temperature)_v^2 per row: [T, V] -> [T], in the logits' dtype (fp32 at least)."""
    z = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))
    z = z / temperature if temperature > 0 else z
    return torch.exp(torch.logsumexp(2.0 * z, dim=-1) - 2.0 * torch.logsumexp(z, dim=-1))


class SumPiSquaredTap:
    """`module` (the model or its DDP / FSDP wrapper) whose head call also appends sum_v pi_v^2 [T] of each
    forward to `out`. No grad: for the learner's pre-update pass only."""

    def __init__(self, module, temperature: float, out: list):
        self.fwd, self.temperature, self.out = module, temperature, out
        self.module = getattr(module, "module", module)  # what logprobs.is_batch_invariant looks at

    def __call__(self, input_ids, *, cu_seqlens, head, checkpoint_layers=False):
        def both(h_TC, w_VC):
            step = head_chunk_tokens(w_VC.shape[0])
            w = w_VC.float()
            self.out.append(torch.cat([sum_pi_squared_from_logits(h_TC[a:a + step].float() @ w.T, self.temperature)
                                       for a in range(0, h_TC.shape[0], step)]) if h_TC.shape[0] else w.new_zeros(0))
            return head(h_TC, w_VC)
        return self.fwd(input_ids, cu_seqlens=cu_seqlens, head=both, checkpoint_layers=checkpoint_layers)


def token_baseline_advantages(batch, estimator, opts, *, group_size: int, learner_old_T: Tensor, sum_pi2_T: Tensor,
                              is_weights_T: Tensor | None = None) -> Tensor:
    """The estimator's advantages [T] on the packed batch (0 off the trained tokens), from the learner's
    pre-update log-probs and sum_v pi_v^2 [T] and, when rollout IS is on, its weights [T]."""
    cu, valid = batch.cu_seqlens, batch.loss_mask > 0
    spans = []
    for a, e in zip(cu, cu[1:]):
        trained = valid[a:e].nonzero().flatten()
        spans.append((a + int(trained[0]), a + int(trained[-1]) + 1) if len(trained) else (e, e))
    B, L = len(spans), max((e - s for s, e in spans), default=0)
    rows = {k: torch.zeros(B, L, dtype=torch.float64, device=batch.loss_mask.device)
            for k in ("rewards", "mask", "old", "pi2", "w")}
    rows["w"] += 1.0
    for b, (s, e) in enumerate(spans):
        n = e - s
        rows["mask"][b, :n] = valid[s:e].double()
        rows["old"][b, :n], rows["pi2"][b, :n] = learner_old_T[s:e].double(), sum_pi2_T[s:e].double()
        if is_weights_T is not None:
            rows["w"][b, :n] = is_weights_T[s:e].double()
        if n:
            rows["rewards"][b, n - 1] = batch.rewards[b].double()
    index_B = torch.arange(B) // max(group_size, 1)
    adv_BL = estimator.token_level_fn(rows["rewards"], rows["mask"], index_B, opts, old_logp_BT=rows["old"],
                                      sum_pi_squared_BT=rows["pi2"],
                                      is_weights_BT=None if is_weights_T is None else rows["w"])
    adv_T = torch.zeros_like(batch.advantages)
    for b, (s, e) in enumerate(spans):
        adv_T[s:e] = adv_BL[b, :e - s].to(adv_T.dtype)
    return adv_T

"""RL losses on packed token tensors: PPO clipped policy loss (dual-clip), value loss, KL estimators.

Sits inside Learner.step: per-token log-probs (rlengine.kernels.fused_logprob) and the
TrainBatch's old log-probs, advantages and loss mask -> scalar loss + metrics.
All token tensors are PACKED, [T] over every token of every sequence in the (micro-)batch:
mask_T is 1.0 on tokens that are trained (response tokens) and 0.0 elsewhere (prompt,
padding); seq_ids_T says which sequence each token belongs to, ids in [0, T).

Aggregation and gradient accumulation. Every loss is SUM(per-unit loss) / normalizer:
  "token-mean": units are valid tokens, normalizer = number of valid tokens;
  "seq-mean":   units are sequences, each contributing the mean of its own valid tokens,
                normalizer = number of sequences that have a valid token;
  "seq-mean-token-sum-norm" (Dr. GRPO): units are sequences, each contributing the SUM of its
                valid tokens divided by a constant norm_len (the longest response the engine can
                make), normalizer = number of sequences. No per-response length in the loss.
With normalizer=None the count is taken from the tensors passed in. For gradient
accumulation pass the count for the FULL update batch (all micro-batches; under DDP, which
averages gradients over W ranks, pass global_count / W): the micro-batch losses then add up to
the full-batch loss and their gradients add up to the full-batch gradient. Do not divide by
the number of micro-batches again. For seq-mean a sequence must not be split across
micro-batches. Metrics are detached 0-dim tensors over the tokens passed in (no host sync).
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def wide(x: Tensor) -> Tensor:
    """x in at least fp32 (bf16 -> fp32, fp64 stays fp64): losses and aggregates never compute below fp32."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def masked_aggregate(loss_T: Tensor, mask_T: Tensor, seq_ids_T: Tensor | None = None, *,
                     agg: str = "token-mean", normalizer: float | Tensor | None = None, norm_len: int = 0) -> Tensor:
    """Reduce a per-token quantity [T] to a scalar by `agg` (see module docstring).

    Used for the policy and value losses, and directly for KL or entropy terms:
    masked_aggregate(kl_k3(logp, ref_logp), mask, seq_ids, agg=..., normalizer=...).
    seq_ids_T is required for the seq-* modes, norm_len >= 1 for "seq-mean-token-sum-norm". No host
    sync: per-sequence sums go into a [T] buffer (there are never more sequences than tokens).
    Returns a 0-dim tensor in fp32 (fp64 for fp64 inputs).
    """
    if agg not in AGGREGATIONS:
        raise ValueError(f"agg must be one of {AGGREGATIONS}, got {agg!r}")
    if loss_T.shape != mask_T.shape or loss_T.dim() != 1:
        raise ValueError(f"loss_T {tuple(loss_T.shape)} and mask_T {tuple(mask_T.shape)} must be the same [T] shape")
    masked = wide(loss_T)
    m = mask_T.to(masked.dtype)
    masked = masked * m
    if agg == "token-mean":
        total, count = masked.sum(), m.sum()
    elif seq_ids_T is None or seq_ids_T.shape != loss_T.shape:
        raise ValueError(f"agg={agg!r} needs seq_ids_T with the same [T] shape as loss_T")
    elif agg == "seq-mean-token-sum-norm":
        if norm_len < 1:
            raise ValueError(f"agg='seq-mean-token-sum-norm' needs norm_len >= 1 (train.loss_norm_len), got {norm_len}")
        total = masked.sum() / norm_len
        count = (m.new_zeros(loss_T.shape[0]).index_add_(0, seq_ids_T, torch.ones_like(m)) > 0).sum()
    else:
        seq_sum = masked.new_zeros(loss_T.shape[0]).index_add_(0, seq_ids_T, masked)
        seq_cnt = m.new_zeros(loss_T.shape[0]).index_add_(0, seq_ids_T, m)
        total = (seq_sum / seq_cnt.clamp(min=1.0)).sum()
        count = (seq_cnt > 0).sum()
    if normalizer is None:
        normalizer = count.clamp(min=1).float()  # an all-masked batch gives loss 0, not NaN
    return total / normalizer


def policy_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, seq_ids: Tensor | None = None, *,
                clip_low: float = 0.2, clip_high: float = 0.28, agg: str = "token-mean",
                log_ratio_clamp: float = 20.0, normalizer: float | Tensor | None = None,
                clip_ratio_c: float | None = None, weights: Tensor | None = None, norm_len: int = 0
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric clipping (DAPO "clip-higher") and optional dual-clip.

    All inputs [T] packed; logp carries the gradient, old_logp / adv / weights are constants.
      log r = clamp(logp - old_logp, -log_ratio_clamp, +log_ratio_clamp)  (no inf after exp)
      loss_t = max(-A_t * r_t, -A_t * clip(r_t, 1 - clip_low, 1 + clip_high))
      dual-clip (clip_ratio_c = c > 1, verl's semantics): where A_t < 0, loss_t = min(loss_t, -A_t * c),
        so a token with r far above 1 and a negative advantage stops pushing (its gradient is cut)
      weights [T] (rollout importance weights, detached) multiply loss_t before aggregation
    aggregated by `agg` / `normalizer` / `norm_len` (module docstring). Metrics (detached, over valid
    tokens): clip_frac (tokens where the clipped branch is active, i.e. the gradient is cut) =
    clip_frac_low (A < 0 and r < 1 - clip_low) + clip_frac_high (A > 0 and r > 1 + clip_high);
    clip_frac_dual (tokens the dual-clip bound takes, verl's pg_clipfrac_lower); approx_kl (k3
    estimate of KL(old || new): mean of r - 1 - log r); ratio_mean; ratio_max (over the tokens passed).
    """
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"policy_loss: need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"policy_loss: clip_ratio_c must be > 1 (or None), got {clip_ratio_c}")
    log_ratio = (wide(logp) - wide(old_logp.detach())).clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = torch.exp(log_ratio)
    a = wide(adv.detach())
    unclipped = -a * ratio
    clipped = -a * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_T = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(loss_T, dtype=torch.bool)
    if clip_ratio_c is not None:
        bound = -a * clip_ratio_c
        dual = (a < 0) & (loss_T > bound)
        loss_T = torch.where(a < 0, torch.minimum(loss_T, bound), loss_T)
    if weights is not None:
        loss_T = loss_T * wide(weights.detach())
    loss = masked_aggregate(loss_T, mask, seq_ids, agg=agg, normalizer=normalizer, norm_len=norm_len)
    with torch.no_grad():
        cut = clipped > unclipped
        metrics = {
            "clip_frac": _token_mean(cut.float(), mask),
            "clip_frac_low": _token_mean((cut & (a < 0)).float(), mask),
            "clip_frac_high": _token_mean((cut & (a > 0)).float(), mask),
            "clip_frac_dual": _token_mean(dual.float(), mask),
            "approx_kl": _token_mean(ratio - 1.0 - log_ratio, mask),
            "ratio_mean": _token_mean(ratio, mask),
            "ratio_max": torch.where(mask > 0, ratio, torch.zeros_like(ratio)).max() if ratio.numel() else ratio.sum(),
        }
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, seq_ids: Tensor | None = None, *,
               clip: float = 0.2, agg: str = "token-mean", normalizer: float | Tensor | None = None,
               norm_len: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped value loss, all inputs [T] packed; values carries the gradient.

      v_clip = old_values + clamp(values - old_values, -clip, +clip)
      loss_t = 0.5 * max((values - returns)^2, (v_clip - returns)^2)
    aggregated like policy_loss. Metrics: vf_clip_frac (clipped error strictly larger).
    """
    if clip < 0:
        raise ValueError(f"value_loss: clip must be >= 0, got {clip}")
    v = values.float()
    old = old_values.detach().float()
    ret = returns.detach().float()
    v_clip = old + (v - old).clamp(-clip, clip)
    err, err_clip = (v - ret).square(), (v_clip - ret).square()
    loss = masked_aggregate(0.5 * torch.maximum(err, err_clip), mask, seq_ids, agg=agg, normalizer=normalizer,
                            norm_len=norm_len)
    with torch.no_grad():
        metrics = {"vf_clip_frac": _token_mean((err_clip > err).float(), mask)}
    return loss, metrics


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) on tokens sampled from pi: [T] fp32, by `estimator`.

    With d = logp - ref_logp (ref_logp a constant): k1 = d (unbiased, either sign), k2 = d^2 / 2,
    k3 = kl_k3 (exp(-d) + d - 1 >= 0, unbiased, low variance), low_var_kl = k3 clamped to [-10, 10]
    (verl's low_var_kl; verl's "k3" is that clamped one too, rlengine's k3 is not clamped).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    if estimator in ("k3", "low_var_kl"):
        k3 = kl_k3(logp, ref_logp)
        return k3 if estimator == "k3" else k3.clamp(-10.0, 10.0)
    d = logp.float() - ref_logp.detach().float()
    return d if estimator == "k1" else 0.5 * d.square()


def kl_k3(logp: Tensor, ref_logp: Tensor, *, log_ratio_clamp: float = 20.0) -> Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) on tokens sampled from pi: [T] fp32.

    d = ref_logp - logp (clamped to +-log_ratio_clamp before exp); k3 = exp(d) - d - 1 >= 0.
    Unbiased for the KL, always non-negative. Aggregate with masked_aggregate.
    """
    d = (ref_logp.detach().float() - logp.float()).clamp(-log_ratio_clamp, log_ratio_clamp)
    return torch.exp(d) - d - 1.0


def _token_mean(x_T: Tensor, mask_T: Tensor) -> Tensor:
    m = mask_T.float()
    return (x_T * m).sum() / m.sum().clamp(min=1.0)


def token_metrics(log_ratio_T: Tensor, mask_T: Tensor, cut_T: Tensor | None, adv_T: Tensor,
                  dual_T: Tensor | None = None) -> dict[str, Tensor]:
    """The learner's policy-loss metrics (policy_loss's docstring), detached, over the valid tokens:
    cut_T marks tokens whose gradient the loss cuts (None: none), split by the advantage's sign."""
    with torch.no_grad():
        log_r = log_ratio_T.detach()
        ratio = torch.exp(log_r)
        cut = torch.zeros_like(log_r, dtype=torch.bool) if cut_T is None else cut_T.detach().bool()
        zero = torch.zeros_like(cut)
        return {
            "clip_frac": _token_mean(cut.to(log_r.dtype), mask_T),
            "clip_frac_low": _token_mean((cut & (adv_T < 0)).to(log_r.dtype), mask_T),
            "clip_frac_high": _token_mean((cut & (adv_T > 0)).to(log_r.dtype), mask_T),
            "clip_frac_dual": _token_mean((zero if dual_T is None else dual_T.bool()).to(log_r.dtype), mask_T),
            "approx_kl": _token_mean(ratio - 1.0 - log_r, mask_T),
            "ratio_mean": _token_mean(ratio, mask_T),
            "ratio_max": torch.where(mask_T > 0, ratio, torch.zeros_like(ratio)).max() if ratio.numel() else ratio.sum(),
        }

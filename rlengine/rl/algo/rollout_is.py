"""Rollout importance sampling: weights between the learner's and the engine's log-probs (verl 0.9.1's
rollout_corr_helper.py: compute_rollout_correction_weights, compute_is_metrics, threshold parsing).

Sits in Learner.prepare, before the policy passes: the learner recomputes the log-probs of the
sampled tokens under the weights it is about to update (learner_old) and compares them with the
log-probs the engine sampled with (engine). Any gap (kernels, precision, top-k / top-p handling,
partial rollouts from older weights) makes the samples off-policy for the learner; with
log_ratio = learner_old - engine, clamped to +-20 before exp (verl's SAFETY_BOUND),
    token:    w_t = exp(log_ratio_t)
    sequence: w_t = exp(sum_{t' in seq} log_ratio_t'), on each of its tokens
and the threshold specification (verl's rollout_is_threshold) "U" truncates w at U (TIS), "L_U"
(also written "L:U") zeroes the weights outside [L, U] (IcePop). Batch normalisation divides by the
weights' mean over tokens (token) or sequences (sequence). The weights multiply the per-token policy
loss as constants (no gradient).

Two forms: is_weights_BT works on right-padded [B, L] rows with verl's definitions and metrics (the
learner lays the packed batch out so, rollout_correction.py); rollout_is_weights is the packed [T]
TIS form the learner used before the threshold specification existed (tests pin its behaviour).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

LEVELS = ("token", "sequence")
SAFETY_BOUND = 20.0


def parse_threshold(spec) -> tuple[float, float | None]:
    """verl's rollout_is_threshold: a number or "U" -> (U, None); "L_U" or "L:U" -> (U, L). ValueError naming
    the problem for text that does not parse, a bound <= 0, or L > U."""
    if isinstance(spec, bool):
        raise ValueError(f"rollout IS threshold must be a number or 'lower:upper', got {spec!r}")
    if isinstance(spec, (int, float)):
        upper, lower = float(spec), None
    else:
        text = str(spec).strip().replace(":", "_")
        try:
            lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (None, float(text))
        except ValueError:
            raise ValueError(f"rollout IS threshold {spec!r} does not parse: write U or lower:upper "
                             "(e.g. 2.0 or 0.5:2.0)") from None
    if not (math.isfinite(upper) and upper > 0) or (lower is not None and not (math.isfinite(lower) and lower > 0)):
        raise ValueError(f"rollout IS threshold {spec!r}: bounds must be finite and > 0")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout IS threshold {spec!r}: lower {lower} > upper {upper}")
    return upper, lower


def _mmean(x: Tensor, m: Tensor, dim=None) -> Tensor:
    """verl_F.masked_mean: sum(x * m) / (sum(m) + 1e-8), with x zeroed where m is 0 (no NaN leaks)."""
    s = (torch.where(m.bool(), x, 0.0) * m).sum() if dim is None else (torch.where(m.bool(), x, 0.0) * m).sum(dim)
    return s / ((m.sum() if dim is None else m.sum(dim)) + 1e-8)


def is_weights_BT(log_ratio_BL: Tensor, mask_BL: Tensor, *, level: str, upper: float, lower: float | None = None,
                  batch_normalize: bool = False) -> tuple[Tensor, dict[str, float]]:
    """(weights [B, L], metrics) as verl's compute_rollout_correction_weights: 0 on masked positions.

    log_ratio_BL: learner_old - engine log-probs, [B, L] right-padded rows; mask_BL [B, L] 1 on trained
    tokens (needs at least one). Metrics under verl's names (rollout_is_mean, _max, _min, _std,
    _eff_sample_size, _ratio_fraction_high / _low, _seq_*, _oob_ratio with a lower bound,
    _batch_norm_factor when normalising). Computes in the input's dtype; host syncs for the metrics."""
    if level not in LEVELS:
        raise ValueError(f"rollout_is level must be one of {LEVELS}, got {level!r}")
    if level == "token":
        log_for_metrics = log_ratio_BL
        raw = torch.exp(log_ratio_BL.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        log_for_metrics = (torch.where(mask_BL.bool(), log_ratio_BL, 0.0) * mask_BL).sum(-1, keepdim=True)
        raw = torch.exp(log_for_metrics.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio_BL)
    raw = raw * mask_BL
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = is_metrics(w, raw, log_for_metrics, mask_BL, level=level, upper=upper, lower=lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _mmean(((raw < lower) | (raw > upper)).float(), mask_BL).item()
    if batch_normalize:
        if level == "token":
            mean = _mmean(w, mask_BL)
        else:
            seq_mask = (mask_BL.sum(-1) > 0).to(w.dtype)
            mean = (_mmean(w, mask_BL, -1) * seq_mask).sum() / seq_mask.sum().clamp_min(1e-8)
        if mean > 1e-8:
            w = w / mean
            metrics["rollout_is_batch_norm_factor"] = mean.item()
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return w, metrics


def is_metrics(w_BL: Tensor, raw_BL: Tensor, log_for_metrics: Tensor, mask_BL: Tensor, *, level: str, upper: float,
               lower: float | None) -> dict[str, float]:
    """verl's compute_is_metrics: the applied weights' statistics, fractions beyond the bounds (the
    lower bound defaults to 1 / upper), effective sample size, per-sequence summaries."""
    low = 1.0 / upper if lower is None else lower
    m, valid = mask_BL, mask_BL.bool()
    out: dict[str, float] = {}
    if level == "sequence":
        out["rollout_is_max"] = torch.exp(log_for_metrics.max().clamp(max=SAFETY_BOUND)).item()
        out["rollout_is_min"] = torch.exp(log_for_metrics.min()).item()
        out["rollout_is_mean"] = _mmean(w_BL, m).item()
        lu = torch.log(torch.tensor(upper, dtype=torch.float32)).to(log_for_metrics.device)  # verl: fp32 logs
        ll = torch.log(torch.tensor(low, dtype=torch.float32)).to(log_for_metrics.device)
        out["rollout_is_ratio_fraction_high"] = (log_for_metrics > lu).float().mean().item()
        out["rollout_is_ratio_fraction_low"] = (log_for_metrics < ll).float().mean().item()
    else:
        out["rollout_is_mean"] = _mmean(w_BL, m).item()
        out["rollout_is_ratio_fraction_high"] = _mmean((raw_BL > upper).float(), m).item()
        out["rollout_is_ratio_fraction_low"] = _mmean((raw_BL < low).float(), m).item()
        out["rollout_is_max"] = w_BL.masked_fill(~valid, float("-inf")).max().item()
        out["rollout_is_min"] = w_BL.masked_fill(~valid, float("inf")).min().item()
    clamped = w_BL.clamp(min=0.0, max=upper)
    mean_c = _mmean(clamped, m)
    if m.sum() > 1:
        out["rollout_is_std"] = torch.sqrt((_mmean(clamped.square(), m) - mean_c.square()).clamp(min=0.0)).item()
    else:
        out["rollout_is_std"] = 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / _mmean((clamped / (mean_c + 1e-8)).square(), m).item()
    seq_w = _mmean(w_BL, m, -1)
    out["rollout_is_seq_mean"] = seq_w.mean().item()
    out["rollout_is_seq_std"] = seq_w.std().item() if seq_w.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = seq_w.max().item()
    out["rollout_is_seq_min"] = seq_w.min().item()
    out["rollout_is_seq_max_deviation"] = (seq_w - 1.0).abs().max().item()
    raw_seq = _mmean(raw_BL, m, -1)  # before truncation: a mean of clamped weights never exceeds the bound
    out["rollout_is_seq_fraction_high"] = (raw_seq > upper).float().mean().item()
    out["rollout_is_seq_fraction_low"] = (raw_seq < low).float().mean().item()
    return out


def rollout_is_weights(learner_old_T: Tensor, engine_T: Tensor, mask_T: Tensor, seq_ids_T: Tensor, *,
                       level: str, cap: float, log_clamp: float = SAFETY_BOUND) -> tuple[Tensor, Tensor]:
    """(truncated weights [T], untruncated weights [T]), fp32, detached; 1.0 on masked positions.

    The packed TIS form: min(w, cap) with w as in the module docstring. learner_old_T, engine_T: [T]
    log-probs of the packed targets; mask_T [T] (> 0 on trained tokens); seq_ids_T [T] int64 sequence
    of each token (for level = "sequence"). No host sync.
    """
    if level not in LEVELS:
        raise ValueError(f"rollout_is level must be one of {LEVELS}, got {level!r}")
    if cap < 1.0:
        raise ValueError(f"rollout_is cap must be >= 1, got {cap}")
    valid = mask_T > 0
    log_w = torch.where(valid, learner_old_T.detach().float() - engine_T.detach().float(),
                        torch.zeros_like(engine_T, dtype=torch.float32))
    if level == "sequence":
        seq_log_w = log_w.new_zeros(log_w.shape[0]).index_add_(0, seq_ids_T, log_w)
        log_w = torch.where(valid, seq_log_w[seq_ids_T], log_w)
    raw = torch.exp(log_w.clamp(-log_clamp, log_clamp))
    return raw.clamp(max=cap), raw

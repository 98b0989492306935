"""Rollout rejection: loss masks from the divergence between the learner's and the engine's log-probs
(verl 0.9.1's rollout_corr_helper.py: compute_rollout_rejection_mask, compute_rs_metrics).

With log_ratio = learner_old - engine (clamped to +-20) the per-token divergences are k1 = -log_ratio,
k2 = log_ratio^2 / 2 and k3 = exp(log_ratio) - 1 - log_ratio. A criterion bounds one of them:
    token_k1 / token_k2 / token_k3          each token on its own (the token is dropped)
    seq_sum_k*, seq_mean_k*, seq_max_k2/k3  a sequence's sum / mean / max over its trained tokens
                                            (the whole sequence is dropped)
k1 criteria keep log(lower) <= k1 <= log(upper) (threshold "L_U" or "L:U"; "U" alone means L = 1/U),
the others keep value <= U. Criteria chain with commas ("token_k1,seq_max_k3"), one threshold shared
or one per criterion; a token stays only if every criterion keeps it. The learner multiplies the loss
mask by the result (Learner.prepare), so rejected tokens leave the loss and its normaliser.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlengine.rl.algo.rollout_is import SAFETY_BOUND, _mmean

CRITERIA = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
            "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def parse_criteria(criteria: str, thresholds) -> list[tuple[str, float | None, float]]:
    """[(criterion, lower or None, upper)] of a comma list and its thresholds (one shared, or one per
    criterion, in order; duplicates kept once). ValueError naming the problem otherwise."""
    names: list[str] = []
    for name in (c.strip() for c in str(criteria).split(",")):
        if name and name not in CRITERIA:
            raise ValueError(f"unknown rollout rejection criterion {name!r}; known: {', '.join(CRITERIA)}")
        if name and name not in names:
            names.append(name)
    if not names:
        raise ValueError(f"rollout rejection criteria {criteria!r} name none of: {', '.join(CRITERIA)}")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout rejection threshold {thresholds!r}: give one threshold, or one per criterion "
                         f"({len(names)})")
    specs = specs * len(names) if len(specs) == 1 else specs
    return [_bounds(name, spec) for name, spec in zip(names, specs)]


def _bounds(name: str, spec: str) -> tuple[str, float | None, float]:
    text = spec.replace(":", "_")
    try:
        if name.endswith("k1"):
            lower, upper = (float(x) for x in text.split("_", 1)) if "_" in text else (1.0 / float(text), float(text))
        elif "_" in text:
            raise ValueError
        else:
            lower, upper = None, float(text)
    except (ValueError, ZeroDivisionError):
        form = "U or lower:upper" if name.endswith("k1") else "one upper bound U"
        raise ValueError(f"rollout rejection threshold {spec!r} for {name} does not parse: write {form}") from None
    if not (math.isfinite(upper) and upper > 0) or (lower is not None and not (math.isfinite(lower) and lower > 0)):
        raise ValueError(f"rollout rejection threshold {spec!r} for {name}: bounds must be finite and > 0")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout rejection threshold {spec!r} for {name}: lower {lower} > upper {upper}")
    return name, lower, upper


def rejection_mask_BT(log_ratio_BL: Tensor, mask_BL: Tensor, criteria: list[tuple[str, float | None, float]]
                      ) -> tuple[Tensor, dict[str, float]]:
    """(mask [B, L] with rejected tokens 0, metrics) as verl's compute_rollout_rejection_mask.

    log_ratio_BL: learner_old - engine, [B, L] right-padded rows; mask_BL [B, L] (needs one trained
    token); criteria from parse_criteria. Metrics under verl's names: rollout_rs_<criterion>_{mean, max,
    min, std, fraction_high, fraction_low, seq_*, masked_fraction, seq_masked_fraction} and the chain's
    rollout_rs_masked_fraction / rollout_rs_seq_masked_fraction. Host syncs for the metrics."""
    lr = log_ratio_BL.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    token = {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}
    valid = mask_BL.bool()
    seq_valid = mask_BL.sum(-1) > 0
    combined = torch.ones_like(mask_BL, dtype=log_ratio_BL.dtype)
    metrics: dict[str, float] = {}
    for name, lower, upper in criteria:
        k1, kind = name.endswith("k1"), name[-2:]
        lo, hi = (math.log(lower), math.log(upper)) if k1 else (None, upper)
        if name.startswith("token"):
            stat, seq_stat = token[kind], None
            keep = (stat >= lo) & (stat <= hi) if k1 else stat <= hi
        else:
            if name.startswith("seq_sum"):
                seq_stat = (torch.where(valid, token[kind], 0.0) * mask_BL).sum(-1)
            elif name.startswith("seq_mean"):
                seq_stat = _mmean(token[kind], mask_BL, -1)
            else:
                top = token[kind].masked_fill(~valid, float("-inf")).max(-1).values
                seq_stat = torch.where(top == float("-inf"), torch.zeros_like(top), top)
            seq_keep = (seq_stat >= lo) & (seq_stat <= hi) if k1 else seq_stat <= hi
            keep = seq_keep.unsqueeze(-1).expand_as(valid)
            stat = seq_stat.unsqueeze(-1).expand_as(mask_BL)
        keep_f = keep.to(log_ratio_BL.dtype)
        combined = combined * keep_f
        metrics.update(_criterion_metrics(name, stat, seq_stat, mask_BL, seq_valid, hi, lo if k1 else 0.0, k1))
        seq_kept = (~(~keep & valid)).all(-1).to(log_ratio_BL.dtype)
        metrics[f"rollout_rs_{name}_masked_fraction"] = _mmean(1 - keep_f, mask_BL).item()
        sv = seq_valid.float()
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = (
            (((1.0 - seq_kept) * sv).sum() / sv.sum()).item() if sv.sum() > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = _mmean(1 - combined, mask_BL).item()
    metrics["rollout_rs_seq_masked_fraction"] = (~((combined > 0.5) & valid) & valid).any(-1).float().mean().item()
    return (mask_BL * combined).to(mask_BL.dtype), metrics


def _criterion_metrics(name: str, stat: Tensor, seq_stat: Tensor | None, mask: Tensor, seq_valid: Tensor,
                       upper: float, lower: float, use_lower: bool) -> dict[str, float]:
    """verl's compute_rs_metrics for one criterion (bounds in the statistic's units: logs for k1)."""
    p, valid = f"rollout_rs_{name}", mask.bool()
    seq_vals = (_mmean(stat, mask, -1) if seq_stat is None else seq_stat)[seq_valid]
    seq_level = seq_stat is not None and seq_vals.numel() > 0
    out = {f"{p}_mean": _mmean(stat, mask).item()}
    if seq_level:
        out[f"{p}_max"], out[f"{p}_min"] = seq_vals.max().item(), seq_vals.min().item()
        out[f"{p}_fraction_high"] = (seq_vals > upper).float().mean().item()
        out[f"{p}_fraction_low"] = (seq_vals < lower).float().mean().item() if use_lower else 0.0
    else:
        out[f"{p}_max"] = stat.masked_fill(~valid, float("-inf")).max().item()
        out[f"{p}_min"] = stat.masked_fill(~valid, float("inf")).min().item()
        out[f"{p}_fraction_high"] = _mmean((stat > upper).float(), mask).item()
        out[f"{p}_fraction_low"] = _mmean((stat < lower).float(), mask).item() if use_lower else 0.0
    if mask.sum() > 1:
        c = stat.clamp(min=lower if use_lower else 0.0, max=upper)
        out[f"{p}_std"] = torch.sqrt((_mmean(c.square(), mask) - _mmean(c, mask).square()).clamp(min=0.0)).item()
    else:
        out[f"{p}_std"] = 0.0
    n = seq_vals.numel()
    out[f"{p}_seq_mean"] = seq_vals.mean().item() if n else 0.0
    out[f"{p}_seq_std"] = seq_vals.std().item() if n > 1 else 0.0
    out[f"{p}_seq_max"] = seq_vals.max().item() if n else 0.0
    out[f"{p}_seq_min"] = seq_vals.min().item() if n else 0.0
    out[f"{p}_seq_max_deviation"] = seq_vals.abs().max().item() if n else 0.0
    out[f"{p}_seq_fraction_high"] = (seq_vals > upper).float().mean().item() if n else 0.0
    if use_lower or not n:
        out[f"{p}_seq_fraction_low"] = (seq_vals < lower).float().mean().item() if n else 0.0
    return out

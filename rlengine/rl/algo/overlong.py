"""Over-long responses: what the update does with responses cut at gen.max_tokens.

Sits between rollout and batching (trainer: collect -> shape_overlong -> grpo_batch / ppo_batch).
A response is over-long when the engine stopped it at max_tokens (finish_reason "length"): its
reward judges an unfinished answer. train.overlong chooses:
  none  nothing changes;
  mask  the response gets loss weight 0 (no policy, KL or entropy gradient; DAPO's overlong
        filtering), it still counts in N and in its group's advantage statistics;
  soft  DAPO's soft overlong punishment (Yu et al. 2025, "Overlong Reward Shaping"), added to the reward of every
        response by its length |y|, with L_max = gen.max_tokens and L_cache = train.overlong_buffer:
            R_len(y) = 0                                  |y| <= L_max - L_cache
                       ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
                       -1                                 L_max < |y|
The task's score stays in RolloutGroup.scores (dynamic sampling and the prompt sampler already
used it); the shaped value replaces RolloutGroup.rewards, which advantages are computed from. A greedy
baseline's reward (remax: RolloutGroup.baseline) is shaped by its own length alike.
"""

from __future__ import annotations

from rlengine.rl.rollout_group import RolloutGroup


def soft_overlong_penalty(length: int, max_tokens: int, buffer: int) -> float:
    """DAPO's R_len for a response of `length` tokens (L_max = max_tokens, L_cache = buffer >= 1)."""
    expected = max_tokens - buffer
    if length <= expected:
        return 0.0
    if length <= max_tokens:
        return (expected - length) / buffer
    return -1.0


def shape_overlong(groups: list[RolloutGroup], mode: str, *, max_tokens: int, buffer: int) -> tuple[int, float]:
    """Apply train.overlong to `groups` in place; returns (over-long responses, sum of penalties).

    mode "mask" sets loss_weights (0 for over-long responses); "soft" adds the length penalty to
    rewards. Both keep the unshaped task score in group.scores.
    """
    overlong, penalty = 0, 0.0
    for g in groups:
        flags = [r == "length" for r in g.finish_reasons]
        overlong += sum(flags)
        g.scores = list(g.rewards)
        if mode == "mask":
            g.loss_weights = [0.0 if f else 1.0 for f in flags]
        elif mode == "soft":
            pens = [soft_overlong_penalty(len(c), max_tokens, buffer) for c in g.completions]
            g.rewards = [r + p for r, p in zip(g.rewards, pens)]
            penalty += sum(pens)
            if g.baseline is not None:  # the baseline is the same reward of another response
                g.baseline += soft_overlong_penalty(len(g.baseline_ids), max_tokens, buffer)
    return overlong, penalty

"""Multi-turn rollouts in the RL records: trajectories -> a RolloutGroup, and their metrics.

A trajectory (rl/env/driver.py) becomes one response of its group: completion = every token after the
prompt (model turns and observations, in order), roles 1 / 0, behaviour log-probs on model tokens
(0.0 on observation tokens), the model tokens' weight versions (policy lag = the oldest of them), its
environment's reward. GRPO advantages are then per trajectory, over the G trajectories forked from
the shared prompt prefill, and the learner masks observation tokens out of every loss.
"""

from __future__ import annotations

from rlengine.rl.rollout_group import RolloutGroup


def group_from_trajectories(problem_index: int, out, trajectories: list) -> RolloutGroup:
    """out: the engine's RequestOutput of the G trajectories (its tokens must be the trajectories')."""
    for c, t in zip(out.outputs, trajectories):
        if c.token_ids != t.tokens:  # the engine's sequence and the driver's record must be one history
            raise RuntimeError(f"trajectory {out.request_id}/{c.index}: the engine holds {len(c.token_ids)} tokens, "
                               f"the driver recorded {len(t.tokens)}")
    return RolloutGroup(problem_index, list(out.prompt_token_ids), [list(t.tokens) for t in trajectories],
                        [list(t.logprobs) for t in trajectories], [t.reward for t in trajectories],
                        [list(t.versions) for t in trajectories], [t.finish_reason for t in trajectories],
                        [c.routing_ids for c in out.outputs if c.routing_ids is not None],
                        roles=[list(t.roles) for t in trajectories], turns=[list(t.segments) for t in trajectories],
                        end_reasons=[t.end_reason for t in trajectories])


def trajectory_metrics(groups: list[RolloutGroup], counts: dict | None = None) -> dict:
    """Metrics of a batch's trajectories ({} without any): turns per trajectory under verl's names
    (num_turns/mean, /max, /min), model and observation tokens per trajectory (means), the trajectories
    ended by their environment or cut by each limit, and with `counts` (TrajectoryDriver.counts, running
    totals) observations truncated and in-flight trajectories dropped; tool counts of the update (tools/calls,
    /errors, /timeouts, /seconds, /calls_per_trajectory: the update's calls over the trajectories that ended)."""
    roles = [r for g in groups for r in g.roles]
    if not roles:
        return {}
    n = len(roles)
    turns = [sum(1 for seg in ts if seg[0] == "model") for g in groups for ts in g.turns]
    out = {"num_turns/mean": sum(turns) / n, "num_turns/max": max(turns, default=0),
           "num_turns/min": min(turns, default=0),
           "multi_turn/model_tokens_mean": sum(sum(r) for r in roles) / n,
           "multi_turn/obs_tokens_mean": sum(len(r) - sum(r) for r in roles) / n}
    for reason in ("env", "max_turns", "max_total_tokens", "max_model_len"):
        key = "multi_turn/ended_env" if reason == "env" else f"multi_turn/cut_{reason}"
        out[key] = sum(1 for g in groups for e in g.end_reasons if e == reason)
    for key, value in (counts or {}).items():
        if "/" in key:  # per update already (tools/calls, tools/errors, tools/timeouts, tools/seconds)
            out[key] = value
        elif not key.startswith("cut_"):  # the batch's own cuts are above; running totals of the rest
            out[f"multi_turn/{key}_total"] = value
    if "tools/calls" in out:  # the update's calls over the tool trajectories that ended in it
        out["tools/calls_per_trajectory"] = out["tools/calls"] / max(1, out.pop("tools/trajectories", 0))
    return out


def trajectory_row(group: RolloutGroup, i: int, tok) -> dict:
    """samples.jsonl fields of trajectory i of a group: its turns in order with their roles and text, how it
    ended, its model / observation token counts, and log-prob statistics over its model tokens only."""
    comp, roles = group.completions[i], group.roles[i]
    model_lps = [lp for lp, r in zip(group.logprobs[i], roles) if r]
    turns = [{"role": role, "text": tok.decode(comp[a:e], skip_special_tokens=False), "tokens": e - a}
             for role, a, e in (group.turns[i] if group.turns else [])]
    return {"turns": turns, "end_reason": group.end_reasons[i] if group.end_reasons else "",
            "model_tokens": sum(roles), "observation_tokens": len(roles) - sum(roles),
            "logprob_mean": sum(model_lps) / max(1, len(model_lps)), "logprob_min": min(model_lps, default=0.0)}

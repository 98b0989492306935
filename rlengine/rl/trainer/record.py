"""The metrics record of one update boundary, and the run's telemetry file.

update_record() turns what one update measured (the collector's stats, the learner's metrics, the
engine trace of the boundary, the phase times) into the metrics.jsonl line: the paper's quantities
top-level (N, the rewards, t_gen, t_train, q_gen, q, grad norms, KL to the reference, the
generator-vs-learner log-prob difference, policy lag, lr, the over-long fraction and the B_act
distribution of the boundary's decode steps) and verl's actor/*, critic/*, response_length/* and
prompt_length/* keys (verl_metrics.py; the loop adds timing_s/* and perf/*). Every value is global
over ranks; per-rank views end in `_ranks`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rlengine.model.config import ConfigError
from rlengine.rl.distributed import Dist
from rlengine.rl.rollout.baseline import baseline_metrics
from rlengine.rl.rollout.collector import CollectStats
from rlengine.rl.rollout.trajectories import trajectory_metrics
from rlengine.rl.trainer.run_outputs import replace_lines
from rlengine.rl.trainer.verl_metrics import verl_fields
from rlengine.rl.rollout_group import RolloutGroup
from rlengine.telemetry.records import BoundaryRecord, build_boundary_record


@dataclass(slots=True)
class UpdateTimes:
    """Phase times of one update: this rank's, and the slowest rank's (which gates the update)."""

    t_gen_rank: float
    t_train_rank: float
    t_gen: float
    t_train: float


def engine_mark(llm) -> tuple[int, int, int]:
    """Where the engine's trace and preemption counters stand: the start of an update boundary."""
    return len(llm.trace), llm.scheduler.num_preemptions, llm.scheduler.num_recomputed_tokens


def boundary_since(llm, mark: tuple[int, int, int], *, responses: int, times: UpdateTimes) -> BoundaryRecord:
    """The boundary record of the engine steps since `mark` (engine_mark), with the update's phase times."""
    start, preempt0, recompute0 = mark
    return build_boundary_record(llm.trace[start:], responses=responses, t_gen=times.t_gen, t_train=times.t_train,
                                 preemptions=llm.scheduler.num_preemptions - preempt0,
                                 recomputed_tokens=llm.scheduler.num_recomputed_tokens - recompute0)


def update_record(*, update: int, n: int, critic_only: bool, b_train: int, stats: CollectStats, m: dict,
                  times: UpdateTimes, boundary: BoundaryRecord, groups: list[RolloutGroup], num_seqs: int,
                  consumed: int, overlong: int, penalty: float, soft_overlong: bool, lr: float, dist: Dist,
                  advantages: list[float], has_critic: bool) -> dict:
    """The metrics.jsonl line of one update. Every rank calls it with its own groups (the B_train
    responses it trained on, `num_seqs` of them in its batch, `overlong` of them cut at max_tokens
    with `penalty` the sum of their soft penalties); lags and sums are gathered over ranks here.
    consumed: the weight version the update trained (a response's lag is counted against it).
    advantages: verl_metrics.advantage_sums of the batch after the step. A critic-only update
    logs None for the actor's terms (it has none)."""
    lags = [lag for part in dist.all_gather_objects([g.lag(consumed) for g in groups]) for lag in part]
    seqs, overlong, penalty = dist.all_sum([float(num_seqs), float(overlong), penalty])
    rewards = torch.tensor(stats.rewards, dtype=torch.float64)  # every rank's, in global order
    t_gen, t_train = times.t_gen, times.t_train
    # the update options' statistics (rl/config/update_options.py): clip split, ratio over passes,
    # KL-in-reward, rollout importance weights; absent keys (older learners) log None
    actor = {k: m.get(k) for k in ("loss", "kl_ref", "logprob_diff", "routing_disagreement", "clip_frac_low",
                                   "clip_frac_high", "clip_frac_dual", "ratio_mean", "ratio_max", "kl_reward",
                                   "rollout_is_mean", "rollout_is_max", "rollout_is_capped_frac",
                                   "skipped_passes")}
    actor = dict.fromkeys(actor) if critic_only else actor  # a critic-only update has no actor terms
    record = {
        "update": update, "N": n, "critic_only": critic_only, "skipped": m["skipped"],
        "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std(unbiased=False)),
        "retained_fraction": stats.retained_fraction, "groups_dropped": stats.groups_dropped,
        "stale_dropped": stats.groups_stale, "stale_aborted": stats.stale_aborted,
        "reward_errors": stats.reward_errors,
        "filter_fallback": stats.filter_fallback,
        "t_gen": t_gen, "t_train": t_train, "q_gen": b_train / t_gen, "q": b_train / (t_gen + t_train),
        "actor_grad_norm": m["actor_grad_norm"], "critic_grad_norm": m["critic_grad_norm"],
        **actor, **{k: v for k, v in m.items() if k.startswith("rollout_corr/")},  # verl's names (learner/update.py)
        "policy_lag_mean": sum(lags) / len(lags), "policy_lag_max": max(lags), "lr": lr,
        "b_act_mean": boundary.b_act.mean, "b_act_p50": boundary.b_act.p50, "b_act_p90": boundary.b_act.p90,
        "b_act_frac_time_below": boundary.b_act.frac_time_below, "gen_tokens": boundary.generated_tokens,
        "preemptions": boundary.preemptions,
        "overlong_frac": overlong / max(seqs, 1.0), **stats.reward_components,
        **trajectory_metrics(groups, stats.trajectory_counts),  # multi-turn rollouts only (rollout/trajectories.py)
        **(baseline_metrics(groups, dist) if stats.greedy_baselines else {}),  # remax (rollout/baseline.py)
    }
    if soft_overlong:
        record["overlong_penalty_mean"] = penalty / max(seqs, 1.0)
    record.update(verl_fields(
        m=m, critic_only=critic_only, has_critic=has_critic, scores=stats.scores, advantages=advantages,
        response_lengths=[len(c) for g in groups for c in g.completions],
        prompt_lengths=[len(g.prompt_ids) for g in groups for _ in g.completions],
        finish_reasons=[r for g in groups for r in g.finish_reasons], dist=dist))
    if dist.enabled:  # per-rank views: wall-clock of each rank's phases and its decode batches
        per_rank = dist.all_gather_objects((times.t_gen_rank, times.t_train_rank, boundary.b_act.mean))
        record.update({k: list(v) for k, v in zip(("t_gen_ranks", "t_train_ranks", "b_act_mean_ranks"),
                                                   zip(*per_rank))})
    return record


def write_telemetry(telemetry, history: list[dict], *, b_train: int, dist: Dist, run_dir: Path, gpu: bool) -> None:
    """Per-phase GPU telemetry (or why there is none) to RUN_DIR/telemetry.json. Every rank samples
    its own device; rank 0 gathers them and writes one file (its own summary at the top level,
    every rank's under "ranks"), atomically; a write that fails (a full disk) is a ConfigError naming the
    file, on every rank. It prints the summary, or why there is none only when the run
    asked for a GPU (`gpu`): a CPU run has no GPU to measure (`rlengine info` says why)."""
    steps = [r for r in history if r["update"] > 0]
    summary = telemetry.summary(responses=b_train * len(steps), tokens=sum(r.get("gen_tokens", 0) for r in steps))
    payload = {"available": summary.available, "reason": summary.reason,
               "phases": {k: dataclasses.asdict(v) for k, v in summary.phases.items()}}
    ranks = dist.all_gather_objects(json.loads(json.dumps(payload, default=str)))
    failed = None
    if dist.is_main:
        if summary.available or gpu:
            print(summary.format())
        if dist.enabled:
            payload["ranks"] = ranks
        try:  # whole or not at all (a temporary file renamed): a failed write leaves the old file as it was
            replace_lines(run_dir / "telemetry.json", [json.dumps(payload, indent=2, default=str)])
        except ConfigError as exc:
            failed = str(exc)
    failed = dist.broadcast_object(failed)  # every rank ends alike: none waits for one that raised
    if failed is not None:
        raise ConfigError(failed)

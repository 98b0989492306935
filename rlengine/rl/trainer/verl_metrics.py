"""The metrics row under the names verl users know: actor/*, critic/*, response_length/*, prompt_length/*,
timing_s/* and perf/*.

update_record() (record.py) adds verl_fields() to each update's row: the learner's terms under
actor/ and critic/ (None for the actor's terms on a critic-only warm-up row, and for the critic's
in a job without one), the scores of EVERY response scored for the update (before the
dynamic-sampling filter, which keeps mixed groups and so pulls a retained batch's mean toward
0.5), the advantages over the trained tokens and the batch's lengths. The loop adds
timing_fields() once the update's evaluation and checkpoint are done. Every value is global over
ranks, except the wall-clock phases after the update and the memory peak, which are rank 0's.
The paper's quantities (N, J, t_gen, t_train, q, ...) stay top-level beside these keys.
"""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass

import torch

from rlengine.rl.distributed import Dist


@dataclass(slots=True)
class StepWall:
    """Wall-clock seconds of one update's phases on rank 0: 0.0 for a phase that did not run."""

    testing: float          # evaluation (J) after the update
    save_checkpoint: float  # the periodic checkpoint after it
    step: float             # the whole update: collect, train, evaluate, checkpoint


def _stats(values: list) -> tuple:
    """(mean, max, min) of values (max and min keep their type); Nones for none."""
    if not values:
        return None, None, None
    return sum(values) / len(values), max(values), min(values)


def actor_fields(m: dict, *, critic_only: bool) -> dict:
    """The policy's terms of the learner metrics `m`; None on a critic-only update (no actor step).
    actor/pg_clipfrac_lower is verl's: the fraction held by the dual clip (train.clip_ratio_c), 0 without it."""
    fields = {"actor/pg_loss": m["pg_loss"], "actor/entropy": m["entropy"], "actor/pg_clipfrac": m["clip_frac"],
              "actor/pg_clipfrac_lower": m.get("clip_frac_dual"), "actor/ppo_kl": m["approx_kl"],
              "actor/kl_loss": m["kl_ref"], "actor/grad_norm": m["actor_grad_norm"]}
    return {k: None for k in fields} if critic_only else fields


def advantage_sums(advantages_T: torch.Tensor, valid_T: torch.Tensor) -> list[float]:
    """[count, sum, max, -min] of the advantages on the trained tokens (valid_T) of this rank's batch."""
    a = advantages_T[valid_T].double()
    if a.numel() == 0:
        return [0.0, 0.0, -float("inf"), -float("inf")]
    return [float(a.numel()), float(a.sum()), float(a.max()), float(-a.min())]


def verl_fields(*, m: dict, critic_only: bool, has_critic: bool, scores: list[float], advantages: list[float],
                response_lengths: list[int], prompt_lengths: list[int], finish_reasons: list[str], dist: Dist) -> dict:
    """actor/*, critic/*, response_length/* and prompt_length/* of one update, global over ranks.

    scores: this rank's rewards of every response scored for the update (CollectStats.scores);
    advantages: advantage_sums() of this rank's trained tokens, after the learner step (PPO whitens
    them there); response_lengths / prompt_lengths / finish_reasons: of each response this rank
    trained on. A response cut at gen.max_tokens (finish reason "length", not one whose EOS happened
    to be the last allowed token) counts in response_length/clip_ratio."""
    clipped = [reason == "length" for reason in finish_reasons]
    parts = dist.all_gather_objects((scores, response_lengths, prompt_lengths, clipped))
    scores, response_lengths, prompt_lengths, clipped = ([x for p in parts for x in p[i]] for i in range(4))
    n, total = dist.all_sum(advantages[:2])
    a_max, neg_min = dist.all_max(advantages[2:])
    score_mean, score_max, score_min = _stats(scores)
    len_mean, len_max, len_min = _stats(response_lengths)
    prompt_mean, prompt_max, _ = _stats(prompt_lengths)
    return {
        **actor_fields(m, critic_only=critic_only),
        "critic/vf_loss": m["value_loss"] if has_critic else None,
        "critic/vf_explained_var": m.get("vf_explained_var"),
        "critic/grad_norm": m["critic_grad_norm"],
        "critic/score/mean": score_mean, "critic/score/max": score_max, "critic/score/min": score_min,
        "critic/advantages/mean": total / n if n else None,
        "critic/advantages/max": a_max if n else None, "critic/advantages/min": -neg_min if n else None,
        "response_length/mean": len_mean, "response_length/max": len_max, "response_length/min": len_min,
        "response_length/clip_ratio": sum(clipped) / len(clipped) if clipped else None,
        "prompt_length/mean": prompt_mean, "prompt_length/max": prompt_max,
    }


def peak_memory_gb(device: torch.device) -> float:
    """This process's memory peak in GiB (2^30 bytes, as verl's *_gb): torch.cuda.max_memory_allocated
    on a GPU (tensors only); on the CPU the peak resident set size (getrusage ru_maxrss: everything)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2 ** 30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / 2 ** 30 if sys.platform == "darwin" else rss * 1024 / 2 ** 30


def timing_fields(record: dict, wall: StepWall, *, b_train: int, world: int, device: torch.device) -> dict:
    """timing_s/* and perf/* of an update's record (with verl_fields in it). perf/throughput is verl's:
    the batch's prompt + response tokens per second of the whole update, per device (rank)."""
    tokens = b_train * ((record["prompt_length/mean"] or 0.0) + (record["response_length/mean"] or 0.0))
    return {"timing_s/gen": record["t_gen"], "timing_s/update_actor": record["t_train"],
            "timing_s/testing": wall.testing, "timing_s/save_checkpoint": wall.save_checkpoint,
            "timing_s/step": wall.step, "perf/throughput": tokens / wall.step / world if wall.step > 0 else None,
            "perf/max_memory_allocated_gb": peak_memory_gb(device)}

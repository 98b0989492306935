"""Per-step engine trace and the per-boundary record built from it.

The engine appends one `StepRecord` per step (prefill or decode) to its trace. At each RL
boundary (one rollout collection plus one optimizer update) the trainer hands that trace,
the response count and the measured stage times to `build_boundary_record`, which returns the
quantities of docs/METHOD.md's generation side: q_gen = responses / t_gen, q = responses /
(t_gen + t_train), and the distribution of B_act over decode steps, weighted by step time
(a step that takes twice as long counts twice: the question is what the GPU spent its time on).

A step's `context` (mean tokens attended per sequence, rounded) is what the device clock needs next to
B_act to re-cost the step on another device (rlengine/tune/clock.py).

Simplification: one generated token per sequence per decode step, plus one per sequence that
sampled from prefill logits (`num_seqs_prefilled`: all G members of a forked GRPO group count).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

STEP_KINDS = ("prefill", "decode")


@dataclass(slots=True)
class StepRecord:
    """One engine step, appended by the engine (kept minimal: it is on the decode path)."""

    kind: str                    # "prefill" or "decode"
    b_act: int                   # sequences in the step (B_act(u) for a decode step)
    tokens: int                  # tokens processed: prompt tokens (prefill) or B_act (decode)
    seconds: float               # wall time of the step
    num_seqs_prefilled: int = 0  # sequences that sampled a token from this prefill (forked group members too)
    context: int = 0             # mean tokens attended per sequence (decode: cached + this one; prefill: tokens)


@dataclass(slots=True, kw_only=True)
class BActStats:
    """B_act over the decode steps of one boundary, weighted by step time. None when no decode time."""

    decode_steps: int              # number of decode steps
    decode_seconds: float          # summed decode step time
    mean: float | None             # time-weighted mean B_act
    p10: int | None                # time-weighted 10th percentile of B_act
    p50: int | None                # time-weighted median of B_act
    p90: int | None                # time-weighted 90th percentile of B_act
    peak: int | None               # largest B_act seen
    threshold: int                 # the "low concurrency" threshold used below
    frac_time_below: float | None  # fraction of decode time with B_act < threshold


@dataclass(slots=True, kw_only=True)
class BoundaryRecord:
    """Everything measured at one RL boundary (rollout collection + update)."""

    responses: int               # responses collected in this boundary (retained or not: the caller decides)
    generated_tokens: int        # tokens sampled: decode tokens + one per completed prefill
    prefill_tokens: int          # prompt tokens run through prefill (includes recomputation)
    t_gen: float                 # seconds of the generation stage (wall time, from the caller)
    t_train: float               # seconds of the training stage (log-prob + update)
    q_gen: float                 # responses / t_gen
    q: float                     # responses / (t_gen + t_train)
    gen_tokens_per_s: float      # generated_tokens / t_gen
    prefill_steps: int           # engine prefill steps in the trace
    prefill_seconds: float       # summed prefill step time
    step_seconds: float          # summed step time; t_gen - step_seconds is host time outside steps
    b_act: BActStats             # decode concurrency distribution
    preemptions: int             # recompute preemptions during the boundary
    recomputed_tokens: int       # tokens prefilled again because of preemption

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _weighted_percentile(sorted_pairs: list[tuple[int, float]], total: float, frac: float) -> int:
    """Smallest value whose cumulative weight reaches `frac` of the total (pairs sorted by value)."""
    target = frac * total
    acc = 0.0
    for value, weight in sorted_pairs:
        acc += weight
        if acc >= target * (1 - 1e-12):
            return value
    return sorted_pairs[-1][0]


def b_act_stats(trace: Sequence[StepRecord], threshold: int | None = None) -> BActStats:
    """Time-weighted B_act statistics over the decode steps of `trace`.

    `threshold` defaults to half the peak B_act (rounded up): the fraction of decode time spent
    below it is the "ragged tail" of a rollout, when most sequences have finished.
    """
    decode = [(r.b_act, r.seconds) for r in trace if r.kind == "decode"]
    peak = max((b for b, _ in decode), default=None)
    if threshold is None:
        threshold = (peak + 1) // 2 if peak else 0
    if threshold < 0:
        raise ValueError(f"b_act_stats: threshold must be >= 0, got {threshold}")
    total = sum(s for _, s in decode)
    if total <= 0:
        return BActStats(decode_steps=len(decode), decode_seconds=total, mean=None, p10=None, p50=None,
                         p90=None, peak=peak, threshold=threshold, frac_time_below=None)
    pairs = sorted(decode)
    return BActStats(
        decode_steps=len(decode), decode_seconds=total,
        mean=sum(b * s for b, s in decode) / total,
        p10=_weighted_percentile(pairs, total, 0.10),
        p50=_weighted_percentile(pairs, total, 0.50),
        p90=_weighted_percentile(pairs, total, 0.90),
        peak=peak, threshold=threshold,
        frac_time_below=sum(s for b, s in decode if b < threshold) / total,
    )


def _check_trace(trace: Sequence[StepRecord]) -> None:
    for i, r in enumerate(trace):
        if r.kind not in STEP_KINDS:
            raise ValueError(f"trace[{i}].kind must be one of {STEP_KINDS}, got {r.kind!r}")
        if r.b_act < 0 or r.tokens < 0 or r.num_seqs_prefilled < 0:
            raise ValueError(f"trace[{i}]: b_act, tokens and num_seqs_prefilled must be >= 0, got {r}")
        if not r.seconds >= 0:
            raise ValueError(f"trace[{i}].seconds must be >= 0, got {r.seconds!r}")


def build_boundary_record(trace: Sequence[StepRecord], *, responses: int, t_gen: float, t_train: float,
                          preemptions: int = 0, recomputed_tokens: int = 0,
                          b_act_threshold: int | None = None) -> BoundaryRecord:
    """Summarise one boundary. t_gen > 0 and t_train >= 0 are wall seconds measured by the caller."""
    _check_trace(trace)
    if responses < 0:
        raise ValueError(f"responses must be >= 0, got {responses}")
    if not t_gen > 0:
        raise ValueError(f"t_gen must be > 0 seconds, got {t_gen!r}")
    if not t_train >= 0:
        raise ValueError(f"t_train must be >= 0 seconds, got {t_train!r}")
    if preemptions < 0 or recomputed_tokens < 0:
        raise ValueError(f"preemptions and recomputed_tokens must be >= 0, got {preemptions}, {recomputed_tokens}")
    prefill = [r for r in trace if r.kind == "prefill"]
    generated = sum(r.tokens for r in trace if r.kind == "decode") + sum(r.num_seqs_prefilled for r in prefill)
    return BoundaryRecord(
        responses=responses, generated_tokens=generated,
        prefill_tokens=sum(r.tokens for r in prefill),
        t_gen=t_gen, t_train=t_train,
        q_gen=responses / t_gen, q=responses / (t_gen + t_train),
        gen_tokens_per_s=generated / t_gen,
        prefill_steps=len(prefill), prefill_seconds=sum(r.seconds for r in prefill),
        step_seconds=sum(r.seconds for r in trace),
        b_act=b_act_stats(trace, b_act_threshold),
        preemptions=preemptions, recomputed_tokens=recomputed_tokens,
    )

"""What each column of `rlengine bench decode` means: one line each, printed under the tables and
written to the JSON as "columns" (decode rows) and "prefill_columns" (the prefill section).

The step-time wording depends on --timing (decode_rounds.py), so explain() takes it.
"""

from __future__ import annotations

_STEP = {"difference": "(wall(generate gen-len tokens) - wall(generate 1)) / (gen-len - 1), median of --reps rounds",
         "steps": "mean decode step from the per-step records, median of --reps rounds"}

DECODE = {
    "context": "prompt length the row was drawn around (--contexts; --length-dist makes prompts ragged)",
    "b_act": "active sequences in every decode step (B_act)",
    "tokens_per_s": "rlengine decode tokens per second: b_act / (ms_per_step / 1000)",
    "ms_per_step": "rlengine ms per decode step: {step}",
    "trace_ms_per_step": "rlengine ms per step from the engine's decode StepRecords (cross-check of ms_per_step)",
    "p50_ms": "median rlengine decode step (engine StepRecords, every step of every round)",
    "p90_ms": "90th percentile rlengine decode step (engine StepRecords)",
    "p99_ms": "99th percentile rlengine decode step (engine StepRecords)",
    "prefill_tokens_per_s": "rlengine prompt tokens per second of the row's prefill steps (engine StepRecords)",
    "hf_ms_per_step": "transformers generate() ms per decode step, dynamic cache, eager: {step}",
    "hf_stream_ms_per_step": "transformers ms per step from the streamer's token gaps (cross-check of hf_ms_per_step)",
    "hf_p99_ms": "99th percentile transformers step (streamer token gaps)",
    "ratio": "hf_ms_per_step / ms_per_step: how many times faster rlengine decodes (> 1: rlengine faster)",
    "hf_same_frac": "fraction of sequences whose greedy tokens equal transformers', over every round",
    "roofline_fraction": "tokens_per_s / the roofline bound (docs/METHOD.md Eq. 5, measured ceilings)",
    "hf_static_ms_per_step": "transformers ms per step, static cache + torch.compile: {step}",
    "static_ratio": "hf_static_ms_per_step / ms_per_step",
    "hf_static_same_frac": "fraction of sequences whose greedy tokens equal the static-cache provider's",
    "eager_ms_per_step": "rlengine ms per step with CUDA graphs off (--compare-eager)",
    "graph_speedup": "eager_ms_per_step / ms_per_step",
    "peak_mem_mb": "peak device memory allocated during rlengine's generate calls (GPU only)",
    "decode_j_per_token": "decode-phase joules per generated token from NVML (GPU only)",
}

PREFILL = {
    "prompt_len": "tokens in each prompt (--prefill-len)",
    "b": "prompts prefilled together (--prefill-batch)",
    "ms": "rlengine wall(generate 1 token) in ms: prefill + one sample, median of --reps rounds",
    "tokens_per_s": "rlengine prompt tokens per second: b * prompt_len / ms",
    "hf_ms": "transformers wall(generate 1 token) in ms, dynamic cache, eager, same weights and dtype",
    "hf_tokens_per_s": "transformers prompt tokens per second",
    "ratio": "hf_ms / ms (> 1: rlengine prefills faster)",
    "hf_static_ms": "transformers wall(generate 1 token), static cache + torch.compile",
    "static_ratio": "hf_static_ms / ms",
}


def explain(columns: list[str], table: dict[str, str], timing: str) -> dict[str, str]:
    """{column: one-line meaning} for the columns shown, step-time wording for `timing`."""
    return {c: table[c].format(step=_STEP[timing]) for c in columns if c in table}


def legend(columns: dict[str, str]) -> str:
    """The lines printed under a table: 'column: meaning', names aligned."""
    width = max(map(len, columns), default=0)
    return "\n".join(f"  {c.ljust(width)}  {text}" for c, text in columns.items())

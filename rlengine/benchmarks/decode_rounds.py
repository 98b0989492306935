"""One timed round of each provider in `rlengine bench decode`, and the prefill section.

A round generates greedily (EOS ignored) for a list of prompts. Two timing methods
(--timing), chosen per run and applied to both providers alike:
  "difference" (default): wall(generate gen_len tokens) - wall(generate 1 token), divided by
      gen_len - 1, on the same prompts and weights. The prefill, the first sample and the
      call's fixed costs cancel; what is left is the mean decode step, each provider's own
      per-step host work included. Under heavy load the two walls can move apart, so the
      per-step figures below are kept beside it as a cross-check.
  "steps": the per-step figures themselves: rlengine's decode StepRecords (llm.generate's
      trace) and, for transformers, the gaps between new tokens handed to a streamer.
Both are measured in every round (one extra 1-token call per round in "steps" mode costs
little), so the JSON carries both whatever the table shows. The prefill section times
wall(generate 1 token) of a --prefill-len prompt for both providers: prefill + one sample.
"""

from __future__ import annotations

import time

import torch

from rlengine.benchmarks.hf_baseline import HFProvider
from rlengine.engine.llm import LLM
from rlengine.engine.sampling_params import SamplingParams

TIMINGS = ("difference", "steps")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: int):
    """(wall seconds, GenerateResult) of one llm.generate call."""
    _sync(llm.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    _sync(llm.device)
    return time.perf_counter() - t0, outs


def ours_round(llm: LLM, prompts: list[list[int]], gen_len: int, telemetry=None) -> dict:
    """One rlengine round: wall of a 1-token and a gen_len-token generate, the decode step records of
    the long one, prefill tokens / seconds, the tokens of every sequence and the peak device memory."""
    device = llm.device
    wall_1, _ = _generate(llm, prompts, 1)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    wall_n, outs = _generate(llm, prompts, gen_len)
    if telemetry is not None:
        telemetry.set_phase("idle")
    decode = [r for r in outs.trace if r.kind == "decode"]
    assert all(r.b_act == len(prompts) for r in decode), "B_act varied within a run"
    prefill = [r for r in outs.trace if r.kind == "prefill"]
    return {"difference_s": (wall_n - wall_1) / (gen_len - 1), "steps_s": sum(r.seconds for r in decode) / len(decode),
            "steps": [r.seconds for r in decode], "decode_tokens": sum(r.tokens for r in decode),
            "prefill_tokens": sum(r.tokens for r in prefill), "prefill_s": sum(r.seconds for r in prefill),
            "tokens": [o.outputs[0].token_ids for o in outs],
            "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}


def hf_round(provider: HFProvider, prompts: list[list[int]], gen_len: int) -> dict | None:
    """One transformers round, the same fields as ours_round's timing ones; None when it ran out of device memory."""
    device = provider.hf.device
    try:
        _sync(device)
        t0 = time.perf_counter()
        provider.step_times(prompts, 1)
        _sync(device)
        wall_1 = time.perf_counter() - t0
        t0 = time.perf_counter()
        steps, tokens = provider.step_times(prompts, gen_len)
        _sync(device)
        wall_n = time.perf_counter() - t0
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None
    return {"difference_s": (wall_n - wall_1) / (gen_len - 1), "steps_s": sum(steps) / len(steps), "steps": steps,
            "tokens": tokens}


def prefill_round(llm: LLM, providers: list[HFProvider], prompts: list[list[int]]) -> dict[str, float]:
    """Seconds of wall(generate 1 token) for rlengine ("ours") and each transformers provider, in that order."""
    times = {"ours": _generate(llm, prompts, 1)[0]}
    for p in providers:
        _sync(p.hf.device)
        t0 = time.perf_counter()
        p.step_times(prompts, 1)
        _sync(p.hf.device)
        times[p.mode] = time.perf_counter() - t0
    return times

"""What Eq. 5 leaves out of a job's B_gen knee, measured on this machine: `rlengine tune --predict cpu`.

Eq. 5 (docs/METHOD.md) bounds a decode step by the bytes and FLOPs it must move. On a CPU with a small
model the step is set instead by fixed host work (scheduling, sampling, kernel calls: ~1 ms for the tiny
preset) plus a share per sequence, and q, the quantity stage 2 measures, also pays the learner's time per
response, which no B_gen changes. So the prediction with measured costs uses the paper's generation cost
model t_dec(B) ~ d0 + d1 B (as a floor under Eq. 5's bound), fitted from decode steps of the job's model
at two batch sizes, and the learner's seconds per response from one update-sized forward and backward:

    q(B) = 1 / (L x t_dec(B) / B + t_train)      L = gen.max_tokens, t_train per response

Both measurements use random weights and tokens (times do not depend on their values) and the job's
dtype, at the torch thread count the tune runs with. The optimizer step is left out of t_train (one
pass over the parameters: small next to the forward and backward of B_train sequences).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCosts:
    """Measured costs of one job on one machine (seconds)."""

    d0: float                       # fixed cost of a decode step
    d1: float                       # added cost per sequence in a decode step
    train_per_response: float       # learner forward + backward seconds per training response
    response_len: int               # L: decode steps per response (the job's gen.max_tokens)
    batches: tuple[int, int]        # the two decode batch sizes d0 and d1 were fitted from
    step_s: tuple[float, float]     # median decode step at each of them


def _decode_step_s(model, batch: int, prompt_len: int, steps: int) -> float:
    """Median seconds of the decode steps at full B_act of one generate of `batch` random prompts."""
    from rlengine import LLM, SamplingParams

    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, model.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(batch)]
    llm = LLM(model, max_num_seqs=batch, max_model_len=prompt_len + steps + 1, enforce_eager=True)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=steps, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up: kernel choices, first touch of the pool
    trace = llm.generate(prompts, params).trace
    return statistics.median(r.seconds for r in trace if r.kind == "decode" and r.b_act == batch)


def _learner_s(model, sequences: int, seq_len: int) -> float:
    """Seconds of the learner's forward + backward of token log-probs over sequences x seq_len tokens
    (the second of two passes: the first makes one-time allocations)."""
    from rlengine.rl.learner.batching import TrainBatch
    from rlengine.rl.learner.logprobs import token_logprobs

    mb = TrainBatch.random_tokens(model.config.vocab_size, sequences, seq_len, model.device)
    seconds = 0.0
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logp, ent = token_logprobs(model, mb, 1.0, False)
        (logp.sum() + ent.sum()).backward()
        seconds = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return seconds


def measure_step_costs(job: dict, *, batches: tuple[int, int] = (16, 128), prompt_len: int = 16,
                       steps: int = 12) -> StepCosts:
    """d0, d1 and t_train of the job's model on this machine's CPU (the job's dtype; random weights).

    Decode: `steps` tokens after `prompt_len`-token prompts at each of `batches`; learner: the job's
    B_train sequences of prompt_len + gen.max_tokens tokens. Takes seconds for the tiny presets.
    """
    from rlengine.model.qwen3 import Qwen3ForCausalLM
    from rlengine.tune.predict import job_model_config

    small, large = batches
    if not 1 <= small < large:
        raise ValueError(f"measure_step_costs: need 1 <= batches[0] < batches[1], got {batches}")
    cfg = job_model_config(job)
    model = Qwen3ForCausalLM(cfg, seed=0, dtype=getattr(torch, job["model"]["dtype"]))
    with torch.no_grad():
        t_small, t_large = (_decode_step_s(model, b, prompt_len, steps) for b in batches)
    d1 = max(0.0, (t_large - t_small) / (large - small))
    d0 = max(0.0, t_small - d1 * small)
    b_train, max_tokens = int(job["train"]["b_train"]), int(job["gen"]["max_tokens"])
    train = _learner_s(model, b_train, prompt_len + max_tokens) / b_train
    return StepCosts(d0=d0, d1=d1, train_per_response=train, response_len=max_tokens, batches=(small, large),
                     step_s=(t_small, t_large))

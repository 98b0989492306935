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

With a cost table (`rlengine tune --predict TABLE.json`, table_knee) the same q(B) is read off the table
instead (decode(B, context) by the table's own interpolation, the learner and optimizer per response):
the cost model the device clock re-costs a clocked stage 2 with, so the two agree by construction.
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


@dataclass(frozen=True, slots=True, kw_only=True)
class TableKnee:
    """The end-to-end q knee of a job on a cost table's device (`rlengine tune --predict TABLE.json`)."""

    clock: str                      # the table, as every figure names it (tune/clock.py DeviceClock.label)
    context: int                    # mean context a decode step is costed at
    response_len: int               # L: decode steps per response (gen.max_tokens)
    train_per_response: float       # (learner(B_train x tokens per response) + optimizer_s) / B_train, seconds
    critical_b: int                 # smallest B with q(B) >= (1 - delta) q(b_max)
    q_max: float                    # q(b_max), responses/s
    b_max: int                      # min(the cap asked, the table's largest B_act): never extrapolated
    delta: float


def table_knee(table, job: dict, *, path: str, context: int, delta: float = 0.1, b_max: int = 4096) -> TableKnee:
    """The knee of q(B) = 1 / (L decode(B, context) / B + t_train per response) on a CostTable: the same
    interpolation the device clock re-costs stage 2's runs with (tune/clock.py), so the predicted knee and
    a clocked stage 2 read one cost model. B above the table's largest B_act is not considered."""
    from rlengine.tune.clock import DeviceClock
    from rlengine.tune.predict import _smallest_b

    b_train, max_tokens = int(job["train"]["b_train"]), int(job["gen"]["max_tokens"])
    prompt_len = max(1, context - max_tokens // 2)   # learner tokens per response: the prompt and the response
    learner, _ = table.learner_s(b_train * (prompt_len + max_tokens))
    train = (learner + table.optimizer_s) / b_train
    (_, b_top), _ = table.decode_range()
    top = min(b_max, b_top)

    def q(b: int) -> float:
        return 1.0 / (max_tokens * table.decode_s(b, context)[0] / b + train)

    q_top = q(top)
    return TableKnee(clock=DeviceClock(table=table, path=path).label, context=context, response_len=max_tokens,
                     train_per_response=train, critical_b=_smallest_b(q, (1 - delta) * q_top, top), q_max=q_top,
                     b_max=top, delta=delta)


def format_table_knee(k: TableKnee, b_train: int) -> str:
    return (f"predicted B_gen knee on the clock {k.clock}: critical B_gen {k.critical_b} (smallest B with q >= "
            f"(1 - {k.delta}) q({k.b_max}) = {(1 - k.delta) * k.q_max:.4g} responses/s); {k.critical_b / b_train:.2g} "
            f"x B_train {b_train}\n  decode costed at context {k.context}, L = {k.response_len}; learner + optimizer "
            f"{k.train_per_response * 1e3:.3f} ms/response; B above the table's largest B_act ({k.b_max}) not considered")

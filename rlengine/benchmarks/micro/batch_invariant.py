"""Benchmark: the cost of batch-invariant mode (model/batch_invariant.py) on the CPU, side by side.

Per model and dtype, in one process and alternating the two modes round by round:
- decode step time at each B_act: (wall(generate `tokens` new tokens) - wall(generate 1)) / (tokens - 1),
  B_act sequences of 16-token prompts, seeded sampling at temperature 1; the default mode runs the
  engine's fastest path (cpp attention, the measured kernel choice), the invariant mode
  LLM(batch_invariant=True);
- learner step time: the training forward (log-probs of a packed GRPO batch) and its backward.
Reports median ms of `reps` rounds and invariant / default. Goals: decode within 1.25x, learner
within 2x. Example:
    python bench/bench_batch_invariant.py --models tiny,qwen3-30m --batches 1,8,32,64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from rlengine import LLM, SamplingParams
from rlengine.benchmarks.harness import report
from rlengine.model.config import preset
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import grpo_batch
from rlengine.rl.learner.logprobs import token_logprobs
from rlengine.rl.rollout_group import RolloutGroup

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
COLUMNS = ["model", "dtype", "phase", "B", "default_ms", "invariant_ms", "ratio"]


def _generate_s(llm: LLM, prompts, new_tokens: int) -> float:
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=new_tokens, ignore_eos=True)
              for i in range(len(prompts))]
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def _decode_step_ms(model, llm: LLM, invariant: bool, prompts, tokens: int) -> float:
    model.batch_invariant = invariant
    return 1e3 * (_generate_s(llm, prompts, tokens) - _generate_s(llm, prompts, 1)) / (tokens - 1)


def _train_batch(cfg, B: int, prompt_len: int, response_len: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    groups = []
    for p in range(B // 8):
        prompt = torch.randint(3, cfg.vocab_size, (prompt_len,), generator=g).tolist()
        comps = [torch.randint(3, cfg.vocab_size, (response_len,), generator=g).tolist() for _ in range(8)]
        groups.append(RolloutGroup(p, prompt, comps, [[-1.0] * response_len] * 8, [float(i % 2) for i in range(8)],
                                   [[0] * response_len] * 8, ["length"] * 8))
    return grpo_batch(groups, normalize_std=True)


def _learner_step_ms(model, invariant: bool, mb) -> float:
    model.batch_invariant = invariant
    model.zero_grad(set_to_none=True)
    t0 = time.perf_counter()
    logp, _ = token_logprobs(model, mb, 1.0, fused=False)
    (logp * mb.loss_mask).sum().backward()
    return 1e3 * (time.perf_counter() - t0)


def run(models: list[str], dtypes: list[str], batches: list[int], tokens: int, reps: int,
        train_batch: int) -> list[dict]:
    rows = []
    for name in models:
        for dname in dtypes:
            model = Qwen3ForCausalLM(preset(name), seed=0, dtype=DTYPES[dname])
            max_b = max(batches)
            fast = LLM(model, max_num_seqs=max_b, max_model_len=16 + tokens + 1, attention_backend="cpp")
            inv = LLM(model, max_num_seqs=max_b, max_model_len=16 + tokens + 1, batch_invariant=True)
            for B in batches:
                prompts = torch.randint(3, model.config.vocab_size, (B, 16),
                                        generator=torch.Generator().manual_seed(B)).tolist()
                ms = {False: [], True: []}
                for rep in range(reps + 1):
                    for mode, llm in ((False, fast), (True, inv)):
                        t = _decode_step_ms(model, llm, mode, prompts, tokens)
                        if rep:  # round 0 warms both up
                            ms[mode].append(t)
                rows.append(_row(name, dname, "decode step", B, ms))
                print(f"  {name} {dname} decode B_act={B}: {rows[-1]['default_ms']:.2f} vs "
                      f"{rows[-1]['invariant_ms']:.2f} ms", flush=True)
            mb = _train_batch(model.config, train_batch, 16, tokens, seed=1)
            ms = {False: [], True: []}
            for rep in range(reps + 1):
                for mode in (False, True):
                    t = _learner_step_ms(model, mode, mb)
                    if rep:
                        ms[mode].append(t)
            rows.append(_row(name, dname, "learner fwd+bwd", train_batch, ms))
            print(f"  {name} {dname} learner B_train={train_batch}: {rows[-1]['default_ms']:.1f} vs "
                  f"{rows[-1]['invariant_ms']:.1f} ms", flush=True)
            model.batch_invariant = False
    return rows


def _row(name, dname, phase, B, ms) -> dict:
    d, i = statistics.median(ms[False]), statistics.median(ms[True])
    return {"model": name, "dtype": dname, "phase": phase, "B": B, "default_ms": round(d, 3),
            "invariant_ms": round(i, 3), "ratio": round(i / d, 3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--models", default="tiny,qwen3-30m", help="comma-separated presets")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--batches", default="1,8,32,64", help="decode B_act values")
    p.add_argument("--tokens", type=int, default=32, help="new tokens per decode measurement")
    p.add_argument("--train-batch", type=int, default=64, help="responses in the learner's batch (multiple of 8)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default); 1 is steadier on a "
                                                            "loaded machine")
    p.add_argument("--out", default=None, help="directory of the JSON (default bench/results)")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = run(a.models.split(","), a.dtypes.split(","), [int(b) for b in a.batches.split(",")], a.tokens, a.reps,
               a.train_batch)
    report("batch_invariant", rows, out=a.out, columns=COLUMNS,
           extra={"threads": torch.get_num_threads(), "method": "decode: (wall(generate tokens) - wall(generate 1)) / (tokens - 1), median of reps, "
                            "modes alternating; learner: token_logprobs forward + backward"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

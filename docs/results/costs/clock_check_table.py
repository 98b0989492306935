"""The device clock's check on this CPU, part 2: this CPU's step-cost table for grpo_long's model.

    python docs/results/costs/clock_check_table.py OUT.json

A stand-in for `rlengine bench costs` (same CostTable format, rlengine/analysis/cost_table.py), measured
on the process-CPU clock at one torch thread, as the runs of clock_check_runs.py are timed:
- decode (B_act, context): one engine (LLM, the job's model and dtype, random weights, max_num_seqs B)
  generates for B / G random prompts of context - 12 tokens with the job's sampling (n = G samples each,
  unseeded, temperature 1), 4 and then 20 tokens (ignore_eos); the CPU seconds of the difference over
  the 16 extra decode steps (mean context = the grid's context). Median of 3.
- prefill tokens: a generate of max_tokens 1, n = G, over prompts totalling that many tokens (the step
  and its G samples per prompt, as the job's forked groups). Median of 3.
- learner tokens: forward + backward of the token log-probs and entropy (what the learner's pass does)
  plus the gradient-norm clip, over sequences of the job's length (prompt + max_tokens). Median of 3.
- optimizer: one AdamW step over the model's parameters. Median of 5.
"""

import statistics
import sys
import time

import torch

from rlengine import LLM, SamplingParams
from rlengine.analysis.cost_table import CostTable
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.config import load_job_config
from rlengine.rl.learner.batching import TrainBatch
from rlengine.rl.learner.logprobs import token_logprobs
from rlengine.telemetry.provenance import cpu_model
from rlengine.tune.predict import job_model_config

torch.set_num_threads(1)
job = load_job_config("grpo_long", []).to_dict()
dtype = job["model"]["dtype"]
model = Qwen3ForCausalLM(job_model_config(job), seed=0, dtype=getattr(torch, dtype))
V = model.config.vocab_size
gen = torch.Generator().manual_seed(0)
BATCHES, CONTEXTS, PREFILL, SEQ = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160), (24, 48, 96), (13, 26, 104, 416, 1664), 58
G = job["train"]["group_size"]


def cpu(fn) -> float:
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def prompts(n: int, length: int) -> list[list[int]]:
    return [torch.randint(3, V, (length,), generator=gen).tolist() for _ in range(n)]


params = lambda k, n=1: SamplingParams(n=n, temperature=1.0, max_tokens=k, ignore_eos=True)  # noqa: E731
with torch.no_grad():
    decode = []
    for b in BATCHES:
        llm = LLM(model, max_num_seqs=b, max_model_len=128, seed=0)
        n = G if b % G == 0 else 1
        llm.generate(prompts(b // n, 20), params(8, n))  # warm-up: kernel choices, first touch of the pool
        for ctx in CONTEXTS:
            ps = prompts(b // n, ctx - 12)
            reps = [(cpu(lambda: llm.generate(ps, params(20, n))) - cpu(lambda: llm.generate(ps, params(4, n)))) / 16
                    for _ in range(3)]
            decode.append((b, ctx, max(statistics.median(reps), 1e-7)))
            print("decode", decode[-1], flush=True)
    prefill = []
    llm = LLM(model, max_num_seqs=max(BATCHES), max_model_len=128, seed=0)
    for tokens in PREFILL:
        ps = prompts(max(1, tokens // 26), min(tokens, 26))
        prefill.append((tokens, statistics.median(cpu(lambda: llm.generate(ps, params(1, G))) for _ in range(3))))
        print("prefill", prefill[-1], flush=True)

learner = []
for seqs in (8, 16, 32, 64, 128):
    mb = TrainBatch.random_tokens(V, seqs, SEQ, model.device)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        logp, ent = token_logprobs(model, mb, 1.0, False)
        (logp.sum() + ent.sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    fwd_bwd()
    learner.append((seqs * SEQ, statistics.median(cpu(fwd_bwd) for _ in range(3))))
    print("learner", learner[-1], flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
opt.step()
optimizer_s = statistics.median(cpu(opt.step) for _ in range(5))
table = CostTable(model=job["model"]["name"], dtype=dtype, kind="measured", decode=tuple(decode),
                  prefill=tuple(prefill), learner=tuple(learner), optimizer_s=optimizer_s,
                  provenance={"device": f"cpu ({cpu_model()})", "clock": "process CPU seconds", "threads": 1,
                              "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "method": "docs/results/costs/clock_check_table.py", "learner_seq_len": SEQ})
print(table.save(sys.argv[1]))

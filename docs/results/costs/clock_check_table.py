"""The device clock's check on this CPU, part 2: this CPU's step-cost table for grpo_long's model.

    python docs/results/costs/clock_check_table.py OUT.json [HOST_RUNS_DIR]

A stand-in for `rlengine bench costs` (same CostTable format, rlengine/analysis/cost_table.py), measured
on the process-CPU clock at one torch thread, as the runs of clock_check_runs.py are timed:
- decode (B_act, context): one engine (LLM, the job's model and dtype, random weights, max_num_seqs B)
  generates for B / G random prompts of context - 12 tokens with the job's sampling (n = G samples each,
  unseeded, temperature 1), 4 and then 20 tokens (ignore_eos); the CPU seconds of the difference over
  the 16 extra decode steps (mean context = the grid's context). Median of 3.
- prefill tokens: a generate of max_tokens 1, n = G, over prompts totalling that many tokens (the step
  and its G samples per prompt, as the job's forked groups). Median of 3.
- learner tokens: forward of the token log-probs and entropy and the backward of the clipped surrogate
  (the entropy's gradient only when the job's entropy_coef is not 0, as the learner's loss), over
  sequences of the job's length (prompt + max_tokens). Median of 5.
- optimizer: the gradient-norm clip and one AdamW step over the model's parameters (once per update, as
  Learner.step does them). Median of 5.
- host work outside every recorded step (the collector, rewards, batching, the learner's bookkeeping):
  two short runs of the job of its own (seed 1, HOST_UPDATES updates, coupled, at B_train / 2 and
  B_train), timed as the validation runs are (the tuner's runner, process CPU, one thread); each update's
  measured t_gen / t_train minus its steps re-costed on the table above, fitted as a + b x responses per
  phase (rlengine.tune.clock.host_terms): the table's host_update_s and host_response_s.
"""

import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from rlengine import LLM, SamplingParams
from rlengine.analysis.cost_table import CostTable
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.plan.specs import PlanChange
from rlengine.rl.config import load_job_config
from rlengine.rl.learner.batching import TrainBatch
from rlengine.rl.learner.logprobs import token_logprobs
from rlengine.rl.trainer.trace_file import read_trace
from rlengine.telemetry.provenance import cpu_model
from rlengine.tune.clock import host_terms
from rlengine.tune.predict import job_model_config
from rlengine.tune.runner import TrainerRunner
from rlengine.tune.stage_records import RunPlan

torch.set_num_threads(1)
job = load_job_config("grpo_long", []).to_dict()
dtype = job["model"]["dtype"]
model = Qwen3ForCausalLM(job_model_config(job), seed=0, dtype=getattr(torch, dtype))
V = model.config.vocab_size
gen = torch.Generator().manual_seed(0)
BATCHES, CONTEXTS, PREFILL, SEQ = (1, 2, 4, 8, 16, 32, 64, 96, 128, 160), (24, 48, 96), (13, 26, 104, 416, 1664), 58
HOST_UPDATES, HOST_SEED = 30, 1
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
ENTROPY = job["train"]["entropy_coef"]  # the entropy's gradient only when the job's loss has an entropy term
for seqs in (8, 16, 32, 64, 128):
    mb = TrainBatch.random_tokens(V, seqs, SEQ, model.device)
    adv = torch.randn(seqs * SEQ, generator=gen)

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        logp, ent = token_logprobs(model, mb, 1.0, False)
        ratio = torch.exp(logp - logp.detach())  # the clipped surrogate's arithmetic, as the policy loss does it
        loss = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv).mean() - ENTROPY * ent.mean()
        loss.backward()

    fwd_bwd()
    learner.append((seqs * SEQ, statistics.median(cpu(fwd_bwd) for _ in range(5))))
    print("learner", learner[-1], flush=True)
opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
opt.step()


def clip_and_step():  # once per update, as Learner.step: the gradient-norm clip, then the optimizer
    torch.nn.utils.clip_grad_norm_(model.parameters(), job["train"]["max_grad_norm"])
    opt.step()


optimizer_s = statistics.median(cpu(clip_and_step) for _ in range(5))
table = CostTable(model=job["model"]["name"], dtype=dtype, kind="measured", decode=tuple(decode),
                  prefill=tuple(prefill), learner=tuple(learner), optimizer_s=optimizer_s,
                  provenance={"device": f"cpu ({cpu_model()})", "clock": "process CPU seconds", "threads": 1,
                              "torch": torch.__version__, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "method": "docs/results/costs/clock_check_table.py", "learner_seq_len": SEQ})


def host_runs(out: Path) -> list[tuple[list[dict], list[dict]]]:
    """(metric records, trace lines) of the job's own short coupled runs at B_train / 2 and B_train."""
    b = job["train"]["b_train"]
    plans = [RunPlan(name=f"host{bt}", stage="run", label=str(bt), seed=HOST_SEED, target_j=None,
                     change=PlanChange(b_train=bt, b_gen=bt, updates=HOST_UPDATES, eval_every_responses=HOST_UPDATES * bt))
             for bt in (b // 2, b)]
    TrainerRunner(job, out, clock="cpu", threads=1, workers=1).map(plans)
    runs = []
    for plan in plans:
        run_dir = out / "runs" / plan.name
        records = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        runs.append((records, read_trace(run_dir)))
    return runs


with tempfile.TemporaryDirectory() as tmp:  # the host runs are kept in HOST_RUNS_DIR when it is given
    per_update, per_response = host_terms(table, host_runs(Path(sys.argv[2] if len(sys.argv) > 2 else tmp)))
table = dataclasses.replace(table, host_update_s=per_update, host_response_s=per_response, provenance={
    **table.provenance, "host_terms": f"two coupled runs of the job (seed {HOST_SEED}, {HOST_UPDATES} updates, B_train "
    f"{job['train']['b_train'] // 2} and {job['train']['b_train']}): measured t_gen / t_train minus the steps on this "
    "table, a + b x responses per phase (rlengine.tune.clock.host_terms)"})
print("host per update (gen, train)", per_update, "per response", per_response)
print(table.save(sys.argv[1]))

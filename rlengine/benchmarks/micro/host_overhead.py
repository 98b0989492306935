"""Benchmark: the engine's host-side work per decode step, without the forward (CPU).

What the host does around a decode step's kernels: schedule (Scheduler.schedule: blocks for the
next token, copy-on-write), prepare (StepInputs.prepare: the step's inputs from the persistent
per-row tables into the staging buffer, plus the attention backend's plan()) and postprocess
(StepInputs.launched / tokens_read and LLM._postprocess: the sampled tokens into the sequences,
finish conditions). The
forward and the sampler are not run: tokens come from a constant array, as if read back. On a GPU
this is the time the device waits for the host at small B_act, and what overlap scheduling would
hide. B_act sequences of `context` + (7 i mod 16) tokens (block size 16: page crossings spread over
the steps, as in a real batch), every one in the decode batch, a stub model config (1 layer, 2-dim
heads) so the KV cache stays small; median (and p90) over the timed steps, then the median over
--rounds repetitions of each point (the CPU is shared: a burst of load on one round must not decide).
Providers: "after" is this tree; "before" rows (commit 1177efb, page tables rebuilt from Python
lists per step) are kept in the output JSON from an earlier measurement (--before FILE merges
them in: rows with B_act, context, total_us). Targets for the host cost of one decode step:
< 50 us at B_act = 1, < 0.5 ms at B_act = 256 with 4k context.
    python bench/bench_host_overhead.py --grid "B=1,16,256 S=512,4096" --out docs/results
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from rlengine import LLM, SamplingParams
from rlengine.model.config import preset
from rlengine.engine.model_runner import StepOutput
from rlengine.model.qwen3 import Qwen3ForCausalLM

from rlengine.benchmarks.harness import parse_grid, report

P = 16
COLUMNS = ["B_act", "context", "schedule_us", "prepare_us", "postprocess_us", "total_us", "total_p90_us",
           "before_us", "speedup"]


def _stub_model() -> Qwen3ForCausalLM:
    cfg = preset("tiny").replace(num_hidden_layers=1, num_attention_heads=1, num_key_value_heads=1, head_dim=2,
                                 hidden_size=8, intermediate_size=8, max_position_embeddings=16384)
    return Qwen3ForCausalLM(cfg)


def measure(B: int, S: int, steps: int, warmup: int = 5) -> dict:
    """Median host microseconds of the pieces of one decode step at B_act = B, context S."""
    max_len = S + P + steps + warmup + 8
    llm = LLM(_stub_model(), max_num_seqs=B, block_size=P, num_kv_blocks=B * -(-max_len // P) + 8,
              max_model_len=max_len, attention_backend="cpp")
    params = SamplingParams(temperature=1.0, max_tokens=steps + warmup + 4, ignore_eos=True)
    for i in range(B):
        llm.add_request([3 + (i + j) % 200 for j in range(S + 7 * i % P)], params)
    sched, inputs, backend = llm.scheduler, llm.runner.inputs, llm.backend
    times: dict[str, list[float]] = {"schedule": [], "prepare": [], "postprocess": []}
    read_tokens, read_logprobs = np.full(B, 7, np.int32), np.full(B, -1.0, np.float32)  # as if read back
    while sched.waiting or len(times["schedule"]) < steps + warmup:
        t0 = time.perf_counter()
        batch = sched.schedule()
        t1 = time.perf_counter()
        prep = inputs.prepare(batch)
        backend.plan(prep.fb)
        t2 = time.perf_counter()
        tokens, logprobs = read_tokens[:len(batch.samples)], read_logprobs[:len(batch.samples)]
        inputs.launched(prep)
        inputs.tokens_read(prep, tokens)
        llm.outputs.process(batch, StepOutput(tokens.tolist(), logprobs.tolist(), None), 0)
        t3 = time.perf_counter()
        if batch.kind == "decode":
            assert len(batch.seqs) == B, "every sequence decodes in every timed step"
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[name].append(dt)
    row = {"B_act": B, "context": S}
    total = [sum(parts) for parts in zip(*(v[warmup:] for v in times.values()))]
    for name, v in times.items():
        row[f"{name}_us"] = statistics.median(v[warmup:]) * 1e6
    row["total_us"] = statistics.median(total) * 1e6
    row["total_p90_us"] = statistics.quantiles(total, n=10)[-1] * 1e6
    return row


def _before_rows(args) -> list[dict]:
    if args.before:
        return json.loads(Path(args.before).read_text())
    existing = Path(args.out or Path("bench") / "results") / "host_overhead.json"
    if existing.is_file():
        return json.loads(existing.read_text()).get("before", [])
    return []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--grid", default="B=1,4,16,64,256 S=512,2048,4096,8192", help="B_act and context axes")
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per point")
    p.add_argument("--rounds", type=int, default=3, help="repetitions of each point (median of their medians)")
    p.add_argument("--before", default=None, help="JSON list of 'before' rows to merge (B_act, context, total_us)")
    p.add_argument("--out", default=None, help="output folder for host_overhead.json (default bench/results)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # host work: one thread, as the engine's Python runs
    before = {(r["B_act"], r["context"]): r for r in _before_rows(args)}
    rows = []
    for case in parse_grid(args.grid):
        runs = [measure(int(case["B"]), int(case["S"]), args.steps) for _ in range(args.rounds)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        ref = before.get((row["B_act"], row["context"]))
        row["before_us"] = ref["total_us"] if ref else None
        row["speedup"] = ref["total_us"] / row["total_us"] if ref else None
        rows.append(row)
        print(row, flush=True)
    report("host_overhead", rows, out=args.out, columns=COLUMNS, device="cpu",
           extra={"before": list(before.values()), "block_size": P, "steps": args.steps,
                  "before_commit": "1177efb", "targets_us": {"B_act=1": 50, "B_act=256,context=4096": 500}})
    return 0


if __name__ == "__main__":
    sys.exit(main())

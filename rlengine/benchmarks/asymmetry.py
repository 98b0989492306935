"""`rlengine bench asymmetry`: generation vs training cost as the batch grows (PAPER.md, generation side).

For each batch B (responses), on one model and this machine: collect B responses through
the engine (max_num_seqs = B, fixed response length so every B does the same work per
response) and time it (t_gen); run one learner update on them (t_train). Medians over
--reps. Then fit t_gen = d0 + d1*B and t_train = gamma*B, report the critical generation
batch (smallest B with q_gen >= (1 - delta) * max q_gen), and the paper's figures: collection
time and generation-throughput ratios against the smallest B, and the training-time ratio.
Writes JSON rows {b, responses, t_gen, t_train, q_gen, ...} that tools/plots.py asymmetry reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from rlengine.analysis.fits import critical_generation_batch, fit_generation_time, fit_training_time
from rlengine.config import DTYPES, preset
from rlengine.engine import LLM, SamplingParams
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.batching import grpo_batch
from rlengine.rl.config import TrainSection
from rlengine.rl.learner import Learner
from rlengine.rl.rollout import RolloutGroup



def _measure(model, b: int, G: int, prompt_len: int, gen_len: int, backend: str, seed: int) -> tuple[float, float]:
    llm = LLM(model, max_num_seqs=b, attention_backend=backend, max_model_len=prompt_len + gen_len + 1, seed=seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, model.config.vocab_size, (prompt_len,), generator=gen).tolist() for _ in range(b // G)]
    params = SamplingParams(n=G, temperature=1.0, max_tokens=gen_len, ignore_eos=True, seed=seed)
    llm.capture_decode_graphs()  # GPU: outside the timed region (no-op without CUDA graphs)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    t_gen = time.perf_counter() - t0
    groups = [RolloutGroup(i, o.prompt_token_ids, [c.token_ids for c in o.outputs], [c.logprobs for c in o.outputs],
                           [float(j % 2) for j in range(G)], [c.policy_versions for c in o.outputs],
                           [c.finish_reason for c in o.outputs]) for i, o in enumerate(outs)]
    learner = Learner(model, TrainSection(prompts_per_step=b // G, group_size=G, lr=1e-9))
    batch = grpo_batch(groups, normalize_std=True).to(model.device)
    t1 = time.perf_counter()
    learner.step(batch)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return t_gen, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench asymmetry", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30m", help="preset name")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batches", default="8,16,32,64", help="comma-separated B (responses; multiples of G)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--backend", default="auto")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--delta", type=float, default=0.1, help="tolerance of the critical generation batch")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    if len(batches) < 2:
        raise SystemExit("--batches needs at least two batch sizes to fit t_gen = d0 + d1*B")
    bad = [b for b in batches if b % args.group_size]
    if bad:
        raise SystemExit(f"--batches {bad} are not multiples of --group-size {args.group_size}")
    model = Qwen3ForCausalLM(preset(args.model), device=args.device, dtype=DTYPES[args.dtype])
    _measure(model, batches[0], args.group_size, args.prompt_len, 4, args.backend, 0)  # warm-up
    rows = []
    for b in batches:
        runs = [_measure(model, b, args.group_size, args.prompt_len, args.gen_len, args.backend, r)
                for r in range(args.reps)]
        t_gen = statistics.median(r[0] for r in runs)
        t_train = statistics.median(r[1] for r in runs)
        rows.append({"b": b, "responses": b, "t_gen": t_gen, "t_train": t_train, "q_gen": b / t_gen,
                     "q": b / (t_gen + t_train)})
    ref = rows[0]
    for r in rows:
        r.update(t_gen_ratio=r["t_gen"] / ref["t_gen"], q_gen_ratio=r["q_gen"] / ref["q_gen"],
                 t_train_ratio=r["t_train"] / ref["t_train"], responses_ratio=r["b"] / ref["b"])
    gen_fit = fit_generation_time([r["b"] for r in rows], [r["t_gen"] for r in rows])
    train_fit = fit_training_time([r["b"] for r in rows], [r["t_train"] for r in rows])
    b_crit = critical_generation_batch([r["b"] for r in rows], [r["q_gen"] for r in rows], args.delta)
    cols = ["b", "t_gen", "t_train", "q_gen", "responses_ratio", "t_gen_ratio", "q_gen_ratio", "t_train_ratio"]
    print(f"model={args.model} dtype={args.dtype} device={args.device} G={args.group_size} "
          f"prompt={args.prompt_len} gen={args.gen_len} reps={args.reps} threads={torch.get_num_threads()}")
    print("  ".join(f"{c:>15}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>15.4g}" for c in cols))
    print(f"fit t_gen = d0 + d1*B: d0={gen_fit.d0:.4g} s, d1={gen_fit.d1:.4g} s/response (r2={gen_fit.r2:.3f})")
    print(f"fit t_train = gamma*B: gamma={train_fit.gamma:.4g} s/response (r2={train_fit.r2:.3f})")
    print(f"critical generation batch (delta={args.delta}): B={b_crit:g}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "asymmetry.json"
    path.write_text(json.dumps({
        "name": "asymmetry", "rows": rows, "fit": {"d0": gen_fit.d0, "d1": gen_fit.d1, "r2_gen": gen_fit.r2,
                                                   "gamma": train_fit.gamma, "r2_train": train_fit.r2},
        "critical_generation_batch": b_crit, "delta": args.delta,
        "conditions": {"model": args.model, "dtype": args.dtype, "device": args.device, "torch": torch.__version__,
                       "threads": torch.get_num_threads(), "group_size": args.group_size,
                       "prompt_len": args.prompt_len, "gen_len": args.gen_len, "reps": args.reps,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S")}}, indent=2))
    print(f"wrote {path}")
    return 0

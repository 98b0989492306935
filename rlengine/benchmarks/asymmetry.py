"""`rlengine bench asymmetry`: generation vs training cost as the batch grows (docs/METHOD.md, generation side).

For each batch B (responses), on one model and this machine: collect B responses through the
engine (max_num_seqs = B) and time it (t_gen); run one learner update on them (t_train).
Method:
  - One engine per B and ONE learner (one optimizer) for the whole sweep. Every B gets an
    untimed warm-up repetition (engine allocations, CUDA-graph capture, optimizer state), so
    no timed region allocates optimizer state or runs a first-call path.
  - Response lengths: --length-dist fixed (every response --gen-len tokens: each B does the
    same work per response) or ragged (uniform / lognormal with mean --gen-len, drawn per
    repetition). Ragged is what d0 means: the tail of a rollout where few sequences still run.
    Fixed lengths use n=G requests (the prompt is prefilled once and forked); ragged lengths
    need one request per response (each its own max_tokens), so the prompt is prefilled G times.
  - Medians over --reps per B for the table; the fits t_gen = d0 + d1*B and t_train = gamma*B
    use every repetition, with standard errors and bootstrap intervals (analysis/fits.py).
Then the critical generation batch (smallest B with q_gen >= (1 - delta) * max q_gen) and the
paper's figures: collection time and generation-throughput ratios against the smallest B, and
the training-time ratio. --profile DIR records one more (untimed) repetition at the largest B.
Writes asymmetry.json rows {b, responses, t_gen, t_train, q_gen, ...} that tools/plots.py reads.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from rlengine.analysis.fits import bootstrap_fits, critical_generation_batch, fit_generation_time, fit_training_time
from rlengine.benchmarks.args import add_model_options, check_args, int_list
from rlengine.benchmarks.lengths import add_length_args, sample_lengths
from rlengine.benchmarks.report import format_table, write_result
from rlengine.model.config import DTYPES, ConfigError, preset
from rlengine.engine import LLM, SamplingParams
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import grpo_batch
from rlengine.rl.config import TrainSection
from rlengine.rl.distributed import Dist, init_from_env
from rlengine.rl.learner.learner import Learner
from rlengine.rl.rollout_group import RolloutGroup
from rlengine.telemetry.profiler import ProfileWindow, step_profiler

COLUMNS = ["b", "t_gen", "t_train", "q_gen", "mean_response_len", "responses_ratio", "t_gen_ratio", "q_gen_ratio",
           "t_train_ratio"]


def _requests(args, vocab: int, b: int, rep: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Prompts and params for B responses: B/G prompts, each answered G times."""
    G, seed = args.group_size, 7919 * b + rep
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(b // G)]
    if args.length_dist == "fixed":
        group = SamplingParams(n=G, temperature=1.0, max_tokens=args.gen_len, ignore_eos=True, seed=seed)
        return prompts, [group] * len(prompts)
    lens = sample_lengths(args.length_dist, args.gen_len, b, seed=seed, hi=3 * args.gen_len)
    params = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True, seed=seed + i) for i, n in enumerate(lens)]
    return [p for p in prompts for _ in range(G)], params


def _groups(outs, G: int) -> list[RolloutGroup]:
    """Responses grouped per prompt (G consecutive n=1 requests, or one n=G request)."""
    comps = [c for o in outs for c in o.outputs]
    prompts = [o.prompt_token_ids for o in outs for _ in o.outputs]
    groups = []
    for i in range(0, len(comps), G):
        cs = comps[i:i + G]
        groups.append(RolloutGroup(i // G, prompts[i], [c.token_ids for c in cs], [c.token_logprobs for c in cs],
                                   [float(j % 2) for j in range(G)], [c.policy_versions for c in cs],
                                   [c.finish_reason for c in cs]))
    return groups


def _one(args, llm: LLM, learner: Learner, b: int, rep: int, profiler=None, dist: Dist | None = None) -> dict:
    """One timed repetition: collect B responses, one update. With a profiler: stepwise, for the trace.
    Several ranks: prompt j of the B/G goes to rank j mod K; the update is one DDP step over all."""
    prompts, params = _requests(args, llm.config.vocab_size, b, rep)
    if dist is not None and dist.enabled:
        per_prompt = 1 if args.length_dist == "fixed" else args.group_size  # requests per prompt
        mine = [i for i in range(len(prompts)) if (i // per_prompt) % dist.world == dist.rank]
        prompts, params = [prompts[i] for i in mine], [params[i] for i in mine]
    sync = torch.cuda.synchronize if llm.device.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    if not prompts:
        outs = []
    elif profiler is None:
        outs = llm.generate(prompts, params)
    else:  # the same requests through the step API, so the profiler sees engine steps
        ids = [llm.add_request(p, q) for p, q in zip(prompts, params)]
        done = {}
        while llm.has_unfinished():
            done.update((o.request_id, o) for o in llm.step())
            profiler.step()
        outs = [done[i] for i in ids]
    t_gen = time.perf_counter() - t0
    groups = _groups(outs, args.group_size)
    batch = grpo_batch(groups, normalize_std=True).to(llm.device)
    sync()
    t1 = time.perf_counter()
    learner.step(batch)
    sync()
    t_train = time.perf_counter() - t1
    if profiler is not None:
        profiler.step()
    tokens = sum(len(g) for gr in groups for g in gr.completions)
    out = {"t_gen": t_gen, "t_train": t_train, "tokens": tokens}
    if dist is not None and dist.enabled:  # the slowest rank gates the node; q_gen sums over ranks
        ranks = dist.all_gather_objects((t_gen, t_train, sum(len(g.completions) for g in groups)))
        out = {"t_gen": max(r[0] for r in ranks), "t_train": max(r[1] for r in ranks),
               "tokens": dist.all_sum([tokens])[0], "t_gen_ranks": [r[0] for r in ranks],
               "t_train_ranks": [r[1] for r in ranks], "responses_ranks": [r[2] for r in ranks]}
    return out


def _fits(rows: list[dict]) -> dict:
    """Fits over every repetition, with standard errors and (when there are >= 3 points) bootstrap intervals."""
    bs = [r["b"] for r in rows for _ in r["t_gen_reps"]]
    tg = [t for r in rows for t in r["t_gen_reps"]]
    tt = [t for r in rows for t in r["t_train_reps"]]
    gen, train = fit_generation_time(bs, tg), fit_training_time(bs, tt)
    fit = {"d0": gen.d0, "d1": gen.d1, "r2_gen": gen.r2, "d0_se": gen.d0_se, "d1_se": gen.d1_se,
           "gamma": train.gamma, "r2_train": train.r2, "gamma_se": train.gamma_se, "points": len(bs),
           "bootstrap": None}
    if len(bs) >= 3:
        iv = bootstrap_fits(bs, tg, tt, resamples=2000, level=0.9)
        fit["bootstrap"] = {"level": iv.level, "resamples": iv.resamples, "d0": iv.d0, "d1": iv.d1, "gamma": iv.gamma}
    return fit


def _print_fits(fit: dict) -> None:
    se = lambda v: "" if v is None else f" +- {v:.2g}"  # noqa: E731
    print(f"fit t_gen = d0 + d1*B over {fit['points']} points: d0={fit['d0']:.4g}{se(fit['d0_se'])} s, "
          f"d1={fit['d1']:.4g}{se(fit['d1_se'])} s/response (r2={fit['r2_gen']:.3f}; +- one standard error)")
    print(f"fit t_train = gamma*B: gamma={fit['gamma']:.4g}{se(fit['gamma_se'])} s/response (r2={fit['r2_train']:.3f})")
    if fit["bootstrap"]:
        iv = fit["bootstrap"]
        fmt = lambda k: f"[{iv[k][0]:.4g}, {iv[k][1]:.4g}]"  # noqa: E731
        print(f"bootstrap {iv['level']:.0%} intervals: d0 {fmt('d0')}, d1 {fmt('d1')}, gamma {fmt('gamma')}")
    else:
        print("bootstrap intervals: need >= 3 points (more --batches or --reps)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench asymmetry", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument("--batches", default="8,16,32,64", help="comma-separated B (responses; multiples of G)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=32, help="response length (the mean when ragged)")
    add_length_args(p, "response lengths")
    p.add_argument("--backend", default="auto")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--delta", type=float, default=0.1, help="tolerance of the critical generation batch")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads")
    p.add_argument("--profile", default=None, metavar="DIR", help="trace one untimed repetition at the largest B")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--nproc", type=int, default=None, metavar="K",
                   help="K ranks on this node (torchrun, one device each): per-rank and node-level rows")
    args = p.parse_args(argv)
    check_args(args, positive=("group_size", "prompt_len", "gen_len", "reps", "nproc"))
    preset(args.model)
    batches = int_list(args.batches, "--batches")
    if len(batches) < 2:
        raise ConfigError("--batches needs at least two batch sizes to fit t_gen = d0 + d1*B")
    bad = [b for b in batches if b % args.group_size]
    if bad:
        raise ConfigError(f"--batches {bad} are not multiples of --group-size {args.group_size}")
    if args.nproc is not None and "WORLD_SIZE" not in os.environ:
        return _launch(args.nproc, list(argv if argv is not None else sys.argv[1:]))
    dist = init_from_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = f"cuda:{dist.local_rank}" if args.device == "cuda" and dist.enabled else args.device
    model = Qwen3ForCausalLM(preset(args.model), device=device, dtype=DTYPES[args.dtype])
    max_len = args.prompt_len + (args.gen_len if args.length_dist == "fixed" else 3 * args.gen_len) + 1
    learner = Learner(model, TrainSection(prompts_per_step=max(batches) // args.group_size,
                                          group_size=args.group_size, lr=1e-9), dist=dist)
    rows, llm = [], None
    for b in batches:
        llm = LLM(model, max_num_seqs=b, attention_backend=args.backend, max_model_len=max_len, seed=b)
        llm.capture_decode_graphs()  # GPU: outside the timed region (no-op without CUDA graphs)
        _one(args, llm, learner, b, rep=-1, dist=dist)  # warm-up of this B: engine, graphs, optimizer state
        runs = [_one(args, llm, learner, b, r, dist=dist) for r in range(args.reps)]
        t_gen, t_train = statistics.median(r["t_gen"] for r in runs), statistics.median(r["t_train"] for r in runs)
        rows.append({"b": b, "responses": b, "t_gen": t_gen, "t_train": t_train, "q_gen": b / t_gen,
                     "q": b / (t_gen + t_train), "mean_response_len": statistics.fmean(r["tokens"] for r in runs) / b,
                     "t_gen_reps": [r["t_gen"] for r in runs], "t_train_reps": [r["t_train"] for r in runs]})
        if dist.enabled:  # per rank: median over reps of its own phase times and responses / t_gen
            med = [statistics.median(r["t_gen_ranks"][k] for r in runs) for k in range(dist.world)]
            resp = runs[0]["responses_ranks"]
            rows[-1].update(ranks=dist.world, t_gen_ranks=med, responses_ranks=resp,
                            t_train_ranks=[statistics.median(r["t_train_ranks"][k] for r in runs)
                                           for k in range(dist.world)],
                            q_gen_ranks=[n / t if t > 0 else 0.0 for n, t in zip(resp, med)])
    ref = rows[0]
    for r in rows:
        r.update(t_gen_ratio=r["t_gen"] / ref["t_gen"], q_gen_ratio=r["q_gen"] / ref["q_gen"],
                 t_train_ratio=r["t_train"] / ref["t_train"], responses_ratio=r["b"] / ref["b"])
    fit = _fits(rows)
    b_crit = critical_generation_batch([r["b"] for r in rows], [r["q_gen"] for r in rows], args.delta)
    if not dist.is_main:
        dist.close()
        return 0
    if dist.enabled:
        print(f"per rank ({dist.world} ranks; the node row below takes the slowest rank's t_gen / t_train):")
        print(format_table([{"b": r["b"], "rank": k, "responses": r["responses_ranks"][k],
                             "t_gen": r["t_gen_ranks"][k], "t_train": r["t_train_ranks"][k],
                             "q_gen": r["q_gen_ranks"][k]} for r in rows for k in range(dist.world)],
                           ["b", "rank", "responses", "t_gen", "t_train", "q_gen"]))
        print("node (global):")
    print(f"model={args.model} dtype={args.dtype} device={args.device} G={args.group_size} prompt={args.prompt_len} "
          f"gen={args.gen_len} ({args.length_dist}) reps={args.reps} threads={torch.get_num_threads()}")
    print(format_table(rows, COLUMNS))
    _print_fits(fit)
    print(f"critical generation batch (delta={args.delta}): B={b_crit:g}")
    if args.profile:
        prof = step_profiler(args.profile, name="asymmetry", window=ProfileWindow(0, 10**9), device=model.device,
                             ranges=[r for r in (getattr(llm, "ranges", None), getattr(learner, "ranges", None)) if r])
        with prof:
            _one(args, llm, learner, batches[-1], rep=args.reps, profiler=prof)
        print(f"profile: {prof.trace_path} {prof.note}".rstrip())
    write_result(args.out, "asymmetry", rows, device=model.device, llm=llm, fit=fit,
                 critical_generation_batch=b_crit, delta=args.delta, conditions={
                     "model": args.model, "dtype": args.dtype, "group_size": args.group_size,
                     "prompt_len": args.prompt_len, "gen_len": args.gen_len, "length_dist": args.length_dist,
                     "reps": args.reps, "warmup": "one untimed repetition per B; one learner for the sweep",
                     "ranks": dist.world})
    dist.close()
    return 0


def _launch(nproc: int, argv: list[str]) -> int:
    """--nproc K: the same command on K ranks through torch's elastic launcher (what torchrun runs)."""
    from torch.distributed.run import get_args_parser, run

    rest, skip = [], False
    for a in argv:  # drop --nproc K / --nproc=K
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    run(get_args_parser().parse_args(["--nproc-per-node", str(nproc), "--standalone", "-m", "rlengine",
                                      "bench", "asymmetry", *rest]))
    return 0

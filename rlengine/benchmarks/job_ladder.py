"""`rlengine bench job_ladder`: a job's throughput q over B_gen with the policy frozen (the asymmetry itself).

For one job (default: the packaged long-response job, grpo_long) at its B_train, each B_gen of the
ladder runs the job for --updates updates with train.lr = 0: every update still generates, scores and
runs the learner's forward, backward and optimizer step, but the weights never move, so every rung
samples the same policy and differs only in how generation is batched. B_gen > B_train is the
asynchronous mode (partial rollouts) with gen.max_lag at the lag its B_gen implies, so no lag abort
caps it. Per probe, over updates skip+1 .. updates (skip grows with B_gen / B_train: the pipeline
fill, tune/ladder.probe_window):
  q = responses / sum(t_gen + t_train), q_gen = responses / sum(t_gen), gen_share = sum(t_gen) / sum(t_gen + t_train),
and the time-weighted active decode batch b_act. Each rung is probed --repeats times, the rungs
interleaved ascending then descending so a drift in the machine's load lands on all of them; the
table gives the mean and the spread (max - min) of q, and q_ratio against the coupled rung.

    python bench/bench_job_ladder.py [--config grpo_long] [--b-gen 32,64,128,256] [--updates 24] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from rlengine.benchmarks.args import int_list
from rlengine.benchmarks.harness import report
from rlengine.tune.ladder import implied_max_lag, probe_window

COLUMNS = ["b_gen", "q", "q_spread", "q_ratio", "q_gen", "gen_share", "b_act", "resp_len", "probes"]


def _probe(config: str, b_gen: int, b_train: int, updates: int, skip: int, seed: int, out: Path,
           extra: list[str]) -> dict:
    """One frozen-policy run of the job at b_gen; the window's figures."""
    from rlengine.rl.config import load_job_config
    from rlengine.rl.trainer import Trainer

    lead, end = probe_window(b_gen, b_train, skip, updates)
    overrides = ["--train.lr", "0", "--train.warmup_updates", "0", "--gen.b_gen", str(b_gen),
                 "--gen.max_lag", str(implied_max_lag(b_gen, b_train)),
                 "--train.updates", str(end), "--eval.every", str(10 * end), "--eval.k", "1", "--task.num_eval", "16",
                 "--run.checkpoint_every", "0", "--run.progress", "false", "--run.seed", str(seed),
                 "--run.out_dir", str(out), "--run.overwrite", "true", *extra]
    cfg = load_job_config(config, overrides)
    if cfg.train.b_train != b_train:
        raise ValueError(f"the job's B_train is {cfg.train.b_train}, not {b_train}")
    Trainer(cfg).run()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "t_gen" in r][lead:end]
    t_gen = sum(r["t_gen"] for r in rows)
    t = t_gen + sum(r["t_train"] for r in rows)
    responses = b_train * len(rows)
    return {"q": responses / t, "q_gen": responses / t_gen, "gen_share": t_gen / t,
            # an async update whose responses were all generated earlier decodes nothing: b_act_mean is None
            "b_act": statistics.fmean([r["b_act_mean"] for r in rows if r["b_act_mean"] is not None] or [0.0]),
            "resp_len": statistics.fmean(r["response_length/mean"] for r in rows), "window": [lead + 1, end]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench job_ladder", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="grpo_long", help="the job: a packaged config name or a TOML file")
    p.add_argument("--b-gen", type=lambda t: int_list(t, "--b-gen"), default=None, help="B_gen rungs (default: 1, 2, 4, 8 x B_train)")
    p.add_argument("--updates", type=int, default=24, help="updates per probe's window end (before the fill skip)")
    p.add_argument("--skip", type=int, default=4, help="leading updates left out (at least B_gen / B_train)")
    p.add_argument("--repeats", type=int, default=2, help="probes per rung (ascending, then descending, ...)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a dotted job override, e.g. train.group_size=8 (repeatable)")
    p.add_argument("--out", default=None, help="directory for job_ladder.json (default bench/results)")
    args = p.parse_args(argv)
    if args.updates <= args.skip or args.repeats < 1:
        p.error("--updates must exceed --skip and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    extra = [f"--{kv.split('=', 1)[0]}={kv.split('=', 1)[1]}" for kv in args.override if "=" in kv]
    if len(extra) != len(args.override):
        p.error("--override takes KEY=VALUE")

    from rlengine.rl.config import load_job_config
    b_train = load_job_config(args.config, extra).train.b_train
    values = sorted(set(args.b_gen or [m * b_train for m in (1, 2, 4, 8)]))
    if values[0] < b_train:
        p.error(f"every B_gen must be >= the job's B_train ({b_train}), got {values}")
    probes: dict[int, list[dict]] = {b: [] for b in values}
    order = [b for r in range(args.repeats) for b in (values if r % 2 == 0 else values[::-1])]
    with tempfile.TemporaryDirectory() as tmp:
        for i, b_gen in enumerate(order):
            probes[b_gen].append(_probe(args.config, b_gen, b_train, args.updates, args.skip, args.seed,
                                        Path(tmp) / f"p{i}", extra))
            print(f"probe B_gen {b_gen}: q {probes[b_gen][-1]['q']:.1f} responses/s", flush=True)
    rows = []
    for b_gen in values:
        ps = probes[b_gen]
        qs = [x["q"] for x in ps]
        rows.append({"b_gen": b_gen, "q": statistics.fmean(qs), "q_spread": max(qs) - min(qs),
                     "q_gen": statistics.fmean(x["q_gen"] for x in ps),
                     "gen_share": statistics.fmean(x["gen_share"] for x in ps),
                     "b_act": statistics.fmean(x["b_act"] for x in ps),
                     "resp_len": statistics.fmean(x["resp_len"] for x in ps), "probes": len(ps), "q_reps": qs,
                     "windows": [x["window"] for x in ps]})
    for r in rows:
        r["q_ratio"] = r["q"] / rows[0]["q"]
    report("job_ladder", rows, out=args.out, columns=COLUMNS,
           extra={"config": args.config, "b_train": b_train, "updates": args.updates, "skip": args.skip,
                  "repeats": args.repeats, "seed": args.seed, "overrides": extra, "threads": torch.get_num_threads(),
                  "policy": "frozen (train.lr = 0)"})
    return 0

"""Run the long-response job on fresh seeds and summarise each run (docs/RESULTS.md, long-response job).

    python docs/results/long_job/fresh_seeds.py --seeds 100-111 --workers 2 --out docs/results/long_job/fresh_seeds.json

Each run is `rlengine train --config grpo_long --run.seed S` at the shipped configuration, one torch
thread (OMP_NUM_THREADS=1), `workers` runs at a time. Per seed: J at update 0, the first evaluation with
J >= 0.8 (update, N, loop time), final J, the generation share sum(t_gen) / sum(t_gen + t_train) (over the
run and over its first 50 updates), the mean response length and the wall time; then the sd of log N*.
Loop time is the updates' and evaluations' own time (timing_s/step + timing_s/testing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def run_seed(seed: int, root: Path, extra: list[str], updates: int | None) -> dict:
    """One run; a run already in `root` that stopped short of `updates` is resumed to it (a resume
    continues as if never stopped: tests/rl/test_run_lifecycle.py), its wall the sum of the parts."""
    out = root / f"seed{seed}"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "rlengine", "train", "--config", "grpo_long", "--run.seed", str(seed),
           "--run.progress", "false", "--run.checkpoint_every", "0", "--run.out_dir", str(out), *extra]
    wall_file, before = out.with_suffix(".wall"), 0.0
    if (out / "metrics.jsonl").is_file() and updates:
        cmd = [sys.executable, "-m", "rlengine", "train", "--resume", str(out), "--train.updates", str(updates)]
        before = float(wall_file.read_text())
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    wall = before + time.perf_counter() - t0
    wall_file.write_text(str(wall))
    return summarise(out / "metrics.jsonl", wall) | ({"resumed_after_s": round(before, 1)} if before else {})


def summarise(metrics: Path, wall: float) -> dict:
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    loop, curve = 0.0, []
    for r in rows:
        loop += (r.get("timing_s/step") or 0.0) + (r.get("timing_s/testing") or 0.0)
        if r.get("J") is not None:
            curve.append({"update": r["update"], "N": r["N"], "J": r["J"], "t_loop_s": round(loop, 1)})
    steps = [r for r in rows if r["update"] > 0]
    share = lambda rs: sum(r["t_gen"] for r in rs) / sum(r["t_gen"] + r["t_train"] for r in rs)
    lengths = [r["response_length/mean"] for r in steps]
    hit = next((c for c in curve if c["J"] >= 0.8), None)
    return {"wall_s": round(wall, 1), "loop_s": round(loop, 1), "J0": curve[0]["J"], "first_J_0.8": hit,
            "final_J": curve[-1]["J"], "gen_share": share(steps), "gen_share_first50": share(steps[:50]),
            "resp_len_mean": sum(lengths) / len(lengths), "updates": len(steps), "curve": curve}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="100-111", help="A-B or a comma list")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--runs-dir", default="/tmp/long_job_fresh")
    p.add_argument("--out", required=True)
    p.add_argument("--extend-to", type=int, default=None,
                   help="resume runs already in --runs-dir that stopped short, to this many updates")
    p.add_argument("extra", nargs="*", help="more train options, after --")
    a = p.parse_args()
    seeds = (list(range(int(a.seeds.split("-")[0]), int(a.seeds.split("-")[1]) + 1)) if "-" in a.seeds
             else [int(s) for s in a.seeds.split(",")])
    root = Path(a.runs_dir)
    results: dict[str, dict] = {}

    def one(seed: int) -> None:
        results[str(seed)] = run_seed(seed, root, a.extra, a.extend_to)
        r = results[str(seed)]
        print(f"seed {seed}: J0 {r['J0']:.2f}, first J>=0.8 {r['first_J_0.8']}, final {r['final_J']:.2f}, "
              f"gen share {r['gen_share']:.2f}, len {r['resp_len_mean']:.1f}, wall {r['wall_s']} s", flush=True)
        write(a.out, seeds, results, a.extra, a.workers)

    with ThreadPoolExecutor(a.workers) as pool:
        list(pool.map(one, seeds))
    write(a.out, seeds, results, a.extra, a.workers)
    return 0


def write(path: str, seeds: list[int], results: dict, extra: list[str], workers: int) -> None:
    hits = [r["first_J_0.8"]["N"] for r in results.values() if r["first_J_0.8"]]
    logs = [math.log(n) for n in hits]
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "")
    import torch

    doc = {"command": "OMP_NUM_THREADS=1 rlengine train --config grpo_long --run.seed S " + " ".join(extra),
           "runs_at_once": workers, "threads": 1, "cpu": cpu, "torch": torch.__version__,
           "python": platform.python_version(), "seeds": seeds, "finished": sorted(results, key=int),
           "all_reached_0.8": len(hits) == len(results) == len(seeds),
           "sd_log_N_star": statistics.stdev(logs) if len(logs) > 1 else None,
           "runs": {k: results[k] for k in sorted(results, key=int)}}
    Path(path).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())

"""Which objective, with and without rollout correction: J against N on the default job and grpo_long.

    python docs/results/rollout_correction/study.py --jobs grpo,grpo_long --seeds 0,1,2 --workers 2 \
        --out docs/results/rollout_correction/study.json
    python docs/results/rollout_correction/study.py --plot docs/results/rollout_correction/study.json

Every run is `OMP_NUM_THREADS=1 rlengine train --config JOB --model.dtype bfloat16 --run.seed S` plus the
arm's options below (bf16 compute, fp32 masters: train.master_weights = auto). Objectives at their papers'
settings; correction "on" is verl's decoupled token-level truncated IS (`rollout_is = token`, upper 2.0).
A run already in --runs-dir with a finished metrics.jsonl is read back, not rerun.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

OBJECTIVES = {
    # DAPO-style clip-higher is the job's own setting (train.clip_low 0.2, clip_high 0.28)
    "vanilla": [],
    # GSPO (Zheng et al. 2025): sequence ratio, clip 3e-4 / 4e-4, sequence-mean aggregation
    "gspo": ["--train.policy_loss", "gspo", "--train.clip_low", "3e-4", "--train.clip_high", "4e-4",
             "--train.agg", "seq-mean"],
    # CISPO (MiniMax-M1): stop-gradient clipped IS weight, no lower bound (MiniMax set eps_low large)
    "cispo": ["--train.policy_loss", "cispo", "--train.clip_low", "0.99"],
    # SAPO (Gao et al. 2025): tau_pos 1.0, tau_neg 1.05, sequence-mean (the registry's defaults)
    "sapo": ["--train.policy_loss", "sapo"],
}
CORRECTION = {"off": [], "on": ["--train.rollout_is", "token", "--train.rollout_is_threshold", "2.0"]}
UPDATES = {"grpo": None, "grpo_long": 200}   # grpo_long: 200 of its 450 updates (J >= 0.8 came at 100-200)
TARGET = {"grpo": 0.9, "grpo_long": 0.8}


def run(job: str, obj: str, corr: str, seed: int, root: Path) -> dict:
    out = root / f"{job}-{obj}-{corr}-s{seed}"
    while subprocess.run(["pgrep", "-f", "--", f"--run.out_dir {out}( |$)"], capture_output=True).returncode == 0:
        time.sleep(10)   # the same run started by another invocation: wait for it, then read it back
    if not (out / "done").is_file() and finished(out):
        (out / "done").write_text(json.dumps({"wall_s": None, "cmd": ["(finished by another invocation)"]}))
    if not (out / "done").is_file():
        cmd = [sys.executable, "-m", "rlengine", "train", "--config", job, "--model.dtype", "bfloat16",
               "--run.seed", str(seed), "--run.progress", "false", "--run.checkpoint_every", "0",
               "--run.out_dir", str(out), *OBJECTIVES[obj], *CORRECTION[corr]]
        if UPDATES[job]:
            cmd += ["--train.updates", str(UPDATES[job])]
        subprocess.run(["rm", "-rf", str(out)], check=True)
        t0 = time.perf_counter()
        subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True, stdout=subprocess.DEVNULL)
        (out / "done").write_text(json.dumps({"wall_s": time.perf_counter() - t0, "cmd": cmd[2:]}))
    done = json.loads((out / "done").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["update"] > 0]
    curve = [[r["update"], r["N"], r["J"]] for r in rows if r.get("J") is not None]
    hit = next((c for c in curve if c[2] >= TARGET[job]), None)
    mean = lambda k: sum(r.get(k) or 0.0 for r in steps) / max(1, len(steps))
    return {"job": job, "objective": obj, "correction": corr, "seed": seed, "wall_s": None if done["wall_s"] is None else round(done["wall_s"], 1),
            "command": "rlengine " + " ".join(done["cmd"]), "final_J": curve[-1][2],
            "N_at_target": hit[1] if hit else None, "curve": curve,
            "logprob_diff_mean": mean("logprob_diff"), "rollout_corr_kl_mean": mean("rollout_corr/kl"),
            "rollout_is_capped_frac_mean": mean("rollout_is_capped_frac")}


def finished(out: Path) -> bool:
    """A run whose metrics.jsonl already holds its final evaluation (the last update is evaluated)."""
    try:
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        cfg = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(rows) and rows[-1].get("J") is not None and rows[-1]["update"] == cfg["train"]["updates"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", default="grpo,grpo_long")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--runs-dir", default="/tmp/rollout_corr_study")
    p.add_argument("--out", default="docs/results/rollout_correction/study.json")
    p.add_argument("--plot", help="draw the figure and print the table from this JSON, run nothing")
    a = p.parse_args()
    if a.plot:
        return plot(Path(a.plot))
    root = Path(a.runs_dir)
    root.mkdir(parents=True, exist_ok=True)
    arms = [(j, o, c, int(s)) for j in a.jobs.split(",") for s in a.seeds.split(",")
            for o in OBJECTIVES for c in CORRECTION]
    prev = json.loads(Path(a.out).read_text())["runs"] if Path(a.out).is_file() else []
    results = {(r["job"], r["objective"], r["correction"], r["seed"]): r for r in prev}

    def one(arm):
        r = run(*arm, root)
        results[arm] = r
        print(f"{arm}: final J {r['final_J']:.3f}, N at target {r['N_at_target']}, wall {r['wall_s']} s", flush=True)
        write(Path(a.out), results)

    with ThreadPoolExecutor(a.workers) as pool:
        list(pool.map(one, arms))
    write(Path(a.out), results)
    return 0


def write(path: Path, results: dict) -> None:
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "")
    doc = {"cpu": cpu, "threads": 1, "dtype": "bfloat16", "objectives": OBJECTIVES, "correction": CORRECTION,
           "updates": UPDATES, "target_J": TARGET,
           "runs": [results[k] for k in sorted(results, key=lambda k: (k[0], k[1], k[2], k[3]))]}
    path.write_text(json.dumps(doc, indent=1))


def plot(path: Path) -> int:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    doc = json.loads(path.read_text())
    jobs = sorted({r["job"] for r in doc["runs"]})
    fig, axes = plt.subplots(1, len(jobs), figsize=(6 * len(jobs), 4.2), squeeze=False)
    colors = {"vanilla": "C0", "gspo": "C1", "cispo": "C2", "sapo": "C3"}
    print("| job | objective | correction | final J (seeds) | mean final J | N at target (seeds) | logprob_diff | IS capped |")
    print("|---|---|---|---|---|---|---|---|")
    for ax, job in zip(axes[0], jobs):
        for obj in OBJECTIVES:
            for corr in CORRECTION:
                rs = sorted((r for r in doc["runs"] if (r["job"], r["objective"], r["correction"]) == (job, obj, corr)),
                            key=lambda r: r["seed"])
                if not rs:
                    continue
                n = min(len(r["curve"]) for r in rs)
                xs = [rs[0]["curve"][i][1] for i in range(n)]
                ys = [sum(r["curve"][i][2] for r in rs) / len(rs) for i in range(n)]
                ax.plot(xs, ys, color=colors[obj], ls="-" if corr == "off" else "--",
                        label=f"{obj}, correction {corr}")
                finals = [r["final_J"] for r in rs]
                ns = ["-" if r["N_at_target"] is None else f"{r['N_at_target']:,}" for r in rs]
                print(f"| {job} | {obj} | {corr} | {' / '.join(f'{f:.2f}' for f in finals)} | "
                      f"{sum(finals) / len(finals):.2f} | {' / '.join(ns)} | "
                      f"{sum(r['logprob_diff_mean'] for r in rs) / len(rs):.1e} | "
                      f"{sum(r['rollout_is_capped_frac_mean'] for r in rs) / len(rs):.1e} |")
        ax.set_title(f"{job} (J >= {doc['target_J'][job]} target), mean of seeds")
        ax.set_xlabel("N (responses trained on)")
        ax.set_ylabel("J (held-out)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"figure: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

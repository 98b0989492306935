"""Post-hoc numbers for docs/RESULTS.md ("Algorithm 1 on the built-in task"), read from the runs.jsonl files of two tunes.

    python docs/results/tune_posthoc.py docs/results/tune_run1_wall/runs.jsonl docs/results/tune_run2_cpu/runs.jsonl

Prints one JSON object: grad-norm slopes over B_train 64..256 (the range before r_N passes ~1.3)
per seed with the pre-registered window mean and, marked post hoc, the window median; the final J
of runs that missed J* within N_max (censored N*); determinism (same config and seed in two tunes
gives the same N at every evaluation); CPU / wall seconds per run (machine contention).
"""

from __future__ import annotations

import json
import math
import statistics
import sys


def load(paths):
    runs = []
    for p in paths:
        for line in open(p):
            r = json.loads(line)
            r["file"] = p
            runs.append(r)
    return runs


def slope(xs, ys):
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


def main(paths):
    runs = load(paths)
    stage1 = [r for r in runs if r["stage"] == "stage1"]
    window = min(r["records"][-1]["N"] for r in stage1)
    out = {"grad_window_N": window, "slopes_64_256": {}, "censored": [], "determinism": [], "cpu_over_wall": {}}
    for stat in ("mean", "median (post hoc)"):
        per_seed = {}
        for seed in sorted({r["seed"] for r in stage1}):
            g = {}
            for r in stage1:
                b = r["config"]["train"]["b_train"]
                if r["seed"] == seed and b <= 256:
                    vals = [x["actor_grad_norm"] for x in r["records"][1:] if x["N"] <= window]
                    g[b] = statistics.fmean(vals) if stat == "mean" else statistics.median(vals)
            per_seed[seed] = slope(sorted(g), [g[b] for b in sorted(g)])
        v = list(per_seed.values())
        out["slopes_64_256"][stat] = {"per_seed": per_seed, "mean": statistics.fmean(v), "sd": statistics.stdev(v)}
    for r in runs:
        if r["stage"] in ("stage1", "control") and not r["stopped_at_target"]:
            js = [x["J"] for x in r["records"] if "J" in x]
            out["censored"].append({"run": r["name"], "N": r["records"][-1]["N"], "final_J": js[-1], "max_J": max(js)})
    curves = {}
    for r in runs:
        cfg = {k: dict(v) for k, v in r["config"].items() if k != "run"}
        cfg["train"]["b0"] = cfg["train"]["b0"] or cfg["train"]["b_train"]  # the job's 0 means its own B_train
        key = json.dumps(cfg, sort_keys=True), r["seed"]
        curves.setdefault(key, []).append(r)
    for (_, seed), rs in curves.items():
        if len(rs) > 1:
            evals = [[(x["N"], x["J"]) for x in r["records"] if "J" in x] for r in rs]
            n = min(len(e) for e in evals)
            out["determinism"].append({"runs": [r["name"] + " @ " + r["file"] for r in rs], "seed": seed,
                                       "identical_J_at_N": all(e[:n] == evals[0][:n] for e in evals)})
    for p in paths:
        ratios = [r["cpu_s"] / r["wall_s"] for r in runs if r["file"] == p and r.get("cpu_s")]
        if ratios:
            out["cpu_over_wall"][p] = {"min": min(ratios), "median": statistics.median(ratios), "max": max(ratios)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])

"""The end of tools/gpu_check.sh: judge a step's results, pack them, print the per-goal summary last.

    python3 tools/gpu_check_summary.py finish STEP WORK OUT COMMIT STATUS
        reads WORK (junit XMLs, bench JSONs, logs, part_*.json), stamps COMMIT into every JSON, writes
        OUT/gpu_check_STEP.json (conditions, per-part exit status and seconds, summary lines, goals)
        and OUT/gpu_check_STEP.tar.gz (all of WORK), then prints the summary: its last lines.
    python3 tools/gpu_check_summary.py part STEP WORK NAME RC SECONDS LIMIT
        writes one part's exit status to WORK/part_NAME.json.
    python3 tools/gpu_check_summary.py standin STEP WORK [build-fails]   (STEP: test | bench | rl | profile | decode2)
        writes stand-in results (GPU_CHECK_DRY=1): the packing and the summary run on a CPU.

A device call returns at most 8 files, no deeper than 2 folders, and the last 12,000 characters of
output: each step leaves exactly two files in OUT, and the summary is the last thing printed.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET

TEST_SHARDS = ("paged_decode", "kernels", "engine", "others")
RL_SHARDS = ("rl_tests",)
RL_PARTS = ("grpo_long", "job_ladder", "asymmetry", "costs")
BENCH_PARTS = ("ceilings", "decode", "paged_decode", "bench_moe", "bench_logprob", "shared_prefix")
DECODE2_SHARDS = ("fused_tests",)


def _smi(query: str) -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None


def _conditions(commit: str) -> dict:
    try:
        import torch
        import triton
        versions = {"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__}
    except ImportError as exc:
        versions = {"error": str(exc)}
    return {"commit": commit, "gpu": _smi("name"), "driver": _smi("driver_version"), "dry": bool(
        os.environ.get("GPU_CHECK_DRY", "0") not in ("", "0")), **versions}


def _load(work: str, name: str):
    path = os.path.join(work, name)
    return json.load(open(path)) if os.path.exists(path) else None


def _test_lines(work: str, goals: dict, shards=TEST_SHARDS) -> list[str]:
    lines = []
    for shard in shards:
        path = os.path.join(work, f"junit_{shard}.xml")
        if not os.path.exists(path):
            lines.append(f"tests[{shard}]: NO RESULT (not run, timed out or crashed before writing its junit XML)")
            continue
        root = ET.parse(path).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        bad = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
               if c.find("failure") is not None or c.find("error") is not None]
        goals[shard] = {**counts, "failed": bad}
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        line = f"tests[{shard}]: {passed} passed, {counts['failures'] + counts['errors']} failed, " \
               f"{counts['skipped']} skipped"
        lines.append(line + (f"; failed: {', '.join(bad[:8])}" if bad else ""))
    return lines


def _bench_lines(work: str, goals: dict) -> list[str]:
    lines = []
    dec = _load(work, "decode.json")
    if dec:
        by_b = {r["b_act"]: r for r in dec["rows"]}
        if 1 in by_b:
            ms = by_b[1]["ms_per_step"]
            goals["decode_ms_B1"] = ms
            lines.append(f"decode Qwen3-0.6B bf16 B_act=1: {ms:.3f} ms/step (goal < 1.0) {'OK' if ms < 1.0 else 'MISS'}")
        if 64 in by_b and by_b[64].get("roofline_fraction") is not None:
            f = by_b[64]["roofline_fraction"]
            goals["decode_roofline_B64"] = f
            lines.append(f"decode B_act=64: {f:.2f} of the Eq. 5 bound of docs/METHOD.md (goal >= 0.70) {'OK' if f >= 0.70 else 'MISS'}")
        joules = {b: r.get("decode_j_per_token") for b, r in by_b.items() if r.get("decode_j_per_token")}
        goals["nvml_decode_j_per_token"] = joules
        lines.append("NVML decode energy: " + (", ".join(f"B_act={b}: {j:.4f} J/token" for b, j in joules.items())
                                               if joules else "none recorded (NVML unavailable? see decode.log)"))
    pdj = _load(work, "paged_decode.json")
    if pdj and pdj["rows"]:
        longest = max(r["ctx"] for r in pdj["rows"])
        rs = [r for r in pdj["rows"] if r["provider"] == "triton" and r["ctx"] == longest and r.get("GB/s")]
        for r in rs:
            frac = r.get("frac_of_copy_bw")
            lines.append(f"paged decode ctx={longest} B={r['B_act']} S={r['S']}: {r['GB/s']:.0f} GB/s = "
                         f"{frac if frac is not None else float('nan'):.2f} of copy bandwidth (goal >= 0.85)")
        fracs = [r["frac_of_copy_bw"] for r in rs if r.get("frac_of_copy_bw") is not None]
        if fracs:
            goals["paged_decode_min_frac"] = min(fracs)
            lines.append(f"paged decode long-context worst fraction {min(fracs):.2f} "
                         f"{'OK' if min(fracs) >= 0.85 else 'MISS'}")
    moe = _load(work, "bench_moe.json")
    if moe:
        rs = [r for r in moe["rows"] if r["provider"] == "triton" and r.get("mode") == "fwd+bwd" and r.get("tflops")]
        if rs:
            r = max(rs, key=lambda r: r["T"])
            ratio = r.get("vs_grouped_mm")
            goals["moe_vs_grouped_mm"] = ratio
            lines.append(f"fused MoE fwd+bwd T={r['T']}: {r['tflops']:.0f} TFLOP/s, "
                         + (f"{ratio:.2f}x torch._grouped_mm (goal >= 1.2) {'OK' if ratio >= 1.2 else 'MISS'}"
                            if ratio else "no torch._grouped_mm baseline (see its skipped row)"))
    lp = _load(work, "bench_logprob.json")
    if lp:
        for r in [r for r in lp["rows"] if r["provider"] == "fused" and r["mode"] == "fwd+bwd" and r["entropy"]]:
            ratio = r.get("mem_ratio")
            goals["logprob_mem_ratio"] = ratio
            lines.append(f"fused log-prob fwd+bwd T={r['T']} V={r['V']}: {r['ms']:.1f} ms, peak "
                         f"{r['peak_extra_mb']:.0f} MiB, {ratio:.1f}x less than materialised logits (goal >= 8) "
                         f"{'OK' if ratio >= 8 else 'MISS'}" if ratio else f"fused log-prob: no memory ratio ({r})")
    sp = _load(work, "shared_prefix.json")
    for r in (sp or {}).get("rows", []):
        goals[f"shared_prefix_{r['case']}_step_speedup"] = r["speedup"]
        lines.append(f"shared-prefix decode {r['case']} {r['model']} B_act={r['B_act']}: step {r['speedup']:.2f}x, "
                     f"attention {r['attn_speedup']:.2f}x over plain decode (triton, eager steps; "
                     f"{r['cascade_steps']} cascade steps)")
    missing = [n for n in BENCH_PARTS if not _load(work, n + ".json")]
    if missing:
        lines.append(f"no result from: {', '.join(missing)} (not run, timed out or failed: see its log)")
    return lines


def _rl_lines(work: str, goals: dict) -> list[str]:
    """The rl step: its tests, then grpo_long's learning and time split, the q ladder, the fits, the cost tables."""
    lines = _test_lines(work, goals, RL_SHARDS)
    metrics = os.path.join(work, "grpo_long", "metrics.jsonl")
    recs = [json.loads(ln) for ln in open(metrics) if ln.strip()] if os.path.exists(metrics) else []
    ups = [r for r in recs if r.get("update", 0) > 0 and r.get("t_gen") is not None]
    if ups:
        t_gen, t_train = sum(r["t_gen"] for r in ups), sum(r["t_train"] for r in ups)
        evals = [(r["update"], r["N"], r["J"]) for r in recs if r.get("J") is not None]
        hit = next(((u, n) for u, n, j in evals if j >= 0.8), None)
        goals.update(grpo_long_updates=len(ups), grpo_long_gen_share=t_gen / (t_gen + t_train),
                     grpo_long_J=evals, grpo_long_t_gen=t_gen / len(ups), grpo_long_t_train=t_train / len(ups))
        lines.append(f"grpo_long seed 0: {len(ups)} updates, J " + ", ".join(f"{j:.2f}@{u}" for u, _, j in evals[-6:])
                     + (f"; J >= 0.8 at update {hit[0]} (N = {hit[1]})" if hit else "; J >= 0.8 not reached"))
        lines.append(f"grpo_long generation share {t_gen / (t_gen + t_train):.2f}; per update t_gen "
                     f"{t_gen / len(ups) * 1e3:.1f} ms, t_train {t_train / len(ups) * 1e3:.1f} ms")
    ladder = _load(work, "job_ladder.json")
    if ladder and ladder.get("rows"):
        goals["job_ladder_q"] = {r["b_gen"]: r["q"] for r in ladder["rows"]}
        lines.append("grpo_long q over B_gen (policy frozen): " + ", ".join(
            f"{r['b_gen']}: {r['q']:.0f}/s ({r['q_ratio']:.2f}x)" for r in ladder["rows"]))
    asym = _load(work, "asymmetry.json")
    if asym and asym.get("fit"):
        fit = asym["fit"]
        goals["asymmetry_fit"] = fit
        lines.append("asymmetry Qwen3-0.6B shape: " + ", ".join(f"{k} {v:.4g}" for k, v in fit.items()
                                                                 if isinstance(v, (int, float)))
                     + f"; critical generation batch {asym.get('critical_generation_batch')}")
    for path in sorted(glob.glob(os.path.join(work, "costs-*.json"))):
        t = json.load(open(path))
        dec = sorted(t.get("decode", []))
        if dec:
            lines.append(f"cost table {t['model']} {t['dtype']}: decode {dec[0][2] * 1e3:.3f} ms at B_act {dec[0][0]}, "
                         f"{dec[-1][2] * 1e3:.3f} ms at B_act {dec[-1][0]}; learner "
                         + ", ".join(f"{n / s:.0f} tok/s at {n}" for n, s in t.get("learner", [])))
    missing = [n for n, ok in (("grpo_long", bool(ups)), ("job_ladder", bool(ladder)), ("asymmetry", bool(asym)),
                               ("costs", bool(glob.glob(os.path.join(work, "costs-*.json"))))) if not ok]
    if missing:
        lines.append(f"no result from: {', '.join(missing)} (not run, timed out or failed: see its log)")
    return lines


def _profile_lines(work: str, goals: dict) -> list[str]:
    """The profile step: per-kernel tables, GPU busy vs wall, event times, paged decode over splits and BLOCK_N."""
    lines = []
    kern = _load(work, "profile_kernels.json")
    for r in (kern or {}).get("rows", []):
        b = r["b_act"]
        goals[f"profile_kernels_B{b}"] = r["kernels"][:25]
        goals[f"profile_busy_B{b}"] = {k: r[k] for k in ("launches_per_step", "busy_us_per_step", "wall_us_per_step")}
        gap = 1 - r["busy_us_per_step"] / r["wall_us_per_step"] if r["wall_us_per_step"] else float("nan")
        lines.append(f"profile B_act {b}: {r['launches_per_step']:.0f} kernels/step, GPU busy {r['busy_us_per_step']:.0f}"
                     f" us of {r['wall_us_per_step']:.0f} us wall (host gap {gap:.0%}); graph replays "
                     f"{r['graph_replays']}, their kernels in the trace: {'yes' if r['graph_kernels_in_trace'] else 'NO'}")
        lines.append(f"profile B_act {b} top kernels: " + "; ".join(
            f"{k['name'][:40]} x{k['count']:.0f} {k['us']:.1f} us" for k in r["kernels"][:6]))
    ev = _load(work, "profile_events.json")
    for r in (ev or {}).get("rows", []):
        goals[f"profile_events_B{r['b_act']}_{'async' if r['async_scheduling'] else 'sync'}"] = r
        lines.append(f"events B_act {r['b_act']} async {'on' if r['async_scheduling'] else 'off'}: step "
                     f"{r['step_ms']:.3f} ms, graph replay {r.get('graph_replay_ms', float('nan')):.3f} ms, head "
                     f"{r['head_ms']:.3f} ms, sampler greedy {r['sampler_greedy_ms']:.3f} / top-p "
                     f"{r['sampler_top_p_ms']:.3f} ms")
    paged = _load(work, "profile_paged.json")
    if paged and paged.get("rows"):
        rows = paged["rows"]
        goals["profile_paged"] = rows
        best = max(rows, key=lambda r: r["GB/s"])
        lines.append(f"paged decode B 1 ctx {best['ctx']}: best {best['GB/s']:.0f} GB/s at {best['splits']} splits, "
                     f"BLOCK_N {best['BLOCK_N']}; by splits at BLOCK_N 32: " + ", ".join(
                         f"{r['splits']}: {r['GB/s']:.0f}" for r in rows if r["BLOCK_N"] == 32))
    missing = [n for n, d in (("profile_kernels", kern), ("profile_events", ev), ("profile_paged", paged)) if not d]
    if missing:
        lines.append(f"no result from: {', '.join(missing)} (not run, timed out or failed: see its log)")
    return lines


def _decode2_lines(work: str, goals: dict) -> list[str]:
    """The decode2 step: fused-layer tests, decode step times torch vs fused at B_act 1 and 64, small-M configs.
    The verdict line is the rule for gen.decode_kernels' default: fused only where faster at both B_act."""
    lines = _test_lines(work, goals, DECODE2_SHARDS)
    ms = {}
    for k in ("torch", "fused"):
        data = _load(work, f"decode_{k}.json")
        for r in (data or {}).get("rows", []):
            ms.setdefault(r["b_act"], {})[k] = r["ms_per_step"]
    faster = []
    for b in (1, 64):
        t, f = ms.get(b, {}).get("torch"), ms.get(b, {}).get("fused")
        if t is None or f is None:
            lines.append(f"decode2 B_act {b}: NO RESULT (torch {t}, fused {f})")
            continue
        goals[f"decode2_ms_B{b}"] = {"torch": t, "fused": f, "fused_over_torch": round(f / t, 3)}
        faster.append(f < t)
        lines.append(f"decode2 B_act {b}: torch {t:.3f} ms/step, fused {f:.3f} ms/step (fused/torch {f / t:.2f})")
    ok = len(faster) == 2 and all(faster)
    goals["decode2_fused_faster_at_1_and_64"] = ok
    lines.append("decode2 verdict: fused faster at B_act 1 and 64: make it gen.decode_kernels' default" if ok else
                 "decode2 verdict: keep torch the default (fused not measured faster at both B_act 1 and 64)")
    tune = _load(work, "small_m_tune.json")
    if tune:
        goals["small_m_tune"] = [{k: r[k] for k in ("op", "M", "best", "best_us", "heuristic_us", "torch_linear_us")}
                                 for r in tune["rows"]]
        lines.append("small-M GEMM best us (vs torch linear): " + "; ".join(
            f"{r['op']} M={r['M']} {r['best_us']:.1f} ({r['torch_linear_us']:.1f})" for r in tune["rows"]))
    return lines


def _standin_decode2(work: str) -> None:
    open(os.path.join(work, "junit_fused_tests.xml"), "w").write(_junit("fused_tests", False))
    cond = {"conditions": {"device": "stand-in (GPU_CHECK_DRY=1)"}}
    for k, ms in (("torch", (1.5, 1.9)), ("fused", (0.8, 1.0))):
        rows = [{"b_act": 1, "ms_per_step": ms[0]}, {"b_act": 64, "ms_per_step": ms[1]}]
        json.dump({"name": f"decode_{k}", "rows": rows, **cond}, open(os.path.join(work, f"decode_{k}.json"), "w"))
    row = {"op": "qkv", "M": 1, "best": "SmallMConfig(32, 128, 1)", "best_us": 6.0, "heuristic_us": 6.5,
           "torch_linear_us": 9.0}
    json.dump({"name": "small_m_tune", "rows": [row], **cond}, open(os.path.join(work, "small_m_tune.json"), "w"))


def _stamp(work: str, commit: str) -> None:
    """The tree on the GPU machine may have no .git: stamp the commit into every result JSON."""
    for path in glob.glob(os.path.join(work, "*.json")):
        try:
            data = json.load(open(path))
        except ValueError:
            continue
        cond = data.get("conditions") if isinstance(data, dict) else None
        if isinstance(cond, dict) and not cond.get("commit"):
            cond.update(commit=commit, commit_source="tools/gpu_check.sh")
            json.dump(data, open(path, "w"), indent=2)


def finish(step: str, work: str, out: str, commit: str, status: int) -> int:
    parts = _parts(work)
    goals: dict = {}
    lines = [f"part {p['name']}: exit {p['rc']}{' (timed out)' if p['rc'] in (124, 137) else ''}, "
             f"{p['seconds']} s of {p['limit']} s" for p in parts]
    if any(p["name"] == "build" and p["rc"] != 0 for p in parts):
        lines.append("BUILD FAILED: the step stopped before its tests and benchmarks (build.log in the archive)")
    lines += {"test": _test_lines, "bench": _bench_lines, "rl": _rl_lines, "profile": _profile_lines,
              "decode2": _decode2_lines}[step](work, goals)
    shards = {"test": TEST_SHARDS, "rl": RL_SHARDS, "decode2": DECODE2_SHARDS}.get(step, ())
    failed = any(goals.get(s, {}).get("failed") for s in shards)
    timed_ok = {"grpo_long"}  # stopped by the timeout's SIGINT on purpose
    if failed or any(p["rc"] and not (p["name"] in timed_ok and p["rc"] == 124) for p in parts):
        status = status or 1  # a failed test, or a part that failed or timed out, fails the step
    _stamp(work, commit)
    os.makedirs(out, exist_ok=True)
    archive = os.path.join(out, f"gpu_check_{step}.tar.gz")
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(work, arcname=f"gpu_check_{step}")
    summary = {"step": step, "exit_status": status, "conditions": _conditions(commit), "parts": parts,
               "summary": lines, "goals": goals, "archive": os.path.basename(archive)}
    with open(os.path.join(out, f"gpu_check_{step}.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"[gpu_check {step}] results: {archive} and gpu_check_{step}.json; exit status {status}")
    print("\n".join(f"SUMMARY {line}" for line in lines), flush=True)
    return status


def record_part(work: str, name: str, rc: int, seconds: int, limit: int) -> None:
    """One file per part: the test shards finish concurrently."""
    json.dump({"name": name, "rc": rc, "seconds": seconds, "limit": limit},
              open(os.path.join(work, f"part_{name}.json"), "w"))


def _parts(work: str) -> list[dict]:
    parts = [json.load(open(p)) for p in glob.glob(os.path.join(work, "part_*.json"))]
    return sorted(parts, key=lambda p: os.path.getmtime(os.path.join(work, f"part_{p['name']}.json")))


def _junit(shard: str, failed: bool) -> str:
    cases = '<testcase classname="tests.gpu.standin" name="test_ok" time="0.1"/>'
    if failed:
        cases += '<testcase classname="tests.gpu.standin" name="test_bad"><failure message="x"/></testcase>'
    return (f'<?xml version="1.0"?><testsuites><testsuite name="{shard}" tests="{2 if failed else 1}" '
            f'failures="{int(failed)}" errors="0" skipped="0">{cases}</testsuite></testsuites>')


def standin(step: str, work: str) -> None:
    """Stand-in results in the shapes the real tests and benches write (GPU_CHECK_DRY=1)."""
    cond = {"conditions": {"device": "stand-in (GPU_CHECK_DRY=1)"}}
    if step == "rl":
        _standin_rl(work)
        return
    if step == "profile":
        _standin_profile(work)
        return
    if step == "decode2":
        _standin_decode2(work)
        return
    if step == "test":
        for shard in TEST_SHARDS:
            open(os.path.join(work, f"junit_{shard}.xml"), "w").write(_junit(shard, shard == "others"))
            open(os.path.join(work, f"tests_{shard}.log"), "w").write("stand-in log\n")
        return
    files = {
        "ceilings": {"rows": [{"kind": "copy", "GB/s": 4000.0}]},
        "decode": {"rows": [{"b_act": 1, "ms_per_step": 0.9, "roofline_fraction": 0.5, "decode_j_per_token": 0.2},
                            {"b_act": 64, "ms_per_step": 1.4, "roofline_fraction": 0.75}]},
        "paged_decode": {"rows": [{"provider": "triton", "ctx": 32768, "B_act": 1, "S": 64, "GB/s": 3500.0,
                                   "frac_of_copy_bw": 0.87}]},
        "bench_moe": {"rows": [{"provider": "triton", "mode": "fwd+bwd", "T": 32768, "tflops": 400.0,
                                "vs_grouped_mm": 1.3}]},
        "bench_logprob": {"rows": [{"provider": "fused", "mode": "fwd+bwd", "entropy": True, "T": 8192,
                                    "V": 151936, "ms": 20.0, "peak_extra_mb": 300.0, "mem_ratio": 9.0}]},
        "shared_prefix": {"rows": [{"case": "grpo-512", "model": "qwen3-0.6b", "B_act": 64, "speedup": 1.2,
                                    "attn_speedup": 3.0, "cascade_steps": 126}]},
    }
    for name, data in files.items():
        json.dump({"name": name, **data, **cond}, open(os.path.join(work, f"{name}.json"), "w"))
        open(os.path.join(work, f"{name}.log"), "w").write("stand-in log\n")


def _standin_rl(work: str) -> None:
    open(os.path.join(work, "junit_rl_tests.xml"), "w").write(_junit("rl_tests", False))
    os.makedirs(os.path.join(work, "grpo_long"), exist_ok=True)
    recs = [{"update": 0, "N": 0, "J": 0.0}] + [
        {"update": u, "N": 32 * u, "t_gen": 0.09, "t_train": 0.01, **({"J": min(1.0, u / 20)} if u % 5 == 0 else {})}
        for u in range(1, 21)]
    with open(os.path.join(work, "grpo_long", "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in recs))
    cond = {"conditions": {"device": "stand-in (GPU_CHECK_DRY=1)"}}
    json.dump({"name": "job_ladder", "rows": [{"b_gen": 32, "q": 600.0, "q_ratio": 1.0},
                                              {"b_gen": 1024, "q": 3000.0, "q_ratio": 5.0}], **cond},
              open(os.path.join(work, "job_ladder.json"), "w"))
    json.dump({"name": "asymmetry", "rows": [], "fit": {"d0": 0.5, "d1": 0.001, "gamma": 0.002},
               "critical_generation_batch": 64, **cond}, open(os.path.join(work, "asymmetry.json"), "w"))
    json.dump({"format": "rlengine.cost_table/1", "model": "tiny", "dtype": "float32", "kind": "measured",
               "decode": [[1, 32, 0.001], [64, 32, 0.0012]], "prefill": [[64, 0.002]], "learner": [[1024, 0.01]],
               "optimizer_s": 0.001, "provenance": cond["conditions"]}, open(os.path.join(work, "costs-tiny-float32.json"), "w"))


def _standin_profile(work: str) -> None:
    cond = {"conditions": {"device": "stand-in (GPU_CHECK_DRY=1)"}}
    kernels = [{"name": "_split_kernel", "count": 28.0, "us": 90.0}, {"name": "gemv_bf16", "count": 113.0, "us": 700.0}]
    files = {
        "profile_kernels": [{"b_act": b, "kernels": kernels, "launches_per_step": 141.0, "kernel_us_per_step": 790.0,
                             "busy_us_per_step": 800.0, "wall_us_per_step": 1000.0, "graph_replays": 5,
                             "graph_kernels_in_trace": True} for b in (1, 64)],
        "profile_events": [{"b_act": b, "async_scheduling": a, "step_ms": 1.2, "graph_replay_ms": 1.0, "head_ms": 0.1,
                            "sampler_greedy_ms": 0.02, "sampler_top_p_ms": 0.08} for b in (1, 64) for a in (True, False)],
        "profile_paged": [{"B": 1, "ctx": 32768, "splits": s, "BLOCK_N": n, "ms": 0.05, "GB/s": 100.0 * s}
                          for n in (16, 32, 64) for s in (1, 33)],
    }
    for name, rows in files.items():
        json.dump({"name": name, "rows": rows, **cond}, open(os.path.join(work, f"{name}.json"), "w"))
        open(os.path.join(work, f"{name}.log"), "w").write("stand-in log\n")


def main(argv: list[str]) -> int:
    cmd, step, work = argv[0], argv[1], argv[2]
    if cmd == "finish":
        return finish(step, work, argv[3], argv[4], int(argv[5]))
    if cmd == "part":
        record_part(work, argv[3], int(argv[4]), int(argv[5]), int(argv[6]))
        return 0
    if cmd == "standin":
        standin(step, work)
        return 0
    raise SystemExit(f"unknown command {cmd!r}: finish | part | standin")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""`rlengine bench decode`: decode throughput, latency and energy per active batch and context length.

For each context length in --contexts (prompt tokens; --length-dist makes them ragged around
it) and each B_act in --batches, B_act prompts are generated greedily (EOS ignored) by
rlengine's LLM and by transformers' generate() on the SAME weights. Method:
  - Step time (--timing difference, the default): (wall(generate --gen-len tokens) -
    wall(generate 1 token)) / (gen-len - 1) on the same prompts, for both providers: the
    prefill, the first sample and each call's fixed costs cancel. One round of a provider is
    both calls; the rounds alternate rlengine, transformers, rlengine, ... (--reps rounds
    each, after a warm-up round) and the median round is reported, so machine noise hits both
    alike: compare the ratio column, measured within one run. --timing steps reports the
    per-step records instead; both are in the JSON either way (decode_rounds.py).
  - Per-step records: rlengine's decode StepRecords cover the whole engine step (schedule,
    copy-on-write, forward, sampling with its host read of the tokens, postprocess);
    p50/p90/p99 pool every decode step of every round. transformers' steps are the gaps
    between new tokens handed to a streamer (hf_baseline.py). Prefill throughput of the
    row's prompts (prompt tokens / prefill step time) is reported apart from decode.
  - transformers: "eager" = dynamic cache, eager forward (hf_* columns); "static" = static
    cache + torch.compile (hf_static_* columns), --hf both runs both. Token agreement is
    checked for every sequence of every round: *_same_frac is the fraction of identical sequences.
  - Prefill row (--prefill-len, default 512; 0 skips it): wall(generate 1 token) of
    --prefill-batch prompts of that length, both providers, alternating rounds, median.
  - B_KV: the KV cache is sized for the largest B_act at the longest context (capped by
    --kv-memory-gb on a CPU, a share of free memory on a GPU); (B_act, context) points that do
    not fit are skipped and listed under "skipped".
  - Peak memory: torch's peak allocation during rlengine's generate calls (GPU; everything
    resident counts: both models' weights and the KV pool). Energy: decode-phase joules per
    generated token from the NVML sampler, where NVML and a GPU are available.
  - Async scheduling (overlap) is on on a GPU, as in LLM there; --no-async turns it off.
  - CUDA graphs: on a GPU decode steps replay captured graphs; --enforce-eager turns them off,
    --compare-eager times an eager twin (eager_ms_per_step, graph_speedup).
  - Roofline (docs/METHOD.md Eq. 5): ceilings measured here (or --ceilings), bound at the mean
    context prompt + gen/2; fraction = measured / bound.
  - --profile DIR: after the timed rounds, one more run of each row under torch.profiler
    for --profile-window engine steps (untimed, so the profiler's overhead stays out of rows).
A line is printed as each row finishes; at the end the tables, one line per column under each.
Rows go to {--out}/{--name}.json with the column meanings ("columns"), the prefill section and
provenance (commit, dirty flag, backend actually used, CUDA-graph state), and the figure to
{--name}.png; an earlier default-named result is never overwritten (--name chooses the file).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlengine.analysis.ceilings import measure_ceilings
from rlengine.analysis.roofline import decode_roofline
from rlengine.benchmarks.args import HelpFormatter, add_model_options, check_args
from rlengine.benchmarks.decode_columns import DECODE, PREFILL, explain, legend
from rlengine.benchmarks.decode_rounds import TIMINGS, hf_round, ours_round, prefill_round
from rlengine.benchmarks.hf_baseline import HFProvider, load_pair
from rlengine.benchmarks.lengths import add_length_args, sample_lengths
from rlengine.benchmarks.report import format_table, free_name, write_result
from rlengine.model.config import ConfigError
from rlengine.engine.kv_cache import bytes_per_block
from rlengine.model.config import DTYPES
from rlengine.engine.llm import LLM
from rlengine.engine.sampling_params import SamplingParams
from rlengine.plan.preflight import check_model
from rlengine.telemetry.nvml import NvmlSampler
from rlengine.telemetry.profiler import ProfileWindow, step_profiler

COLUMNS = ["b_act", "tokens_per_s", "ms_per_step", "hf_tokens_per_s", "hf_ms_per_step", "ratio",
           "roofline_tokens_per_s", "roofline_fraction"]
TABLE = ["context", "b_act", "tokens_per_s", "ms_per_step", "trace_ms_per_step", "p50_ms", "p99_ms",
         "prefill_tokens_per_s", "hf_ms_per_step", "hf_stream_ms_per_step", "hf_p99_ms", "ratio", "hf_same_frac",
         "roofline_fraction"]
STATIC_COLUMNS = ["hf_static_ms_per_step", "static_ratio", "hf_static_same_frac"]
EAGER_COLUMNS = ["eager_ms_per_step", "graph_speedup"]
GPU_COLUMNS = ["peak_mem_mb", "decode_j_per_token"]


def _pct(values: list[float], q: float) -> float:
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def _engine(args, ours, device: torch.device, enforce_eager: bool, share: float) -> LLM:
    """An LLM on `ours` whose KV cache holds max(batches) sequences at the longest context, if memory allows."""
    per_block = bytes_per_block(ours.config, 16, ours.dtype)
    blocks = max(args.batches) * -(-args.max_model_len // 16)
    if device.type == "cuda":  # a share of what the weights leave: the rest for transformers' cache
        free, _ = torch.cuda.mem_get_info(device)
        blocks = min(blocks, int(share * free) // per_block)
    else:
        blocks = min(blocks, int(args.kv_memory_gb * 2**30 * share / 0.6) // per_block)
    return LLM(ours, max_num_seqs=max(args.batches), max_model_len=args.max_model_len, attention_backend=args.backend,
               num_kv_blocks=blocks, block_size=16, enforce_eager=enforce_eager,
               async_scheduling=False if args.no_async else None, decode_kernels=args.decode_kernels)


def _measure(args, llm: LLM, hf: list[HFProvider], prompts, eager: LLM | None, telemetry) -> dict:
    """Alternating rounds of every provider on one (B_act, context) point: rlengine, [eager twin], transformers."""
    warm = min(args.gen_len, 8)
    ours_round(llm, prompts, warm)  # warm-up: allocator, oneDNN primitives, Triton JIT, the bucket's CUDA graph
    if eager is not None:
        ours_round(eager, prompts, warm)
    for p in hf:  # a full round: static caches compile for exactly the shapes timed below
        hf_round(p, prompts, args.gen_len)
    if telemetry is not None:
        telemetry.reset()
    reps = {"ours": [], "ours_eager": [], **{p.mode: [] for p in hf}}
    same = {p.mode: [] for p in hf}
    for _ in range(args.reps):
        run = ours_round(llm, prompts, args.gen_len, telemetry)
        reps["ours"].append(run)
        if eager is not None:
            reps["ours_eager"].append(ours_round(eager, prompts, args.gen_len))
        for p in hf:
            r = hf_round(p, prompts, args.gen_len)
            if r is not None:
                reps[p.mode].append(r)
                same[p.mode].extend(a == b for a, b in zip(run["tokens"], r["tokens"]))
    return {"reps": reps, "same": same}


def _median_ms(rounds: list[dict], key: str) -> float:
    return 1e3 * statistics.median(r[key] for r in rounds)


def _row(args, cfg, b: int, ctx: int, lens: list[int], m: dict, ceilings: dict, telemetry) -> dict:
    """One table row from a point's rounds: the --timing step time, per-step cross-checks, percentiles, roofline."""
    key = f"{args.timing}_s"
    ours = m["reps"]["ours"]
    t = _median_ms(ours, key) / 1e3
    steps = [s for r in ours for s in r["steps"]]
    elem = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    flops = ceilings["flops_per_s"].get(args.dtype) or max(ceilings["flops_per_s"].values())
    mean_ctx = sum(lens) / len(lens)
    roof = decode_roofline(cfg, b_act=b, context_len=round(mean_ctx + args.gen_len / 2),
                           bandwidth=ceilings["bandwidth_bytes_per_s"], flops=flops, weight_bytes=elem, kv_bytes=elem)
    row = {"context": ctx, "mean_context": mean_ctx, "b_act": b, "tokens_per_s": b / t, "ms_per_step": 1e3 * t,
           "trace_ms_per_step": _median_ms(ours, "steps_s"),
           "p50_ms": 1e3 * _pct(steps, 0.5), "p90_ms": 1e3 * _pct(steps, 0.9), "p99_ms": 1e3 * _pct(steps, 0.99),
           "prefill_tokens_per_s": (sum(r["prefill_tokens"] for r in ours)
                                    / max(1e-12, sum(r["prefill_s"] for r in ours))),
           "hf_tokens_per_s": None, "hf_ms_per_step": None, "ratio": None, "hf_same_frac": None,
           "same_tokens_as_hf": None, "roofline_tokens_per_s": roof.tokens_per_s,
           "roofline_fraction": b / t / roof.tokens_per_s, "ms_per_step_reps": [1e3 * r[key] for r in ours],
           "peak_mem_mb": max((r["peak_mb"] for r in ours if r["peak_mb"] is not None), default=None),
           "decode_j_per_token": None}
    for mode, prefix in (("eager", "hf"), ("static", "hf_static")):
        if m["reps"].get(mode):
            rounds = m["reps"][mode]
            th = _median_ms(rounds, key) / 1e3
            same = m["same"][mode]
            row.update({f"{prefix}_tokens_per_s": b / th, f"{prefix}_ms_per_step": 1e3 * th,
                        "ratio" if mode == "eager" else "static_ratio": th / t,
                        f"{prefix}_stream_ms_per_step": _median_ms(rounds, "steps_s"),
                        f"{prefix}_p99_ms": 1e3 * _pct([s for r in rounds for s in r["steps"]], 0.99),
                        f"{prefix}_same_frac": sum(same) / len(same) if same else None,
                        f"{prefix}_ms_per_step_reps": [1e3 * r[key] for r in rounds]})
            if mode == "eager":
                row["same_tokens_as_hf"] = bool(same) and all(same)
    row["timing_warning"] = _timing_warning(args, row)
    if m["reps"]["ours_eager"]:
        te = _median_ms(m["reps"]["ours_eager"], key) / 1e3
        row.update(eager_ms_per_step=1e3 * te, graph_speedup=te / t)
    if telemetry is not None and telemetry.available:
        dec = telemetry.summary().phases.get("decode")
        tokens = sum(r["decode_tokens"] for r in ours)
        row["decode_j_per_token"] = dec.energy_j / tokens if dec and tokens else None
    return row


def _timing_warning(args, row: dict) -> str | None:
    """A note when the difference method looks unreliable for this row: a round's difference <= 0, or the
    median more than 2x away from the per-step records (the two walls moved apart under load, or
    --gen-len is too short for the step to stand out of the call's fixed costs)."""
    if args.timing != "difference":
        return None
    checks = [("rlengine", row["ms_per_step_reps"], row["ms_per_step"], row["trace_ms_per_step"])]
    if row.get("hf_ms_per_step") is not None:
        checks.append(("transformers", row["hf_ms_per_step_reps"], row["hf_ms_per_step"], row["hf_stream_ms_per_step"]))
    bad = [name for name, reps, diff, steps in checks if min(reps) <= 0 or not 0.5 <= diff / steps <= 2]
    if not bad:
        return None
    return (f"{' and '.join(bad)}: the wall-clock difference disagrees with the per-step records (> 2x or <= 0); "
            f"raise --gen-len or --reps, or use --timing steps")


def _prefill(args, llm: LLM, hf: list[HFProvider], vocab_size: int) -> dict:
    """The prefill section: --prefill-batch prompts of --prefill-len tokens, wall(generate 1 token) per
    provider, alternating rounds after one warm-up round, median of --reps."""
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, vocab_size, (args.prefill_len,), generator=gen).tolist()
               for _ in range(args.prefill_batch)]
    prefill_round(llm, hf, prompts)
    rounds = [prefill_round(llm, hf, prompts) for _ in range(args.reps)]
    tokens = args.prefill_batch * args.prefill_len
    ms = 1e3 * statistics.median(r["ours"] for r in rounds)
    out = {"prompt_len": args.prefill_len, "b": args.prefill_batch, "ms": ms, "tokens_per_s": 1e3 * tokens / ms,
           "hf_ms": None, "hf_tokens_per_s": None, "ratio": None, "ms_reps": [1e3 * r["ours"] for r in rounds]}
    for p in hf:
        prefix = "hf" if p.mode == "eager" else "hf_static"
        th = 1e3 * statistics.median(r[p.mode] for r in rounds)
        out.update({f"{prefix}_ms": th, f"{prefix}_tokens_per_s": 1e3 * tokens / th,
                    "ratio" if p.mode == "eager" else "static_ratio": th / ms,
                    f"{prefix}_ms_reps": [1e3 * r[p.mode] for r in rounds]})
    return out


def _progress(i: int, total: int, row: dict, started: float) -> str:
    """The line printed as each row finishes: which point, ms/step of both providers, the ratio."""
    hf = row.get("hf_ms_per_step")
    vs = f", transformers {hf:.3f} ms/step, ratio {row['ratio']:.2f}x" if hf is not None else ""
    note = f"\n  warning: {row['timing_warning']}" if row.get("timing_warning") else ""
    return (f"[{i}/{total}] context {row['context']} B_act {row['b_act']}: {row['ms_per_step']:.3f} ms/step"
            f"{vs} ({time.perf_counter() - started:.0f} s){note}")


def _profile(args, llm: LLM, prompts, name: str) -> None:
    """One untimed run under torch.profiler, recording --profile-window engine steps."""
    ranges = [r for r in (getattr(llm, "ranges", None),) if r is not None]  # engine NVTX / record_function ranges
    prof = step_profiler(args.profile, name=name, window=ProfileWindow.parse(args.profile_window), device=llm.device,
                         ranges=ranges)
    params = SamplingParams(temperature=0.0, max_tokens=args.gen_len, ignore_eos=True)
    with prof:
        for p in prompts:
            llm.add_request(p, params)
        while llm.has_unfinished():
            llm.step()
            prof.step()
    print(f"profile: {prof.trace_path} {prof.note}".rstrip())


def run(args) -> tuple[list[dict], dict]:
    """The sweep: table rows and the conditions they were measured under."""
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    ceilings = json.loads(Path(args.ceilings).read_text())["ceilings"] if args.ceilings else measure_ceilings(device)
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf_model = load_pair(args.model, dtype, device, tmp)
    cfg = ours.config
    # longest prompt per context: the lognormal tail is clipped at 3x the mean
    hi = {c: {"fixed": c, "uniform": 3 * c // 2, "lognormal": 3 * c}[args.length_dist] for c in args.contexts}
    limit = cfg.max_position_embeddings - args.gen_len - 1
    contexts = [c for c in args.contexts if c <= limit]
    if len(contexts) < len(args.contexts):
        print(f"dropping contexts > {limit} (max_position_embeddings {cfg.max_position_embeddings} - gen-len - 1)")
    if not contexts:
        raise ConfigError(f"no --contexts value fits the model: each must be <= {limit} "
                          f"(max_position_embeddings {cfg.max_position_embeddings} - --gen-len - 1)")
    hi = {c: min(hi[c], limit) for c in contexts}
    if args.prefill_len > cfg.max_position_embeddings - 2:
        raise ConfigError(f"--prefill-len {args.prefill_len} must be <= {cfg.max_position_embeddings - 2} "
                          f"(max_position_embeddings {cfg.max_position_embeddings} - 2), or 0 to skip the prefill row")
    args.max_model_len = max(max(hi.values()) + args.gen_len + 1, args.prefill_len + 2)
    compare = args.compare_eager and not args.enforce_eager
    llm = _engine(args, ours, device, args.enforce_eager, share=0.3 if compare else 0.6)
    eager = _engine(args, ours, device, True, share=0.3) if compare else None
    modes = {"eager": ["eager"], "static": ["static"], "both": ["eager", "static"], "none": []}[args.hf]
    hf = [HFProvider(hf_model, m, compile_backend=args.hf_compile_backend) for m in modes]
    print(f"attention backend: {llm.attention_backend}; CUDA graphs: "
          f"{'on' if llm.cuda_graphs_off is None else 'off (' + llm.cuda_graphs_off + ')'}; "
          f"async scheduling: {'on' if llm.async_scheduling else 'off'}")
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    telemetry = NvmlSampler(cuda_devices=[index]) if device.type == "cuda" else None
    if telemetry is None or not telemetry.available:
        print(telemetry.reason if telemetry else "energy per token: no NVML on a CPU run")
    else:
        llm.phase_listener = telemetry.start()
    gen = torch.Generator().manual_seed(0)
    rows, skipped = [], []
    points, started = [(ctx, b) for ctx in contexts for b in args.batches], time.perf_counter()
    for i, (ctx, b) in enumerate(points, 1):
        lens = sample_lengths(args.length_dist, ctx, b, seed=1000 * ctx + b, hi=hi[ctx])
        need = sum(llm.block_manager.blocks_for(n + args.gen_len + 1) for n in lens)
        if need > llm.block_manager.num_blocks:
            why = f"needs {need} KV blocks, the cache has {llm.block_manager.num_blocks} (B_KV)"
            skipped.append({"context": ctx, "b_act": b, "reason": why})
            print(f"skip B_act={b} at context {ctx}: {why}")
            continue
        prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in lens]
        m = _measure(args, llm, hf, prompts, eager, telemetry)
        rows.append(_row(args, cfg, b, ctx, lens, m, ceilings, telemetry))
        print(_progress(i, len(points), rows[-1], started), flush=True)
        if args.profile:
            _profile(args, llm, prompts, f"{args.name}_b{b}_ctx{ctx}")
    if telemetry is not None:
        telemetry.close()
    prefill = None
    if args.prefill_len:
        need = args.prefill_batch * llm.block_manager.blocks_for(args.prefill_len + 2)
        if need > llm.block_manager.num_blocks:
            prefill = {"skipped": f"needs {need} KV blocks, the cache has {llm.block_manager.num_blocks}"}
            print(f"skip the prefill row: {prefill['skipped']}")
        else:
            prefill = _prefill(args, llm, hf, cfg.vocab_size)
            vs = f", transformers {prefill['hf_ms']:.2f} ms, ratio {prefill['ratio']:.2f}x" if prefill["hf_ms"] else ""
            print(f"[prefill] {args.prefill_batch} x {args.prefill_len} tokens: {prefill['ms']:.2f} ms{vs}", flush=True)
    conditions = {"model": args.model, "dtype": args.dtype, "requested_backend": args.backend, "timing": args.timing,
                  "contexts": contexts, "length_dist": args.length_dist, "gen_len": args.gen_len, "reps": args.reps,
                  "prefill_len": args.prefill_len, "prefill_batch": args.prefill_batch,
                  "async_scheduling": llm.async_scheduling,
                  "hf_providers": {p.mode: p.label for p in hf}, "kv_blocks": llm.block_manager.num_blocks,
                  "energy": "NVML decode phase" if telemetry is not None and telemetry.available else
                            (telemetry.reason if telemetry else "unavailable: CPU run"),
                  "shapes": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                          "num_hidden_layers", "num_attention_heads",
                                                          "num_key_value_heads", "head_dim", "num_experts")},
                  "ceilings": ceilings, "skipped": skipped}
    return rows, {"conditions": conditions, "llm": llm, "prefill": prefill}


def _columns(rows: list[dict]) -> list[str]:
    cols = list(TABLE)
    for extra in (STATIC_COLUMNS, EAGER_COLUMNS, GPU_COLUMNS):
        if any(r.get(extra[0]) is not None for r in rows):
            cols += extra
    return cols


def _ints(name: str):
    def parse(text: str) -> list[int]:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
        if not values or values[0] < 1:
            raise argparse.ArgumentTypeError(f"--{name} must be positive integers, got {text!r}")
        return values
    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlengine bench decode", description=__doc__, formatter_class=HelpFormatter)
    add_model_options(p, dtypes=("float32", "bfloat16"), model_help="preset name or HF checkpoint directory")
    p.add_argument("--backend", default="auto", help="attention backend (auto, cpp, torch, ...)")
    p.add_argument("--batches", type=_ints("batches"), default=[2**i for i in range(9)], help="comma-separated B_act")
    p.add_argument("--max-batch", type=int, default=256, help="drop --batches values above this")
    p.add_argument("--contexts", type=_ints("contexts"), default=None,
                   help="comma-separated context (prompt) lengths, e.g. 128,1024,8192,32768 (default: --prompt-len)")
    p.add_argument("--prompt-len", type=int, default=32, help="the context when --contexts is not given")
    add_length_args(p, "prompt lengths around each context")
    p.add_argument("--gen-len", type=int, default=64, help="tokens generated per sequence in a timed round")
    p.add_argument("--timing", default="difference", choices=TIMINGS,
                   help="step time: (wall(gen-len tokens) - wall(1 token)) / (gen-len - 1), or per-step records")
    p.add_argument("--reps", type=int, default=3, help="timed rounds per provider and point (the median is reported)")
    p.add_argument("--prefill-len", type=int, default=512, help="prompt tokens of the prefill row (0: no prefill row)")
    p.add_argument("--prefill-batch", type=int, default=1, help="prompts prefilled together in the prefill row")
    p.add_argument("--kv-memory-gb", type=float, default=2.0, help="CPU: KV cache budget (caps B_KV)")
    p.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads for both providers")
    p.add_argument("--hf", default="eager", choices=["eager", "static", "both", "none"],
                   help="transformers providers: eager dynamic cache, static cache + torch.compile, both, none")
    p.add_argument("--hf-compile-backend", default="inductor", help="torch.compile backend of --hf static/both")
    p.add_argument("--no-hf", action="store_true", help="same as --hf none")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for rlengine's decode steps")
    p.add_argument("--compare-eager", action="store_true",
                   help="GPU: also time an eager (no CUDA graph) rlengine engine, side by side")
    p.add_argument("--ceilings", default=None, help="reuse a ceilings.json (rlengine bench ceilings)")
    p.add_argument("--profile", default=None, metavar="DIR", help="write a torch.profiler trace per row to DIR")
    p.add_argument("--profile-window", default="2:5", help="START:STOP engine steps to record (0 is the prefill)")
    p.add_argument("--out", default="bench/results", help="directory for the JSON and the figure")
    p.add_argument("--name", default=None,
                   help="file name without .json; replaces an existing file of that name (default: decode, or "
                        "decode-2, decode-3, ... so that no earlier result is overwritten)")
    p.add_argument("--no-plot", action="store_true", help="write no figure ({name}.png beside the JSON)")
    p.add_argument("--no-async", action="store_true",
                   help="GPU: run steps synchronously (default: async scheduling, the host's step t+1 overlapping "
                        "the device's step t; off on a CPU either way)")
    p.add_argument("--count-launches", action="store_true",
                   help="count the launches of one decode step by kind at --batches (default 1,64) instead "
                        "(CPU: Triton interpreter, max_model_len 40960; decode_launches.py)")
    p.add_argument("--sms", type=int, default=132, help="--count-launches: SM count the KV splits are planned for")
    p.add_argument("--decode-kernels", default="torch", choices=["torch", "fused"],
                   help="the GPU decode layer path (gen.decode_kernels; model/fused_decode.py), also when counting")
    return p


def _report(args, rows: list[dict], info: dict) -> None:
    """The tables with one line per column under each, the JSON and the figure."""
    cols = _columns(rows)
    columns = explain(cols, DECODE, args.timing)
    print()
    print(format_table(rows, cols))
    print(legend(columns))
    for mode, label in info["conditions"]["hf_providers"].items():
        print(f"{'hf_*' if mode == 'eager' else 'hf_static_*'}: {label}")
    prefill, extra = info["prefill"], {}
    if prefill and "skipped" not in prefill:
        pcols = [c for c in PREFILL if prefill.get(c) is not None]
        extra = {"prefill": prefill, "prefill_columns": explain(pcols, PREFILL, args.timing)}
        print(f"\nprefill ({args.prefill_batch} x {args.prefill_len} tokens, same weights and dtype):")
        print(format_table([prefill], pcols))
        print(legend(extra["prefill_columns"]))
    elif prefill:
        extra = {"prefill": prefill}
    if args.replace:
        print(f"replacing {Path(args.out) / args.name}.json (--name {args.name})")
    path = write_result(args.out, args.name, rows, conditions=info["conditions"], device=args.device,
                        llm=info["llm"], columns=columns, **extra)
    if not args.no_plot and rows:
        from rlengine.plots.measurements import plot_decode

        print(f"wrote {plot_decode(json.loads(path.read_text()), path.with_suffix('.png'))}")


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.count_launches:
        from rlengine.benchmarks import decode_launches

        if args.batches == p.get_default("batches"):
            args.batches = [1, 64]
        check_args(args, positive=("sms",))
        args.max_model_len = 40960
        return decode_launches.main(args)
    if args.gen_len < 2 or args.prompt_len < 1:
        p.error("--gen-len must be >= 2 and --prompt-len >= 1")
    if args.prefill_len < 0:
        p.error("--prefill-len must be >= 0 (0: no prefill row)")
    args.hf = "none" if args.no_hf else args.hf
    args.contexts = args.contexts or [args.prompt_len]
    args.batches = [b for b in args.batches if b <= args.max_batch]
    if not args.batches:
        p.error(f"no B_act in --batches is <= --max-batch {args.max_batch}")
    check_args(args, positive=("max_batch", "reps", "prefill_batch"))
    check_model(args.model, "--model")
    if args.ceilings and not Path(args.ceilings).is_file():
        raise ConfigError(f"--ceilings {args.ceilings}: file not found (write one with `rlengine bench ceilings`)")
    explicit = args.name
    args.name = free_name(args.out, args.name, "decode", (".json", ".png"))
    args.replace = explicit is not None and (Path(args.out) / f"{args.name}.json").exists()
    if explicit is None and args.name != "decode":
        print(f"{Path(args.out) / 'decode'}.json exists: writing {args.name}.json (pass --name to choose)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, info = run(args)
    _report(args, rows, info)
    return 0

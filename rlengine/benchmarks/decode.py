"""`rlengine bench decode`: decode throughput, latency and energy per active batch and context length.

For each context length in --contexts (prompt tokens; --length-dist makes them ragged around
it) and each B_act in --batches, B_act prompts are generated greedily for --gen-len tokens (EOS
ignored) by rlengine's LLM and by transformers' generate() on the SAME weights. Method:
  - rlengine: the decode StepRecords of llm.generate(...).trace. A step record covers the
    whole engine step: schedule, copy-on-write, forward, sampling (with its host read of the
    tokens) and postprocess. All B_act sequences run every decode step (equal gen lengths).
    ms_per_step is the median over --reps of each repetition's mean step; p50/p90/p99 pool
    every decode step of every repetition. Prefill throughput (prompt tokens / prefill step
    time) is reported apart from decode.
  - transformers (hf_baseline.py): "eager" = dynamic cache, eager forward (hf_* columns);
    "static" = static cache + torch.compile (hf_static_* columns), --hf both runs both. A
    step is the gap between two new tokens handed to a streamer; hf_p99_ms pools them.
    Token agreement is checked for every sequence of every repetition: *_same_frac is the
    fraction of identical sequences.
  - The providers alternate per row and per repetition (the median of --reps is reported),
    so machine noise hits them alike: compare the ratio columns, measured within one run.
  - B_KV: the KV cache is sized for the largest B_act at the longest context (capped by
    --kv-memory-gb on a CPU, a share of free memory on a GPU); (B_act, context) points that do
    not fit are skipped and listed under "skipped".
  - Peak memory: torch's peak allocation during rlengine's generate calls (GPU; everything
    resident counts: both models' weights and the KV pool). Energy: decode-phase joules per
    generated token from the NVML sampler, where NVML and a GPU are available.
  - CUDA graphs: on a GPU decode steps replay captured graphs; --enforce-eager turns them off,
    --compare-eager times an eager twin (eager_ms_per_step, graph_speedup).
  - Roofline (docs/METHOD.md Eq. 5): ceilings measured here (or --ceilings), bound at the mean
    context prompt + gen/2; fraction = measured / bound.
  - --profile DIR: after the timed repetitions, one more run of each row under torch.profiler
    for --profile-window engine steps (untimed, so the profiler's overhead stays out of rows).
Rows go to {--out}/{--name}.json with provenance (commit, dirty flag, backend actually used,
CUDA-graph state); tools/plots.py decode / sweep read them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from rlengine.analysis.ceilings import measure_ceilings
from rlengine.analysis.roofline import decode_roofline
from rlengine.benchmarks.args import add_model_options, check_args
from rlengine.benchmarks.hf_baseline import HFProvider, load_pair
from rlengine.benchmarks.lengths import add_length_args, sample_lengths
from rlengine.benchmarks.report import format_table, write_result
from rlengine.config import ConfigError
from rlengine.engine.kv_cache import bytes_per_block
from rlengine.config import DTYPES
from rlengine.engine.llm import LLM
from rlengine.engine.sampling_params import SamplingParams
from rlengine.preflight import check_model
from rlengine.telemetry.nvml import NvmlSampler
from rlengine.telemetry.profiler import ProfileWindow, step_profiler

COLUMNS = ["b_act", "tokens_per_s", "ms_per_step", "hf_tokens_per_s", "hf_ms_per_step", "ratio",
           "roofline_tokens_per_s", "roofline_fraction"]
TABLE = ["context", "b_act", "tokens_per_s", "ms_per_step", "p50_ms", "p90_ms", "p99_ms", "prefill_tokens_per_s",
         "hf_ms_per_step", "hf_p99_ms", "ratio", "hf_same_frac", "roofline_fraction"]
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
               num_kv_blocks=blocks, block_size=16, enforce_eager=enforce_eager)


def _ours(llm: LLM, prompts: list[list[int]], gen_len: int, telemetry=None) -> dict:
    """One rlengine repetition: decode step seconds, prefill tokens/seconds, tokens of every sequence."""
    device = llm.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True))
    if telemetry is not None:
        telemetry.set_phase("idle")
    decode = [r for r in outs.trace if r.kind == "decode"]
    assert all(r.b_act == len(prompts) for r in decode), "B_act varied within a run"
    prefill = [r for r in outs.trace if r.kind == "prefill"]
    return {"steps": [r.seconds for r in decode], "decode_tokens": sum(r.tokens for r in decode),
            "prefill_tokens": sum(r.tokens for r in prefill), "prefill_s": sum(r.seconds for r in prefill),
            "tokens": [o.outputs[0].token_ids for o in outs],
            "peak_mb": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None}


def _hf(provider: HFProvider, prompts, gen_len):
    try:
        return provider.step_times(prompts, gen_len)
    except torch.cuda.OutOfMemoryError:
        torch.cuda.empty_cache()
        return None, None


def _measure(args, llm: LLM, hf: list[HFProvider], prompts, eager: LLM | None, telemetry) -> dict:
    """Alternating repetitions of every provider on one (B_act, context) point."""
    warm = min(args.gen_len, 8)
    _ours(llm, prompts, warm)  # warm-up: allocator, oneDNN primitives, Triton JIT, the bucket's CUDA graph
    if eager is not None:
        _ours(eager, prompts, warm)
    for p in hf:  # a full measurement: static caches compile for exactly the shapes timed below
        _hf(p, prompts, args.gen_len)
    if telemetry is not None:
        telemetry.reset()
    reps = {"ours": [], "ours_eager": [], **{p.mode: [] for p in hf}}
    same = {p.mode: [] for p in hf}
    for _ in range(args.reps):
        run = _ours(llm, prompts, args.gen_len, telemetry)
        reps["ours"].append(run)
        if eager is not None:
            reps["ours_eager"].append(_ours(eager, prompts, args.gen_len))
        for p in hf:
            steps, tokens = _hf(p, prompts, args.gen_len)
            if steps is not None:
                reps[p.mode].append(steps)
                same[p.mode].extend(a == b for a, b in zip(run["tokens"], tokens))
    return {"reps": reps, "same": same}


def _row(args, cfg, b: int, ctx: int, lens: list[int], m: dict, ceilings: dict, telemetry) -> dict:
    ours = m["reps"]["ours"]
    means = [sum(r["steps"]) / len(r["steps"]) for r in ours]
    steps = [s for r in ours for s in r["steps"]]
    t = statistics.median(means)
    elem = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    flops = ceilings["flops_per_s"].get(args.dtype) or max(ceilings["flops_per_s"].values())
    mean_ctx = sum(lens) / len(lens)
    roof = decode_roofline(cfg, b_act=b, context_len=round(mean_ctx + args.gen_len / 2),
                           bandwidth=ceilings["bandwidth_bytes_per_s"], flops=flops, weight_bytes=elem, kv_bytes=elem)
    row = {"context": ctx, "mean_context": mean_ctx, "b_act": b, "tokens_per_s": b / t, "ms_per_step": 1e3 * t,
           "p50_ms": 1e3 * _pct(steps, 0.5), "p90_ms": 1e3 * _pct(steps, 0.9), "p99_ms": 1e3 * _pct(steps, 0.99),
           "prefill_tokens_per_s": (sum(r["prefill_tokens"] for r in ours)
                                    / max(1e-12, sum(r["prefill_s"] for r in ours))),
           "hf_tokens_per_s": None, "hf_ms_per_step": None, "ratio": None, "hf_same_frac": None,
           "same_tokens_as_hf": None, "roofline_tokens_per_s": roof.tokens_per_s,
           "roofline_fraction": b / t / roof.tokens_per_s, "ms_per_step_reps": [1e3 * x for x in means],
           "peak_mem_mb": max((r["peak_mb"] for r in ours if r["peak_mb"] is not None), default=None),
           "decode_j_per_token": None}
    for mode, prefix in (("eager", "hf"), ("static", "hf_static")):
        if m["reps"].get(mode):
            hf_means = [sum(x) / len(x) for x in m["reps"][mode]]
            th = statistics.median(hf_means)
            same = m["same"][mode]
            row.update({f"{prefix}_tokens_per_s": b / th, f"{prefix}_ms_per_step": 1e3 * th,
                        "ratio" if mode == "eager" else "static_ratio": th / t,
                        f"{prefix}_p99_ms": 1e3 * _pct([s for x in m["reps"][mode] for s in x], 0.99),
                        f"{prefix}_same_frac": sum(same) / len(same) if same else None,
                        f"{prefix}_ms_per_step_reps": [1e3 * x for x in hf_means]})
            if mode == "eager":
                row["same_tokens_as_hf"] = bool(same) and all(same)
    if m["reps"]["ours_eager"]:
        te = statistics.median(sum(r["steps"]) / len(r["steps"]) for r in m["reps"]["ours_eager"])
        row.update(eager_ms_per_step=1e3 * te, graph_speedup=te / t)
    if telemetry is not None and telemetry.available:
        dec = telemetry.summary().phases.get("decode")
        tokens = sum(r["decode_tokens"] for r in ours)
        row["decode_j_per_token"] = dec.energy_j / tokens if dec and tokens else None
    return row


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
    args.max_model_len = max(hi.values()) + args.gen_len + 1
    compare = args.compare_eager and not args.enforce_eager
    llm = _engine(args, ours, device, args.enforce_eager, share=0.3 if compare else 0.6)
    eager = _engine(args, ours, device, True, share=0.3) if compare else None
    modes = {"eager": ["eager"], "static": ["static"], "both": ["eager", "static"], "none": []}[args.hf]
    hf = [HFProvider(hf_model, m, compile_backend=args.hf_compile_backend) for m in modes]
    print(f"attention backend: {llm.attention_backend}; CUDA graphs: "
          f"{'on' if llm.cuda_graphs_off is None else 'off (' + llm.cuda_graphs_off + ')'}")
    index = device.index if device.index is not None else (torch.cuda.current_device() if device.type == "cuda" else 0)
    telemetry = NvmlSampler(cuda_devices=[index]) if device.type == "cuda" else None
    if telemetry is None or not telemetry.available:
        print(telemetry.reason if telemetry else "energy per token: no NVML on a CPU run")
    else:
        llm.phase_listener = telemetry.start()
    gen = torch.Generator().manual_seed(0)
    rows, skipped = [], []
    for ctx in contexts:
        for b in args.batches:
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
            table = format_table(rows, _columns(rows)).splitlines()
            print("\n".join(table if len(rows) == 1 else table[-1:]), flush=True)
            if args.profile:
                _profile(args, llm, prompts, f"{args.name}_b{b}_ctx{ctx}")
    if telemetry is not None:
        telemetry.close()
    conditions = {"model": args.model, "dtype": args.dtype, "requested_backend": args.backend,
                  "contexts": contexts, "length_dist": args.length_dist, "gen_len": args.gen_len, "reps": args.reps,
                  "hf_providers": {p.mode: p.label for p in hf}, "kv_blocks": llm.block_manager.num_blocks,
                  "energy": "NVML decode phase" if telemetry is not None and telemetry.available else
                            (telemetry.reason if telemetry else "unavailable: CPU run"),
                  "shapes": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                          "num_hidden_layers", "num_attention_heads",
                                                          "num_key_value_heads", "head_dim", "num_experts")},
                  "ceilings": ceilings, "skipped": skipped}
    return rows, {"conditions": conditions, "llm": llm}


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p, dtypes=("float32", "bfloat16"), model_help="preset name or HF checkpoint directory")
    p.add_argument("--backend", default="auto", help="attention backend (auto, cpp, torch, ...)")
    p.add_argument("--batches", type=_ints("batches"), default=[2**i for i in range(9)], help="comma-separated B_act")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--contexts", type=_ints("contexts"), default=None,
                   help="comma-separated context (prompt) lengths, e.g. 128,1024,8192,32768 (default: --prompt-len)")
    p.add_argument("--prompt-len", type=int, default=32, help="the context when --contexts is not given")
    add_length_args(p, "prompt lengths around each context")
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
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
    p.add_argument("--out", default="bench/results", help="directory for the JSON")
    p.add_argument("--name", default="decode", help="JSON file name (without .json)")
    args = p.parse_args(argv)
    if args.gen_len < 2 or args.prompt_len < 1:
        p.error("--gen-len must be >= 2 and --prompt-len >= 1")
    args.hf = "none" if args.no_hf else args.hf
    args.contexts = args.contexts or [args.prompt_len]
    args.batches = [b for b in args.batches if b <= args.max_batch]
    if not args.batches:
        p.error(f"no B_act in --batches is <= --max-batch {args.max_batch}")
    check_args(args, positive=("max_batch", "reps"))
    check_model(args.model, "--model")
    if args.ceilings and not Path(args.ceilings).is_file():
        raise ConfigError(f"--ceilings {args.ceilings}: file not found (write one with `rlengine bench ceilings`)")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, info = run(args)
    print()
    print(format_table(rows, _columns(rows)))
    for mode, label in info["conditions"]["hf_providers"].items():
        print(f"{'hf_*' if mode == 'eager' else 'hf_static_*'}: {label}")
    write_result(args.out, args.name, rows, conditions=info["conditions"], device=args.device, llm=info["llm"])
    return 0

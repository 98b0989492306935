"""`rlengine bench serve`: the engine API under requests arriving at a rate, vLLM benchmark_serving style.

Requests (random prompts of --input-len tokens, --output-len new tokens each, EOS ignored,
greedy; lengths fixed or ragged with --length-dist) arrive on a Poisson schedule at
--request-rate per second (gamma inter-arrival times with shape --burstiness, as vLLM; "inf"
sends all at t=0). One loop drives the engine: add every request that is due, run one
engine step, stamp the tokens it produced. A request's clock starts at its scheduled arrival,
so time spent waiting for the loop to admit it counts, as it would against a server.
TTFT / TPOT / ITL / E2EL, throughput and goodput (--goodput "ttft:MS tpot:MS") follow vLLM's
definitions (serving_metrics.py). One row per rate, after an untimed warm-up pass. This is
an in-process client: there is no HTTP or tokenizer in the numbers, unlike vLLM's.
With --url URL the same schedule (same prompts, lengths and arrivals) is also sent over HTTP to an
OpenAI-compatible server (`rlengine serve --model SAME_PRESET`, or vLLM's) by an async client
(serve_http.py), and each rate gets two rows, client "in-process" and "http": their difference is
what the HTTP path costs. The server's own engine settings are its own (its --max-num-seqs, dtype).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
import torch

from rlengine.benchmarks.args import add_model_options, check_args
from rlengine.benchmarks.lengths import add_length_args, sample_lengths
from rlengine.benchmarks.report import format_table, write_result
from rlengine.benchmarks.serve_http import drive_http, frozen_heap, served_model
from rlengine.benchmarks.serving_metrics import RequestTiming, parse_slos, serving_metrics
from rlengine.model.config import DTYPES, ConfigError, preset
from rlengine.engine.llm import LLM
from rlengine.engine.sampling_params import SamplingParams
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.telemetry.profiler import ProfileWindow, step_profiler

COLUMNS = ["request_rate", "completed", "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms",
           "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "request_goodput"]


def arrival_times(n: int, rate: float, *, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds at which request i is due: 0 first, then gamma(shape=burstiness, mean=1/rate) gaps."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"request rate and burstiness must be > 0, got {rate}, {burstiness}")
    rng, t, out = random.Random(seed), 0.0, []
    for i in range(n):
        if i and rate != float("inf"):
            t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return out


def drive(llm: LLM, prompts: list[list[int]], out_lens: list[int], arrivals: list[float], *, profiler=None,
          clock=time.perf_counter, sleep=time.sleep) -> tuple[list[RequestTiming], float]:
    """Run the schedule through llm.add_request / llm.step; returns each request's timeline and the duration."""
    timings = [RequestTiming(arrival=a, input_len=len(p)) for a, p in zip(arrivals, prompts)]
    active: dict[str, int] = {}
    nxt, t0 = 0, clock()
    while nxt < len(prompts) or active:
        now = clock() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            params = SamplingParams(temperature=0.0, max_tokens=out_lens[nxt], ignore_eos=True)
            active[llm.add_request(prompts[nxt], params, request_id=f"serve-{nxt}")] = nxt
            nxt += 1
        if not active:
            sleep(max(0.0, arrivals[nxt] - now))
            continue
        finished = llm.step()
        t = clock() - t0
        counts = {o.request_id: len(o.outputs[0].token_ids) for o in finished}
        for rid, i in list(active.items()):
            n = counts[rid] if rid in counts else llm.requests[rid].seqs[0].num_output_tokens
            timings[i].token_times.extend([t] * (n - len(timings[i].token_times)))
            if rid in counts:
                del active[rid]
        if profiler is not None:
            profiler.step()
    return timings, clock() - t0


def _rate(text: str) -> float:
    """One --request-rate entry: requests per second > 0, or inf."""
    try:
        rate = float(text)
    except ValueError:
        rate = float("nan")
    if not rate > 0:
        raise ConfigError(f"--request-rate entries must be numbers > 0 or inf, got {text.strip()!r}")
    return rate


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument("--backend", default="auto", help="attention backend")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode steps")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--request-rate", default="4,16,inf", help="comma-separated req/s ('inf': all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of inter-arrival times (1 = Poisson)")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    add_length_args(p, "input and output lengths")
    p.add_argument("--max-num-seqs", type=int, default=64, help="B_gen: sequences in flight")
    p.add_argument("--goodput", default=None, help="SLOs in ms, e.g. 'ttft:500 tpot:50'")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads")
    p.add_argument("--profile", default=None, metavar="DIR", help="torch.profiler trace of a window of engine steps")
    p.add_argument("--profile-window", default="4:8",
                   help="START:STOP engine steps to record, in an extra untimed pass at the first rate")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default="serve")
    p.add_argument("--url", default=None, help="also send the schedule over HTTP to the OpenAI-compatible server "
                   "at URL (e.g. http://127.0.0.1:8000, serving the same --model)")
    p.add_argument("--api-key", default=None, help="with --url: the server's bearer token")
    args = p.parse_args(argv)
    check_args(args, positive=("num_requests", "input_len", "output_len", "max_num_seqs"))
    preset(args.model)
    if not args.burstiness > 0:
        raise ConfigError(f"--burstiness must be > 0, got {args.burstiness}")
    try:
        slos = parse_slos(args.goodput)
    except ValueError as exc:
        raise ConfigError(f"--goodput: {exc}") from None
    rates = [_rate(r) for r in args.request_rate.split(",") if r.strip()]
    if not rates:
        raise ConfigError(f"--request-rate needs at least one rate, got {args.request_rate!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    n = args.num_requests
    in_lens = sample_lengths(args.length_dist, args.input_len, n, seed=args.seed)
    out_lens = sample_lengths(args.length_dist, args.output_len, n, seed=args.seed + 1)
    model = Qwen3ForCausalLM(preset(args.model), device=args.device, dtype=DTYPES[args.dtype])
    max_len = max(a + b for a, b in zip(in_lens, out_lens)) + 1
    if max_len > model.config.max_position_embeddings:
        raise ConfigError(f"--input-len + --output-len reach {max_len} tokens > max_position_embeddings "
                          f"{model.config.max_position_embeddings} of {args.model}")
    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_model_len=max_len, attention_backend=args.backend,
              enforce_eager=args.enforce_eager, seed=args.seed)
    llm.capture_decode_graphs()
    gen = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(3, model.config.vocab_size, (k,), generator=gen).tolist() for k in in_lens]
    warm = min(n, args.max_num_seqs)
    drive(llm, prompts[:warm], [min(8, k) for k in out_lens[:warm]], [0.0] * warm)  # untimed warm-up
    columns = COLUMNS if args.url is None else ["client"] + COLUMNS + ["failed"]
    if args.url is not None:
        served, _ = served_model(args.url, args.api_key)
        if served != args.model:
            print(f"note: the server at {args.url} serves {served!r}; the in-process rows run {args.model!r}")
        asyncio.run(drive_http(args.url, served, prompts[:warm], [min(8, k) for k in out_lens[:warm]], [0.0] * warm,
                               api_key=args.api_key))  # untimed warm-up
    rows = []
    for rate in rates:
        arrivals = arrival_times(n, rate, burstiness=args.burstiness, seed=args.seed)
        with frozen_heap():
            timings, duration = drive(llm, prompts, out_lens, arrivals)
        rows.append({**({"client": "in-process", "failed": 0} if args.url else {}),
                     "request_rate": "inf" if rate == float("inf") else rate, "burstiness": args.burstiness,
                     **serving_metrics(timings, duration, slos)})
        if args.url is not None:
            with frozen_heap():
                timings, duration, failed = asyncio.run(drive_http(args.url, served, prompts, out_lens, arrivals,
                                                                   api_key=args.api_key))
            rows.append({**rows[-1], "client": "http", **serving_metrics(timings, duration, slos), "failed": failed})
        for row in rows[-1 - (args.url is not None):]:
            print("  ".join(f"{c}={row[c]:.4g}" if isinstance(row[c], float) else f"{c}={row[c]}" for c in columns),
                  flush=True)
    if args.profile:  # a separate pass at the first rate: the profiler's overhead stays out of the rows
        prof = step_profiler(args.profile, name=f"{args.name}_steps", window=ProfileWindow.parse(args.profile_window),
                             device=model.device, ranges=[r for r in (getattr(llm, "ranges", None),) if r is not None])
        with prof:
            drive(llm, prompts, out_lens, arrival_times(n, rates[0], burstiness=args.burstiness, seed=args.seed),
                  profiler=prof)
        print(f"profile: {prof.trace_path}, {prof.table_path} {prof.note}")
    print()
    print(format_table(rows, columns))
    write_result(args.out, args.name, rows, device=model.device, llm=llm, conditions={
        "model": args.model, "dtype": args.dtype, "num_requests": n, "input_len": args.input_len,
        "output_len": args.output_len, "length_dist": args.length_dist, "max_num_seqs": args.max_num_seqs,
        "slos_ms": slos, "seed": args.seed, "client": "in-process (no HTTP, no tokenizer)" if args.url is None else
        f"in-process and HTTP to {args.url} (streamed /v1/completions, token-id prompts)"})
    return 0

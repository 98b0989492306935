"""Benchmark: top-k / top-p filtering and the whole sampler call, old sort-based path vs new.

Providers, side by side in one run on the same logits [B, V] (fp32, randn: a flat, untrained-model
distribution, the case where the nucleus is widest): "sorted" = filtering.filter_logits_sorted (the
candidates then a full sort of the rows whose nucleus reaches past them: the old path, still the
batch-invariant mode's), "radix-torch" = filtering.filter_logits with the radix select in torch
passes (nucleus_keep), "radix" = filtering.filter_logits as it runs (the C++ op csrc/nucleus.cpp on
the CPU when the extension is built). Cases: top_p alone, top_k alone, both. Each provider is timed on filter_logits alone and
on the Sampler call it sits in (temperature, filter, two-level race, log-prob). ratio_vs_top_k =
this row's ms over the radix top_k row's (the goal: top_p within 2x of top_k = 50 on the CPU).
The CPU's model name (lscpu) and the torch thread count are recorded with the numbers.

    python bench/bench_sampler_filter.py [--grid "B=8 V=151936"] [--threads 1] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch

from rlengine.benchmarks.harness import add_sweep_args, measure, report, selected_providers, sweep_cases
from rlengine.engine import filtering
from rlengine.engine import sampler as sampler_mod
from rlengine.engine.sampler import Sampler, make_sampling_batch
from rlengine.engine.sampling_params import SamplingParams
from rlengine.telemetry.provenance import cpu_model

PROVIDERS = ["sorted", "radix-torch", "radix"]  # sorted is the baseline


def _torch_nucleus(z, lse, top_p):
    return torch.where(filtering.nucleus_keep(z, lse, top_p, compact=True), z, float("-inf"))


def _provider(name):
    """The filter function of a provider, and the nucleus_filter it runs with."""
    if name == "sorted":
        return filtering.filter_logits_sorted, filtering.nucleus_filter
    return filtering.filter_logits, (_torch_nucleus if name == "radix-torch" else filtering.nucleus_filter)
CASES = {"top_p=0.95": dict(top_p=0.95), "top_k=50": dict(top_k=50), "top_k=50,top_p=0.95": dict(top_k=50, top_p=0.95)}


def _rows(B, V, device, providers, iters):
    z = torch.randn(B, V, device=device, generator=torch.Generator(device=device).manual_seed(0))
    rows = []
    for case, knobs in CASES.items():
        params = [SamplingParams(**knobs)] * B
        sb = make_sampling_batch(params, device=device, vocab_size=V)
        for name in providers:
            fn, nucleus = _provider(name)
            sampler = Sampler(device, seed=0)
            orig = sampler_mod.filter_logits, filtering.nucleus_filter
            sampler_mod.filter_logits, filtering.nucleus_filter = fn, nucleus  # the Sampler call with this filter
            try:
                filt = measure(lambda: fn(z, sb.top_k, sb.top_p, sb.max_top_k), iters=iters, device=device)
                full = measure(lambda: sampler(z, sb), iters=iters, device=device)
            finally:
                sampler_mod.filter_logits, filtering.nucleus_filter = orig
            rows.append({"provider": name, "case": case, "B": B, "V": V, "filter_ms": filt["ms"],
                         "filter_p10": filt["p10_ms"], "filter_p90": filt["p90_ms"], "sampler_ms": full["ms"]})
    base = next((r for r in rows if r["provider"] == "radix" and r["case"] == "top_k=50"), None)
    for r in rows:
        if base:
            r["filter_vs_top_k"] = r["filter_ms"] / base["filter_ms"]
            r["sampler_vs_top_k"] = r["sampler_ms"] / base["sampler_ms"]
    return rows


def _check_same_sets(B, V, device) -> int:
    """Rows where the sorted and radix providers keep different token sets on the benchmark's logits (expected 0)."""
    z = torch.randn(B, V, device=device, generator=torch.Generator(device=device).manual_seed(0))
    bad = 0
    for knobs in CASES.values():
        sb = make_sampling_batch([SamplingParams(**knobs)] * B, device=device, vocab_size=V)
        a = filtering.filter_logits_sorted(z, sb.top_k, sb.top_p, sb.max_top_k).isfinite()
        b = filtering.filter_logits(z, sb.top_k, sb.top_p, sb.max_top_k).isfinite()
        bad += int((a != b).any(dim=-1).sum())
    return bad


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_args(p, "B=8 V=151936", PROVIDERS)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared CPU)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    providers = selected_providers(args, PROVIDERS)
    rows, mismatches = [], {}
    for case in sweep_cases(args):
        B, V = int(case["B"]), int(case["V"])
        rows += _rows(B, V, device, providers, args.iters)
        mismatches[f"B={B},V={V}"] = _check_same_sets(B, V, device)
    print(f"CPU: {cpu_model()}, torch threads {torch.get_num_threads()}; rows whose kept sets differ: {mismatches}")
    report("bench_sampler_filter", rows, out=args.out, device=device,
           extra={"cpu_model": cpu_model(), "threads": torch.get_num_threads(), "logits": "randn fp32",
                  "kept_set_mismatches": mismatches},
           columns=["provider", "case", "B", "V", "filter_ms", "filter_p10", "filter_p90", "sampler_ms",
                    "filter_vs_top_k", "sampler_vs_top_k"])


if __name__ == "__main__":
    main()

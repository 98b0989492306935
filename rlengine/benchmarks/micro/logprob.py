"""Benchmark: fused LM-head log-prob (+entropy) vs the unfused path, forward and forward+backward.

Providers: "unfused" = h @ W^T in the input dtype, fp32 log_softmax over [T, V], gather (the
baseline every RL framework starts from); "fused" = rlengine.kernels.fused_logprob. Reports
median time, TFLOP/s counted as model FLOPs (2TVC forward, 6TVC forward+backward; the fused
backward really does 8TVC because it recomputes the logits) and peak memory above the inputs
during one call. mem_ratio is the unfused peak over the fused peak for the same mode (the goal
for fwd+bwd is >= 8: the fused backward holds one d(logits) chunk, not [T, V] logits). GPU
default: T=8192, V=151936 (Qwen3 vocab), C=1024, bf16. On CPU only the unfused path runs, on a
small case: the fused kernel needs a GPU (the Triton interpreter is a correctness tool).

    python bench/bench_logprob.py [--grid "T=8192 V=151936 C=1024"] [--dtype bf16] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch

from rlengine.kernels.fused_logprob import default_config, fused_logprob

from rlengine.benchmarks.harness import (add_sweep_args, load_ceilings, measure, one_launch, peak_memory_mb, rates,
                                         report, selected_providers, sweep_cases)

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROVIDERS = ["unfused", "fused"]  # unfused is the baseline


def unfused_logprob(h_TC, w_VC, targets_T, *, temperature=1.0, return_entropy=False):
    """Baseline: materialise the [T, V] logits in the input dtype, then fp32 log_softmax + gather."""
    logp_TV = torch.log_softmax((h_TC @ w_VC.T).float() / temperature, dim=-1)
    logp = logp_TV.gather(1, targets_T[:, None]).squeeze(1)
    if not return_entropy:
        return logp
    return logp, -(logp_TV.exp() * logp_TV).sum(dim=-1)


def _step(fn, h, w, targets, g_logp, g_ent, entropy: bool, backward: bool):
    def run():
        h.grad, w.grad = None, None
        out = fn(h, w, targets, temperature=1.0, return_entropy=entropy)
        if not backward:
            return out
        loss = (out[0] * g_logp).sum() + (out[1] * g_ent).sum() if entropy else (out * g_logp).sum()
        loss.backward()
    return run


def _peak_extra_mb(run, device) -> float | None:
    """Peak allocated memory during one call, above what was allocated before it (inputs)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device) / 2**20
    run()
    torch.cuda.synchronize(device)
    return peak_memory_mb(device) - base


def _bench_shape(T, V, C, dtype, device, fns, iters, ceilings, ncu):
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(T, C, device=device, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(V, C, device=device, dtype=dtype, generator=g) * C**-0.5).requires_grad_()
    targets = torch.randint(0, V, (T,), device=device, generator=g)
    g_logp, g_ent = torch.randn(T, device=device, generator=g), torch.randn(T, device=device, generator=g)
    rows = []
    for name, fn in fns.items():
        for entropy in (False, True):
            for backward in (False, True):
                run = _step(fn, h, w, targets, g_logp, g_ent, entropy, backward)
                mode = "fwd+bwd" if backward else "fwd"
                if ncu:
                    print(one_launch(run, label=f"{name} {mode} entropy={entropy}", device=device))
                    continue
                timing = measure(run, iters=iters, device=device)
                flops = (6 if backward else 2) * T * V * C
                rows.append({"provider": name, "mode": mode, "entropy": entropy, "T": T, "V": V, "C": C,
                             "ms": timing["ms"], "p10_ms": timing["p10_ms"], "p90_ms": timing["p90_ms"],
                             "model_tflops": rates(timing["ms"], flops=flops)["TFLOPs"],
                             "flops_frac": rates(timing["ms"], flops=flops, ceilings=ceilings,
                                                 dtype=str(dtype).replace("torch.", "")).get("flops_frac"),
                             "peak_extra_mb": _peak_extra_mb(run, device)})
    for r in rows:
        base = next((b for b in rows if b["provider"] == "unfused" and (b["mode"], b["entropy"], b["T"]) ==
                     (r["mode"], r["entropy"], r["T"])), None)
        if r["provider"] == "fused" and base and base["peak_extra_mb"] and r["peak_extra_mb"]:
            r["mem_ratio"] = base["peak_extra_mb"] / r["peak_extra_mb"]
            r["speedup"] = base["ms"] / r["ms"]
    extra = {}
    if "fused" in fns and "unfused" in fns and not ncu:
        with torch.no_grad():
            ref_lp, ref_ent = unfused_logprob(h, w, targets, return_entropy=True)
            lp, ent = fused_logprob(h, w, targets, return_entropy=True)
        extra = {"logp": (lp - ref_lp).abs().max().item(), "entropy": (ent - ref_ent).abs().max().item()}
        print(f"T={T} V={V} C={C}: fused vs unfused max |diff| {extra}")
    return rows, extra


def main(argv=None) -> None:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_args(p, "T=8192 V=151936 C=1024" if on_gpu else "T=512 V=8192 C=256", PROVIDERS)
    p.add_argument("--dtype", choices=DTYPES, default="bf16" if on_gpu else "fp32")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)

    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = DTYPES[args.dtype]
    wanted = selected_providers(args, PROVIDERS)
    fns = {"unfused": unfused_logprob, "fused": fused_logprob}
    skipped = []
    if not on_gpu and "fused" in wanted:
        wanted.remove("fused")
        skipped.append("fused: no CUDA device (Triton interpreter timings are meaningless); unfused only")
        print("SKIPPED " + skipped[-1])
    ceilings = load_ceilings(args.ceilings)
    rows, diffs = [], {}
    for case in sweep_cases(args):
        T, V, C = int(case["T"]), int(case["V"]), int(case["C"])
        shape_rows, diff = _bench_shape(T, V, C, dtype, device, {k: fns[k] for k in wanted}, args.iters, ceilings,
                                        args.ncu)
        rows += shape_rows
        if diff:
            diffs[f"T={T},V={V},C={C}"] = diff
    if args.ncu:
        return
    cfg = default_config(device, dtype)
    extra = {"dtype": args.dtype, "grid": args.shape or args.grid, "skipped": skipped, "max_abs_diff": diffs,
             "fused_config": {k: getattr(cfg, k) for k in cfg.__slots__}}
    report("bench_logprob", rows, out=args.out, extra=extra, device=device,
           columns=["provider", "mode", "entropy", "T", "V", "C", "ms", "p10_ms", "p90_ms", "model_tflops",
                    "peak_extra_mb", "mem_ratio", "speedup"])


if __name__ == "__main__":
    main()

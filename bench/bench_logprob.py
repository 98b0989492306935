"""Benchmark: fused LM-head log-prob (+entropy) vs the unfused path, forward and forward+backward.

Providers: "unfused" = h @ W^T in the input dtype, fp32 log_softmax over [T, V], gather (the
baseline every RL framework starts from); "fused" = rlengine.kernels.fused_logprob. Reports
median time, TFLOP/s counted as model FLOPs (2TVC forward, 6TVC forward+backward; the fused
backward really does 8TVC because it recomputes the logits) and peak memory above the inputs.
GPU default: T=8192, V=151936 (Qwen3 vocab), C=1024, bf16. On CPU only the unfused path runs,
on a small case: the fused kernel needs a GPU (the Triton interpreter is a correctness tool).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rlengine.kernels.fused_logprob import fused_logprob

from bench.harness import measure, peak_memory_mb, report

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def main(argv=None) -> None:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", type=int, default=8192 if on_gpu else 512)
    p.add_argument("--V", type=int, default=151936 if on_gpu else 8192)
    p.add_argument("--C", type=int, default=1024 if on_gpu else 256)
    p.add_argument("--dtype", choices=DTYPES, default="bf16" if on_gpu else "fp32")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None, help="output folder for the JSON (default bench/results)")
    args = p.parse_args(argv)

    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = DTYPES[args.dtype]
    T, V, C = args.T, args.V, args.C
    g = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(T, C, device=device, dtype=dtype, generator=g).requires_grad_()
    w = (torch.randn(V, C, device=device, dtype=dtype, generator=g) * C**-0.5).requires_grad_()
    targets = torch.randint(0, V, (T,), device=device, generator=g)
    g_logp, g_ent = torch.randn(T, device=device, generator=g), torch.randn(T, device=device, generator=g)

    providers = {"unfused": unfused_logprob}
    skipped = []
    if on_gpu:
        providers["fused"] = fused_logprob
    else:
        skipped.append("fused: no CUDA device (Triton interpreter timings are meaningless); unfused only")
        print("SKIPPED " + skipped[-1])

    rows = []
    for name, fn in providers.items():
        for entropy in (False, True):
            for backward in (False, True):
                run = _step(fn, h, w, targets, g_logp, g_ent, entropy, backward)
                timing = measure(run, iters=args.iters, device=device)
                flops = (6 if backward else 2) * T * V * C
                rows.append({"provider": name, "mode": "fwd+bwd" if backward else "fwd", "entropy": entropy,
                             "ms": timing["ms"], "p10_ms": timing["p10_ms"], "p90_ms": timing["p90_ms"],
                             "model_tflops": flops / (timing["ms"] * 1e-3) / 1e12,
                             "peak_extra_mb": _peak_extra_mb(run, device)})

    extra = {"shape": {"T": T, "V": V, "C": C, "dtype": args.dtype}, "skipped": skipped}
    if on_gpu:
        with torch.no_grad():
            ref_lp, ref_ent = unfused_logprob(h, w, targets, return_entropy=True)
            lp, ent = fused_logprob(h, w, targets, return_entropy=True)
        extra["max_abs_diff"] = {"logp": (lp - ref_lp).abs().max().item(), "entropy": (ent - ref_ent).abs().max().item()}
        print(f"fused vs unfused max |diff|: {extra['max_abs_diff']}")
    print(f"T={T} V={V} C={C} dtype={args.dtype} device={device}")
    report("bench_logprob", rows, out=args.out, extra=extra, device=device)


if __name__ == "__main__":
    main()

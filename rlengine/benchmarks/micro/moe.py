"""Fused MoE benchmark: forward and forward+backward time, TFLOP/s and peak memory per provider.

Shape: the Qwen3-30B-A3B experts (C=2048, F=768, E=128, K=8), T in {256, 4096, 32768}, bf16
on GPU. Providers: the reference loop over experts (fused_moe_ref, the baseline; skipped above
--ref-max-tokens, where it takes seconds per call), a sort + torch._grouped_mm version (where
torch has it and the GPU supports it; otherwise the row says why it was skipped), and the Triton
kernels (rlengine.kernels.fused_moe). FLOPs count the three expert GEMMs: forward 6*N*C*F,
forward+backward 18*N*C*F (N = T*K routed pairs). vs_grouped_mm is the Triton rate over the
torch._grouped_mm rate for the same T and mode (the goal for fwd+bwd at training T is >= 1.2).
Without a GPU it runs one small fp32 shape with the reference only and says so.

    python bench/bench_moe.py [--grid "T=256,4096,32768"] [--ceilings ceilings.json] [--out DIR]
    rlengine bench moe --breakdown [...]   time and TFLOP/s per launch (micro/moe_breakdown.py)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from rlengine.kernels.fused_moe import fused_moe, fused_moe_ref

from rlengine.benchmarks.harness import (add_sweep_args, load_ceilings, measure, one_launch, peak_memory_mb, rates,
                                         report, selected_providers, sweep_cases)

QWEN3_30B_A3B = {"C": 2048, "F": 768, "E": 128, "K": 8}
CPU_SHAPE = {"C": 64, "F": 32, "E": 8, "K": 2}
PROVIDERS = ["ref_loop", "grouped_mm", "triton"]


def grouped_mm_moe(x_TC, w13_EFC, w2_ECF, topk_weights_TK, topk_ids_TK):
    """Sort pairs by expert, gather x, two torch._grouped_mm calls, SwiGLU in torch, un-sort."""
    T, C = x_TC.shape
    E, F2, _ = w13_EFC.shape
    ids_N = topk_ids_TK.flatten()
    order_N = torch.argsort(ids_N, stable=True)
    counts_E = torch.zeros(E, dtype=torch.long, device=x_TC.device).scatter_add_(0, ids_N, torch.ones_like(ids_N))
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
    gu = torch._grouped_mm(x_TC[order_N // topk_ids_TK.shape[1]], w13_EFC.transpose(1, 2), offs=offs_E)
    h = torch.nn.functional.silu(gu[:, : F2 // 2]) * gu[:, F2 // 2:]
    out = torch._grouped_mm(h, w2_ECF.transpose(1, 2), offs=offs_E) * topk_weights_TK.flatten()[order_N, None]
    y_NC = out.new_empty(out.shape).index_copy(0, order_N, out)
    return y_NC.view(T, -1, C).sum(1)


def make_inputs(T, C, F, E, K, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    randn = lambda *s: torch.randn(*s, generator=gen, device=device)
    leaves = [randn(T, C), randn(E, 2 * F, C) / C**0.5, randn(E, C, F) / F**0.5]
    top_vals, ids = randn(T, E).topk(K, dim=1)  # random router logits
    leaves.append(torch.softmax(top_vals, dim=1))
    leaves = [t.to(dtype).requires_grad_() for t in leaves]
    return leaves, ids.contiguous(), randn(T, C).to(dtype)


def bench_provider(name, fn, leaves, ids, dy, flops_fwd, device, iters, ceilings, dtype):
    """Rows for forward and forward+backward of one provider (or one 'skipped' row per mode)."""
    rows = []
    modes = {"fwd": (lambda: fn(*leaves, ids), flops_fwd),
             "fwd+bwd": (lambda: torch.autograd.grad(fn(*leaves, ids), leaves, dy), 3 * flops_fwd)}
    for mode, (call, flops) in modes.items():
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(device)
        base_mb = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None
        try:
            t = measure(call, warmup=2, iters=iters, device=device)
        except (RuntimeError, NotImplementedError) as err:  # e.g. _grouped_mm on an unsupported GPU
            rows.append({"provider": name, "mode": mode, "skipped": f"{type(err).__name__}: {str(err)[:80]}"})
            continue
        peak = peak_memory_mb(device)
        r = rates(t["ms"], flops=flops, ceilings=ceilings, dtype=dtype)
        rows.append({"provider": name, "mode": mode, "ms": t["ms"], "p10_ms": t["p10_ms"], "p90_ms": t["p90_ms"],
                     "tflops": r["TFLOPs"], "flops_frac": r.get("flops_frac"), "peak_mb": peak,
                     "extra_mb": None if peak is None else peak - base_mb, "skipped": None})
    return rows


def run(tokens, shape, dtype, device, providers, *, ref_max_tokens, ceilings, ncu=False):
    rows = []
    C, F, E, K = shape["C"], shape["F"], shape["E"], shape["K"]
    dname = str(dtype).replace("torch.", "")
    for T in tokens:
        leaves, ids, dy = make_inputs(T, C, F, E, K, dtype, device)
        flops_fwd = 6 * T * K * C * F
        for name, fn in providers.items():
            if name == "ref_loop" and T > ref_max_tokens:
                fn = f"T > --ref-max-tokens={ref_max_tokens} (a Python loop over experts: seconds per call)"
            if isinstance(fn, str):  # a reason the provider cannot run here
                rows.append({"T": T, "provider": name, "mode": "-", "skipped": fn})
                continue
            if ncu:
                print(one_launch(lambda fn=fn, a=leaves, i=ids: fn(*a, i), label=f"{name} T={T}", device=device))
                continue
            for r in bench_provider(name, fn, leaves, ids, dy, flops_fwd, device, 10, ceilings, dname):
                rows.append({"T": T, **shape, "dtype": dname, **r})
        del leaves, ids, dy
    for r in rows:  # the goal's ratio: Triton over torch._grouped_mm, same T and mode
        base = next((b for b in rows if b["provider"] == "grouped_mm" and b.get("tflops")
                     and (b["T"], b["mode"]) == (r["T"], r["mode"])), None)
        if r["provider"] == "triton" and r.get("tflops") and base:
            r["vs_grouped_mm"] = r["tflops"] / base["tflops"]
    return rows


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--breakdown" in argv:  # its own options: rlengine/benchmarks/micro/moe_breakdown.py
        from rlengine.benchmarks.micro.moe_breakdown import BenchInputs, main as breakdown

        bench = BenchInputs(make_inputs=make_inputs, reference=grouped_mm_moe, shape=QWEN3_30B_A3B, cpu_shape=CPU_SHAPE)
        return breakdown([a for a in argv if a != "--breakdown"], bench)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    on_gpu = torch.cuda.is_available()
    add_sweep_args(parser, "T=256,4096,32768" if on_gpu else "T=64,256", PROVIDERS)
    parser.add_argument("--ref-max-tokens", type=int, default=4096, help="skip the reference loop above this T")
    parser.add_argument("--breakdown", action="store_true",
                        help="time and TFLOP/s per launch instead (see --breakdown --help)")
    args = parser.parse_args(argv)
    columns = ["T", "provider", "mode", "ms", "p10_ms", "p90_ms", "tflops", "vs_grouped_mm", "peak_mb", "extra_mb",
               "skipped"]
    t0 = time.perf_counter()
    tokens = [int(c["T"]) for c in sweep_cases(args)]
    wanted = selected_providers(args, PROVIDERS)
    ceilings = load_ceilings(args.ceilings)
    if not on_gpu:
        print("No GPU: running the reference loop on a small fp32 shape only; the Triton and "
              "torch._grouped_mm providers and the Qwen3-30B-A3B shape need a GPU.")
        device = torch.device("cpu")
        providers = {"ref_loop": fused_moe_ref, "grouped_mm": "needs a GPU", "triton": "needs a GPU"}
        shape, dtype = CPU_SHAPE, torch.float32
    else:
        device = torch.device("cuda")
        torch.backends.cuda.matmul.allow_tf32 = False
        grouped = grouped_mm_moe if hasattr(torch, "_grouped_mm") else "torch._grouped_mm not in this torch"
        providers = {"ref_loop": fused_moe_ref, "grouped_mm": grouped, "triton": fused_moe}
        shape, dtype = QWEN3_30B_A3B, torch.bfloat16
    providers = {k: v for k, v in providers.items() if k in wanted}
    rows = run(tokens, shape, dtype, device, providers, ref_max_tokens=args.ref_max_tokens, ceilings=ceilings,
               ncu=args.ncu)
    if args.ncu:
        return
    report("bench_moe", rows, out=args.out, columns=columns, device=device,
           extra={"shape": shape, "flops": "fwd 6*N*C*F, fwd+bwd 18*N*C*F, N = T*K", "grid": args.shape or args.grid},
           plot={"path": args.plot, "x": "T", "y": ["tflops"], "group": ["provider", "mode"]})
    print(f"total {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""Fused MoE per-launch breakdown (`rlengine bench moe --breakdown`): time and TFLOP/s of every launch.

One forward + backward of the fused MoE at the Qwen3-30B-A3B expert shape, per backward variant
("v1", "sorted"): every Triton launch (sort, gate/up, down, the backward kernels) is wrapped in a
CUDA event pair as it runs inside the real call, so the list is what fused_moe launches, in order,
at its real stream position (no L2 flush between launches). Rows beside it: routing (the model's
router GEMM, softmax, top-k, renormalisation, in torch), the sort as a whole (moe_align: the torch
version above its kernel's 8,192-pair limit), "torch glue" (the call's time outside the timed
launches: the forward's top-k sum, zero fills, casts), the call totals, and the reference
(torch._grouped_mm, same inputs) with the backward's ratio to it. FLOPs per launch are its GEMM's
2*M*N*K over the routed rows (padding rows excluded).
Without a GPU it records the launch list of one small fp32 call under TRITON_INTERPRET=1 (in a
subprocess, so the kernels are interpreted) and prints it with grids and FLOPs, no times.

    rlengine bench moe --breakdown [--grid "T=4096,32768"] [--variants v1,sorted] [--iters N] [--out DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from rlengine.benchmarks.harness import load_ceilings, measure, parse_grid, rates, report

VARIANTS = ("v1", "sorted")


@dataclass(frozen=True, slots=True)
class BenchInputs:
    """What the MoE benchmark (micro/moe.py, which dispatches --breakdown here) shares with this one."""

    make_inputs: Callable  # (T, C, F, E, K, dtype, device) -> (leaves, ids, dy)
    reference: Callable    # torch._grouped_mm MoE with fused_moe's signature
    shape: dict            # the GPU shape: C, F, E, K
    cpu_shape: dict        # the interpreted call's shape
# (module, attribute) of every Triton kernel the fused MoE path launches
KERNEL_SITES = (("moe_align", "_moe_align_kernel"), ("fused_moe", "_gate_up_kernel"),
                ("moe_gemm", "_pair_gemm_kernel"), ("fused_moe_bwd", "_down_bwd_kernel"),
                ("fused_moe_bwd", "_weight_grad_kernel"), ("fused_moe_bwd", "_sorted_wgrad_kernel"))


def launch_label(kernel: str, a: dict) -> str:
    """What one launch computes, from its kernel and constexpr arguments."""
    if kernel == "_pair_gemm_kernel":
        if a["HAS_SCALE"]:
            return "down"
        return "dx + top-k sum (atomic epilogue)" if a["TOKEN_ATOMIC"] else "dx per pair"
    if kernel == "_weight_grad_kernel":
        return "dW2" if a["A_BY_TOKEN"] else "dW13"
    return {"_moe_align_kernel": "sort (kernel)", "_gate_up_kernel": "gate/up + SwiGLU",
            "_down_bwd_kernel": "dh + SwiGLU bwd + d router weights",
            "_sorted_wgrad_kernel": "dW13 + dW2 (persistent)"}[kernel]


def launch_flops(kernel: str, a: dict) -> float:
    """GEMM FLOPs of one launch over the N routed rows (2 * rows * out * reduce)."""
    N = a.get("N", 0)
    if kernel == "_gate_up_kernel":
        return 2.0 * N * 2 * a["F"] * a["C"]
    if kernel == "_pair_gemm_kernel":
        return 2.0 * N * a["NOUT"] * a["KDIM"]
    if kernel == "_down_bwd_kernel":
        return 2.0 * N * a["C"] * a["F"]
    if kernel == "_weight_grad_kernel":
        return 2.0 * N * a["P"] * a["Q"]
    if kernel == "_sorted_wgrad_kernel":
        return 2.0 * N * a["C"] * a["F"] * (2 * bool(a["DO_W13"]) + bool(a["DO_W2"]))
    return 0.0


class LaunchRecorder:
    """Wraps the MoE kernels so that every launch appends {phase, kernel, label, grid, flops} to
    `launches` (with a CUDA event pair on a GPU); `phase` is set by the caller around each part."""

    def __init__(self, timed: bool):
        self.timed, self.phase, self.launches = timed, "", []

    @contextlib.contextmanager
    def installed(self):
        import importlib

        saved = []
        try:
            for mod_name, attr in KERNEL_SITES:
                mod = importlib.import_module(f"rlengine.kernels.{mod_name}")
                saved.append((mod, attr, getattr(mod, attr)))
                setattr(mod, attr, _Wrapped(attr, getattr(mod, attr), self))
            yield self
        finally:
            for mod, attr, kernel in saved:
                setattr(mod, attr, kernel)


class _Wrapped:
    def __init__(self, name, kernel, recorder: LaunchRecorder):
        self.name, self.kernel, self.recorder = name, kernel, recorder

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            a = dict(zip(self.kernel.arg_names, args), **kwargs)
            rec = {"phase": self.recorder.phase, "kernel": self.name, "label": launch_label(self.name, a),
                   "grid": "x".join(str(g) for g in grid), "flops": launch_flops(self.name, a)}
            if self.recorder.timed:
                rec["events"] = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                rec["events"][0].record()
            out = launch(*args, **kwargs)
            if self.recorder.timed:
                rec["events"][1].record()
            self.recorder.launches.append(rec)
            return out

        return run


def one_call(recorder: LaunchRecorder, leaves, ids, dy, variant: str):
    """One fused MoE forward and backward with the recorder's phases set."""
    from rlengine.kernels.fused_moe import fused_moe

    recorder.phase = "fwd"
    y = fused_moe(*leaves, ids, backward=variant)
    recorder.phase = "bwd"
    torch.autograd.grad(y, leaves, dy)


def launch_rows(leaves, ids, dy, variant: str, *, iters: int, ceilings, dtype: str) -> list[dict]:
    """One row per launch of a fused MoE call (median over iters on a GPU; the list alone on a CPU)."""
    timed = leaves[0].is_cuda
    recorder = LaunchRecorder(timed)
    with recorder.installed():
        for _ in range(2 if timed else 0):  # compile and tune first
            one_call(recorder, leaves, ids, dy, variant)
        recorder.launches.clear()
        calls = iters if timed else 1
        for _ in range(calls):
            one_call(recorder, leaves, ids, dy, variant)
    if timed:
        torch.cuda.synchronize()
    per_call = len(recorder.launches) // calls
    rows = []
    for i, rec in enumerate(recorder.launches[:per_call]):
        row = {"variant": variant, "phase": rec["phase"], "launch": rec["label"], "kernel": rec["kernel"],
               "grid": rec["grid"], "gflop": rec["flops"] / 1e9}
        if timed:
            ms = statistics.median(r["events"][0].elapsed_time(r["events"][1])
                                   for r in recorder.launches[i::per_call])
            row.update(ms=ms, tflops=rates(ms, flops=rec["flops"], ceilings=ceilings, dtype=dtype)["TFLOPs"]
                       if rec["flops"] else None)
        rows.append(row)
    return rows


def _routing(x_TC, router_EC, K):
    probs = torch.softmax(x_TC @ router_EC.t(), dim=-1, dtype=torch.float32)
    w, ids = probs.topk(K, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(x_TC.dtype), ids


def gpu_rows(T: int, bench: BenchInputs, variants, *, iters: int, ceilings) -> list[dict]:
    from rlengine.kernels.fused_moe import fused_moe, select_config
    from rlengine.kernels.moe_align import moe_align

    C, F, E, K = (bench.shape[k] for k in "CFEK")
    dtype, device = torch.bfloat16, torch.device("cuda")
    leaves, ids, dy = bench.make_inputs(T, C, F, E, K, dtype, device)
    router = torch.randn(E, C, device=device, dtype=dtype) / C**0.5
    block_m = select_config(T * K, E, C, F).block_m
    common = {"T": T, "variant": "-"}
    rows = [{**common, "phase": "fwd", "launch": "routing (torch)",
             "ms": measure(lambda: _routing(leaves[0], router, K), device=device)["ms"]},
            {**common, "phase": "fwd", "launch": "sort (moe_align call)",
             "ms": measure(lambda: moe_align(ids, E, block_m), device=device)["ms"]}]
    totals = {}
    providers = [("grouped_mm", bench.reference)] + [(v, lambda *a, v=v: fused_moe(*a, backward=v)) for v in variants]
    for name, fn in providers:
        fwd = measure(lambda: fn(*leaves, ids), device=device)["ms"]
        both = measure(lambda: torch.autograd.grad(fn(*leaves, ids), leaves, dy), device=device)["ms"]
        totals[name] = {"fwd": fwd, "bwd": both - fwd, "fwd+bwd": both}
    flops = {"fwd": 6.0 * T * K * C * F, "bwd": 12.0 * T * K * C * F, "fwd+bwd": 18.0 * T * K * C * F}
    for v in variants:
        launches = launch_rows(leaves, ids, dy, v, iters=iters, ceilings=ceilings, dtype="bfloat16")
        rows += [{"T": T, **r} for r in launches]
        glue = totals[v]["fwd+bwd"] - sum(r["ms"] for r in launches)
        rows.append({"T": T, "variant": v, "phase": "fwd+bwd", "launch": "torch glue (outside the launches)",
                     "ms": glue})
    for name, t in totals.items():
        for mode, ms in t.items():
            base = totals["grouped_mm"][mode]
            rows.append({"T": T, "variant": name, "phase": mode, "launch": "total", "ms": ms,
                         "tflops": flops[mode] / ms / 1e9, "vs_grouped_mm": base / ms})
    return rows


def cpu_launch_list(out: str | None) -> int:
    """The launch list of one small fp32 call, in a child process with the kernels interpreted."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    cmd = [sys.executable, "-m", "rlengine.cli", "bench", "moe", "--breakdown", "--interpreted"]
    return subprocess.run(cmd + (["--out", out] if out else []), env=env).returncode


def interpreted_list(bench: BenchInputs, out: str | None) -> int:
    """The launch list of one fp32 call at bench.cpu_shape, T = 64 (the kernels must be interpreted)."""
    C, F, E, K = (bench.cpu_shape[k] for k in "CFEK")
    T = 64
    leaves, ids, dy = bench.make_inputs(T, C, F, E, K, torch.float32, torch.device("cpu"))
    rows = []
    for v in VARIANTS:
        rows += [{"T": T, **r} for r in launch_rows(leaves, ids, dy, v, iters=1, ceilings=None, dtype="float32")]
    print("No GPU: the launch list of one fp32 fused MoE call under TRITON_INTERPRET=1 "
          f"(C={C}, F={F}, E={E}, K={K}, T={T}); times and TFLOP/s need a GPU.")
    report("bench_moe_breakdown", rows, out=out, columns=["T", "variant", "phase", "launch", "kernel", "grid", "gflop"],
           extra={"shape": bench.cpu_shape, "timed": False})
    return 0


def main(argv, bench: BenchInputs) -> int:
    parser = argparse.ArgumentParser(prog="rlengine bench moe --breakdown", description=__doc__.splitlines()[0])
    parser.add_argument("--grid", default="T=4096,32768", help="token counts, e.g. 'T=4096,32768'")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"backward variants, subset of {VARIANTS}")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per variant (median per launch)")
    parser.add_argument("--ceilings", default=None, help="ceilings.json for fractions of the measured FLOP/s")
    parser.add_argument("--out", default=None, help="output folder for the JSON (default bench/results)")
    parser.add_argument("--interpreted", action="store_true", help=argparse.SUPPRESS)  # the CPU child process
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or set(variants) - set(VARIANTS):
        parser.error(f"--variants must be a comma-separated subset of {VARIANTS}, got {args.variants!r}")
    if args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    tokens = [int(c["T"]) for c in parse_grid(args.grid)]
    if args.interpreted:
        return interpreted_list(bench, args.out)
    if not torch.cuda.is_available():
        return cpu_launch_list(args.out)
    t0, rows = time.perf_counter(), []
    torch.backends.cuda.matmul.allow_tf32 = False
    for T in tokens:
        rows += gpu_rows(T, bench, variants, iters=args.iters, ceilings=load_ceilings(args.ceilings))
    report("bench_moe_breakdown", rows, out=args.out,
           columns=["T", "variant", "phase", "launch", "grid", "ms", "tflops", "gflop", "vs_grouped_mm"],
           extra={"shape": bench.shape, "dtype": "bfloat16", "timed": True,
                  "flops": "per launch 2*rows*out*reduce over routed rows; totals fwd 6, bwd 12, fwd+bwd 18 *N*C*F"},
           device=torch.device("cuda"))
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0


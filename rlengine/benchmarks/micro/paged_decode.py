"""Paged decode attention: torch reference vs C++ CPU kernel vs Triton split-KV kernel.

Qwen3-0.6B heads (H=16, Hkv=8, D=128, P=16), fragmented page tables, every sequence at the same
context length. The op is memory bound (each K/V byte of the batch is read once), so it reports
median ms, GB/s of K/V read and that rate's fraction of the measured copy bandwidth (--ceilings
from `rlengine bench ceilings`; the goal at long contexts is >= 0.85), and the speedup over the
reference. Triton runs as the engine runs it: a workspace sized by num_kv_heads and splits chosen
from the SM count (the S column; S=1 is one launch without the merge kernel). Triton runs only on
a GPU, the C++ kernel only on the CPU. Timing: rlengine/benchmarks/harness.py (L2 flushed before every call).

    python bench/bench_paged_decode.py [--grid "B=1,8,64 ctx=4096,32768"] [--dtype bfloat16]
        [--ceilings bench/results/ceilings.json] [--out DIR]
"""

from __future__ import annotations

import argparse

import torch

from rlengine.benchmarks.harness import (add_sweep_args, load_ceilings, measure, one_launch, rates, report,
                                         selected_providers, sweep_cases)
from rlengine.model import ext as _ext
from rlengine.kernels import paged_decode as pd

H, HKV, D, P = 16, 8, 128, 16
PROVIDERS = ["torch_ref", "cpp", "triton"]  # torch_ref is the baseline of every speedup


def make_inputs(B: int, ctx: int, dtype: torch.dtype, device: torch.device):
    """Random q and a cache holding B sequences of ctx tokens on shuffled pages."""
    pages = -(-ctx // P)
    num_blocks = B * pages
    q = torch.randn(B, H, D, dtype=dtype, device=device)
    k_cache = torch.randn(num_blocks, P, HKV, D, dtype=dtype, device=device)
    v_cache = torch.randn(num_blocks, P, HKV, D, dtype=dtype, device=device)
    kv_indptr = torch.arange(0, B * pages + 1, pages, dtype=torch.int32, device=device)
    kv_indices = torch.randperm(num_blocks, device=device).to(torch.int32)
    kv_last_page_len = torch.full((B,), ctx - (pages - 1) * P, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, pages


def provider_fns(B: int, ctx: int, dtype: torch.dtype, device: torch.device, wanted: list[str]):
    """{name: (fn, note)} for the providers runnable on this device; a str instead of fn says why not."""
    q, k_cache, v_cache, indptr, indices, last_len, pages = make_inputs(B, ctx, dtype, device)
    tables = (indptr, indices, last_len)
    scale = D**-0.5
    out = torch.empty_like(q)
    fns = {"torch_ref": (lambda: pd.paged_decode_ref(q, k_cache, v_cache, *tables, sm_scale=scale), None)}
    if device.type == "cpu" and _ext.has_op("paged_decode"):
        op = torch.ops.rlengine.paged_decode
        fns["cpp"] = (lambda: op(q, k_cache, v_cache, *tables, scale, out), None)
    else:
        fns["cpp"] = ("CPU only" if device.type == "cuda" else "C++ extension without paged_decode", None)
    if device.type == "cuda":
        ws = pd.alloc_workspace(B, H, D, pd.MAX_SPLITS, device, num_kv_heads=HKV)
        splits = min(pd.choose_num_splits(B, HKV, pages, P, device), ws.max_splits(B))
        fns["triton"] = (lambda: pd.paged_decode(q, k_cache, v_cache, *tables, sm_scale=scale, max_num_pages=pages,
                                                 out=out, workspace=ws), splits)
    else:
        fns["triton"] = ("needs a GPU (the Triton interpreter is not a benchmark)", None)
    return {name: fns[name] for name in wanted}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    on_gpu = torch.cuda.is_available()
    add_sweep_args(parser, "B=1,8,64 ctx=4096,32768" if on_gpu else "B=1,4 ctx=128,1024", PROVIDERS)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--iters", type=int, default=10, help="minimum timed calls per provider and shape")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = getattr(torch, args.dtype)
    wanted = selected_providers(args, PROVIDERS)
    ceilings = load_ceilings(args.ceilings)
    rows = []
    for case in sweep_cases(args):
        B, ctx = int(case["B"]), int(case["ctx"])
        kv_bytes = 2 * B * ctx * HKV * D * dtype.itemsize
        ref_ms = None
        for name, (fn, splits) in provider_fns(B, ctx, dtype, device, wanted).items():
            row = {"provider": name, "B_act": B, "ctx": ctx, "S": splits}
            if isinstance(fn, str):
                rows.append({**row, "skipped": fn})
                continue
            if args.ncu:
                print(one_launch(fn, label=f"{name} B={B} ctx={ctx}", device=device))
                continue
            t = measure(fn, warmup=2, iters=args.iters, device=device)
            ref_ms = t["ms"] if name == "torch_ref" else ref_ms
            r = rates(t["ms"], nbytes=kv_bytes, ceilings=ceilings)
            rows.append({**row, "ms": t["ms"], "p10_ms": t["p10_ms"], "p90_ms": t["p90_ms"], "GB/s": r["GBps"],
                         "frac_of_copy_bw": r.get("bw_frac"), "speedup_vs_ref": ref_ms / t["ms"] if ref_ms else None,
                         "method": t["method"], "skipped": None})
            print(rows[-1], flush=True)
    if args.ncu:
        return
    report("paged_decode", rows, out=args.out, device=device,
           columns=["provider", "B_act", "ctx", "S", "ms", "p10_ms", "p90_ms", "GB/s", "frac_of_copy_bw",
                    "speedup_vs_ref", "skipped"],
           extra={"shape": {"H": H, "Hkv": HKV, "D": D, "P": P}, "dtype": args.dtype, "grid": args.shape or args.grid,
                  "ceilings": ceilings},
           plot={"path": args.plot, "x": "ctx", "y": ["GB/s"], "group": ["provider", "B_act"]})


if __name__ == "__main__":
    main()

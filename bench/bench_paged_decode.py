"""Paged decode attention: torch reference vs C++ CPU kernel vs Triton split-KV kernel.

Qwen3-0.6B-like heads (H=16, Hkv=8, D=128, P=16), fragmented page tables, every sequence at
the same context length. Reports median ms, GB/s of K/V read (the op is memory bound: each
K/V byte of the batch is read once) and the speedup over the reference. Triton runs only on a
GPU; the C++ kernel only on the CPU. --quick (the default without a GPU; --full overrides)
drops B_act=64 and uses fewer iterations.

    python bench/bench_paged_decode.py [--quick | --full] [--dtype bfloat16] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from bench.harness import measure, report
from rlengine import _ext
from rlengine.kernels.paged_decode import alloc_workspace, choose_num_splits, paged_decode, paged_decode_ref

H, HKV, D, P = 16, 8, 128, 16


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


def providers(B: int, ctx: int, dtype: torch.dtype, device: torch.device):
    """(name, fn) pairs runnable on this device; the reference first."""
    q, k_cache, v_cache, indptr, indices, last_len, pages = make_inputs(B, ctx, dtype, device)
    tables = (indptr, indices, last_len)
    scale = D**-0.5
    out = torch.empty_like(q)
    yield "torch_ref", lambda: paged_decode_ref(q, k_cache, v_cache, *tables, sm_scale=scale)
    if device.type == "cpu" and _ext.has_op("paged_decode"):
        op = torch.ops.rlengine.paged_decode
        yield "cpp", lambda: op(q, k_cache, v_cache, *tables, scale, out)
    if device.type == "cuda":
        splits = choose_num_splits(B, HKV, pages, P, device)
        ws = alloc_workspace(B, H, D, splits, device)
        yield f"triton(S={splits})", lambda: paged_decode(q, k_cache, v_cache, *tables, sm_scale=scale,
                                                          max_num_pages=pages, out=out, workspace=ws)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="smaller sweep, fewer iterations (default on CPU)")
    size.add_argument("--full", action="store_true", help="full sweep even on CPU")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="directory for the JSON (default bench/results)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    quick = args.quick or (device.type == "cpu" and not args.full)
    batches = [1, 4, 16] if quick else [1, 4, 16, 64]
    contexts = [128, 1024]
    iters = 5 if quick else 20
    if device.type == "cpu":
        print("no GPU: Triton provider skipped (it runs only on CUDA; the interpreter is not a benchmark)")
    if not _ext.has_op("paged_decode"):
        print("C++ extension without paged_decode: cpp provider skipped")

    rows = []
    for ctx in contexts:
        for B in batches:
            kv_bytes = 2 * B * ctx * HKV * D * dtype.itemsize
            ref_ms = None
            for name, fn in providers(B, ctx, dtype, device):
                t = measure(fn, warmup=2, iters=iters, device=device)
                ref_ms = ref_ms or t["ms"]
                rows.append({"provider": name, "B_act": B, "ctx": ctx, "ms": t["ms"], "p10_ms": t["p10_ms"],
                             "p90_ms": t["p90_ms"], "GB/s": kv_bytes / t["ms"] / 1e6,
                             "speedup_vs_ref": ref_ms / t["ms"]})
    report("paged_decode", rows, out=args.out, device=device,
           extra={"shape": {"H": H, "Hkv": HKV, "D": D, "P": P}, "dtype": args.dtype, "quick": quick})


if __name__ == "__main__":
    main()

"""python -m rlengine.benchmarks.small_m_tune: the small-M GEMMs' tile configs, measured per shape class on a GPU.

For a model preset (default Qwen3-0.6B) and rows M in --rows, each of the fused decode layer's four
projections (norm+qkv, o_proj+residual, norm+gate_up+SiLU, down+residual) times every candidate of
kernels/small_m_gemm.CANDIDATES (CUDA events, median of --reps launches after warm-up) and the
heuristic's pick, beside torch's own GEMM of the same shape (the reference: F.linear, no fused
prologue or epilogue). Prints one table and writes small_m_tune.json: per shape class the winner, its
microseconds, the heuristic's and torch's. Stops after --seconds (compiles included) and records what
it measured. GPU only (untested here: written in a session without a device).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from rlengine.kernels.timing import cuda_seconds


def main(argv: list[str] | None = None) -> int:
    from rlengine.kernels import small_m_gemm as sm
    from rlengine.model.config import preset
    from rlengine.telemetry.provenance import provenance

    p = argparse.ArgumentParser(prog="python -m rlengine.benchmarks.small_m_tune", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--rows", default="1,64", help="comma-separated M (B_act of a decode step)")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--seconds", type=float, default=120.0, help="stop measuring after this long")
    p.add_argument("--out", default="bench/results")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("small_m_tune: error: it measures on a CUDA device; none is visible", file=sys.stderr)
        return 2
    cfg, dev, dtype = preset(args.model), torch.device("cuda"), torch.bfloat16
    C, F_ = cfg.hidden_size, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    o_in = cfg.num_attention_heads * cfg.head_dim
    shapes = {"qkv": (qkv, C, sm.EPI_NONE), "o_proj": (C, o_in, sm.EPI_RESIDUAL), "gate_up": (F_, C, sm.EPI_SILU),
              "down": (C, F_, sm.EPI_RESIDUAL)}
    ws = sm.SmallMWorkspace.for_shapes([(n, k) for n, k, _ in shapes.values()], dev)
    rows, started = [], time.perf_counter()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for M in (int(m) for m in args.rows.split(",")):
        for name, (N, K, epi) in shapes.items():
            if time.perf_counter() - started > args.seconds:
                break
            heuristic = sm.choose_config(M, N, K, dtype, epi, sms)
            best, times = sm.tune(M, N, K, dtype, epi, ws, reps=args.reps)
            x = torch.randn(M, K, device=dev, dtype=dtype)
            w = torch.randn(2 * N if epi == sm.EPI_SILU else N, K, device=dev, dtype=dtype)
            torch_us = 1e6 * cuda_seconds(lambda: F.linear(x, w), args.reps, warmup=3)
            rows.append({"op": name, "M": M, "N": N, "K": K, "best": str(best), "best_us": round(times[best], 2),
                         "heuristic": str(heuristic), "heuristic_us": round(times.get(heuristic, float("nan")), 2),
                         "torch_linear_us": round(torch_us, 2),
                         "candidates_us": {str(c): round(t, 2) for c, t in times.items()}})
            r = rows[-1]
            print(f"{name:8s} M={M:<3d} N={N:<6d} K={K:<6d} best {r['best_us']:8.2f} us  heuristic "
                  f"{r['heuristic_us']:8.2f} us  torch linear {r['torch_linear_us']:8.2f} us  {r['best']}", flush=True)
    out = Path(args.out) / "small_m_tune.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"name": "small_m_tune", "model": args.model, "dtype": "bfloat16", "rows": rows,
                               "seconds": round(time.perf_counter() - started, 1), "conditions": provenance(dev)},
                              indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

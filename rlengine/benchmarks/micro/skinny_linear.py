"""Benchmark: rlengine's skinny linear (csrc/skinny_linear.cpp) vs torch's linear at decode shapes on the CPU.

y[B, N] = x[B, K] @ w[N, K]^T for B_act = 1, 2, 4 (the CPU decode path's weight stream), at the
projection shapes of the qwen3-30m and qwen3-0.6b presets, fp32 and bf16. Each timed call walks
a ring of distinct weight matrices (>= 64 MB in all), so the weights come from memory, not from a
warm cache, as in a real decode step. Reports median us per call, weight GB/s of both providers
(torch's F.linear is the reference), their fraction of the measured copy bandwidth (--ceilings,
from `rlengine bench ceilings`) and the speedup. The sweep is declarative, e.g.
    python bench/bench_skinny_linear.py --grid "model=qwen3-30m proj=qkv,down dtype=bf16 B=1,4" --plot sl.png
--decode adds the end-to-end view: mean decode-step time of the engine (qwen3-30m, cpp backend,
32-token prompts, 32 new tokens) with the skinny linear on and off, alternating in one process.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import rlengine.model.qwen3 as qwen3
from rlengine.model import ops
from rlengine import LLM, SamplingParams
from rlengine.model import ext as _ext
from rlengine.model.config import preset

from rlengine.benchmarks.harness import (add_sweep_args, load_ceilings, measure, one_launch, rates, report,
                                         selected_providers, sweep_cases)

PROVIDERS = ["torch", "skinny"]  # "torch" (F.linear) is the reference

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _shapes(name: str) -> dict[str, tuple[int, int]]:
    c = preset(name)
    H, Hkv, D, C = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    return {"qkv": ((H + 2 * Hkv) * D, C), "o": (C, H * D), "gate_up": (2 * c.intermediate_size, C),
            "down": (C, c.intermediate_size), "lm_head": (c.vocab_size, C)}


def _decode_ab(dtypes: list[str], batches: list[int], reps: int) -> list[dict]:
    """Engine decode step time with the skinny linear on vs off (ops.SKINNY), alternating."""
    rows = []
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for dname in dtypes:
        model = qwen3.Qwen3ForCausalLM(preset("qwen3-30m"), dtype=DTYPES[dname])
        llm = LLM(model, max_num_seqs=max(batches), max_model_len=80, attention_backend="cpp")
        for B in batches:
            prompts = torch.randint(3, 4000, (B, 32), generator=torch.Generator().manual_seed(B)).tolist()
            ms = {True: [], False: []}
            for rep in range(reps + 1):
                for on in (True, False):
                    ops.SKINNY = on
                    trace = llm.generate(prompts, params).trace
                    steps = [r.seconds for r in trace if r.kind == "decode"]
                    if rep:  # the first round is warm-up
                        ms[on].append(1e3 * sum(steps) / len(steps))
            ops.SKINNY = _ext.has_op("skinny_linear")
            on, off = sorted(ms[True])[len(ms[True]) // 2], sorted(ms[False])[len(ms[False]) // 2]
            rows.append({"model": "qwen3-30m", "proj": "decode step", "dtype": dname, "B": B, "torch_us": 1e3 * off,
                         "skinny_us": 1e3 * on, "speedup": off / on})
            print(rows[-1], flush=True)
    return rows


def _ring(model: str, proj: str, dname: str) -> tuple[list[torch.Tensor], int]:
    """Distinct weight matrices totalling >= 64 MB (so each call streams from memory) and bytes of one."""
    N, K = _shapes(model)[proj]
    dtype = DTYPES[dname]
    nbytes = N * K * torch.empty((), dtype=dtype).element_size()
    return [torch.randn(N, K, dtype=dtype) for _ in range(max(2, -(-64 * 2**20 // nbytes)))], nbytes


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_args(p, "model=qwen3-30m,qwen3-0.6b proj=qkv,o,gate_up,down,lm_head dtype=fp32,bf16 B=1,2,4", PROVIDERS)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--decode", action="store_true", help="also time whole decode steps with the op on / off")
    p.add_argument("--decode-batches", default="1,2,4,8")
    args = p.parse_args(argv)
    if not _ext.has_op("skinny_linear"):
        raise SystemExit("the C++ extension with skinny_linear is not built (pip install -e . or "
                         "python setup.py build_ext --inplace)")
    fns = {"torch": F.linear, "skinny": torch.ops.rlengine.skinny_linear}
    providers = selected_providers(args, PROVIDERS)
    ceilings = load_ceilings(args.ceilings)
    rows, rings = [], {}
    for case in sweep_cases(args):
        model, proj, dname, B = str(case["model"]), str(case["proj"]), str(case["dtype"]), int(case["B"])
        key = (model, proj, dname)
        if key not in rings:
            rings = {key: _ring(*key)}  # one ring alive at a time
        ring, nbytes = rings[key]
        N, K = ring[0].shape
        x = torch.randn(B, K, dtype=DTYPES[dname])
        row = {"model": model, "proj": proj, "N": N, "K": K, "dtype": dname, "B": B}
        for name in providers:
            it = iter(range(10**9))

            def call(fn=fns[name], it=it):
                return fn(x, ring[next(it) % len(ring)])

            with torch.inference_mode():
                if args.ncu:
                    print(one_launch(call, label=f"{name} {model} {proj} {dname} B={B}", warmup=len(ring)))
                    continue
                row[f"{name}_us"] = 1e3 * measure(call, warmup=len(ring), iters=args.iters)["ms"]
            r = rates(row[f"{name}_us"] * 1e-3, nbytes=nbytes, ceilings=ceilings)
            row[f"{name}_GBps"], row[f"{name}_bw_frac"] = r["GBps"], r.get("bw_frac")
        if args.ncu:
            continue
        if "torch_us" in row and "skinny_us" in row:
            row["speedup"] = row["torch_us"] / row["skinny_us"]
        rows.append(row)
        print(rows[-1], flush=True)
    if args.ncu:
        return
    if args.decode:
        rows += _decode_ab(sorted({str(c["dtype"]) for c in sweep_cases(args)}),
                           [int(b) for b in args.decode_batches.split(",")], reps=5)
    report("bench_skinny_linear", rows, out=args.out, extra={"grid": args.shape or args.grid},
           columns=["model", "proj", "N", "K", "dtype", "B", "torch_us", "skinny_us", "torch_GBps", "skinny_GBps",
                    "skinny_bw_frac", "speedup"],
           plot={"path": args.plot, "x": "B", "y": [f"{n}_GBps" for n in providers], "group": ["proj", "dtype"]})


if __name__ == "__main__":
    main()

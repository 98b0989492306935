"""Benchmark: rlengine's skinny linear (csrc/skinny_linear.cpp) vs torch's linear at decode shapes on the CPU.

y[B, N] = x[B, K] @ w[N, K]^T for B_act = 1, 2, 4 (the CPU decode path's weight stream), at the
projection shapes of the qwen3-30m and qwen3-0.6b presets, fp32 and bf16. Each timed call walks
a ring of distinct weight matrices (>= 64 MB in all), so the weights come from memory, not from a
warm cache, as in a real decode step. Reports median us per call, weight GB/s and the speedup.
--decode adds the end-to-end view: mean decode-step time of the engine (qwen3-30m, cpp backend,
32-token prompts, 32 new tokens) with the skinny linear on and off, alternating in one process.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import rlengine.model.qwen3 as qwen3
from rlengine import LLM, SamplingParams, _ext
from rlengine.config import preset

from bench.harness import measure, report

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _shapes(name: str) -> dict[str, tuple[int, int]]:
    c = preset(name)
    H, Hkv, D, C = c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size
    return {"qkv": ((H + 2 * Hkv) * D, C), "o": (C, H * D), "gate_up": (2 * c.intermediate_size, C),
            "down": (C, c.intermediate_size), "lm_head": (c.vocab_size, C)}


def _decode_ab(dtypes: list[str], batches: list[int], reps: int) -> list[dict]:
    """Engine decode step time with the skinny linear on vs off (qwen3._SKINNY), alternating."""
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
                    qwen3._SKINNY = on
                    trace = llm.generate(prompts, params).trace
                    steps = [r.seconds for r in trace if r.kind == "decode"]
                    if rep:  # the first round is warm-up
                        ms[on].append(1e3 * sum(steps) / len(steps))
            qwen3._SKINNY = _ext.has_op("skinny_linear")
            on, off = sorted(ms[True])[len(ms[True]) // 2], sorted(ms[False])[len(ms[False]) // 2]
            rows.append({"model": "qwen3-30m", "proj": "decode step", "dtype": dname, "B": B, "torch_us": 1e3 * off,
                         "skinny_us": 1e3 * on, "speedup": off / on})
            print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-30m,qwen3-0.6b")
    p.add_argument("--batches", default="1,2,4")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--decode", action="store_true", help="also time whole decode steps with the op on / off")
    p.add_argument("--decode-batches", default="1,2,4,8")
    p.add_argument("--out", default=None, help="output folder for the JSON (default bench/results)")
    args = p.parse_args(argv)
    if not _ext.has_op("skinny_linear"):
        raise SystemExit("the C++ extension with skinny_linear is not built (pip install -e . or "
                         "python setup.py build_ext --inplace)")
    skinny = torch.ops.rlengine.skinny_linear
    rows = []
    for model in args.models.split(","):
        for proj, (N, K) in _shapes(model).items():
            for dname in args.dtypes.split(","):
                dtype = DTYPES[dname]
                nbytes = N * K * torch.empty((), dtype=dtype).element_size()
                ring = [torch.randn(N, K, dtype=dtype) for _ in range(max(2, -(-64 * 2**20 // nbytes)))]
                for B in (int(b) for b in args.batches.split(",")):
                    x = torch.randn(B, K, dtype=dtype)
                    row = {"model": model, "proj": proj, "N": N, "K": K, "dtype": dname, "B": B}
                    for name, fn in (("torch", F.linear), ("skinny", skinny)):
                        it = iter(range(10**9))

                        def call(fn=fn, it=it):
                            return fn(x, ring[next(it) % len(ring)])

                        with torch.inference_mode():
                            row[f"{name}_us"] = 1e3 * measure(call, warmup=len(ring), iters=args.iters)["ms"]
                    row["skinny_GBps"] = nbytes / (row["skinny_us"] * 1e-6) / 1e9
                    row["speedup"] = row["torch_us"] / row["skinny_us"]
                    rows.append(row)
                    print(rows[-1], flush=True)
    if args.decode:
        rows += _decode_ab(args.dtypes.split(","), [int(b) for b in args.decode_batches.split(",")], reps=5)
    report("bench_skinny_linear", rows, out=args.out,
           columns=["model", "proj", "N", "K", "dtype", "B", "torch_us", "skinny_us", "skinny_GBps", "speedup"])


if __name__ == "__main__":
    main()

"""Benchmark: LoRA's cost to the engine and its saving to the learner.

decode: the engine's mean decode-step time on the CPU (qwen3-30m, random weights, cpp backend) with r = 8
adapters on all-linear applied unmerged, against the same model with the adapters switched off (the
reference: adapters_disabled, the base's own path), alternating in one process on one engine so both see
the same machine state; median over rounds, per B_act. memory: the learner's per-device training state from
the memory plan (analysis.memory.training_state_bytes, bf16 with fp32 masters, KL reference on) at the
qwen3-0.6b and llama-3-8b shapes, full fine-tuning against LoRA. Prints a table and writes JSON
(conditions included: CPU model, threads, versions). --clock cpu times the decode step in the thread's CPU
time instead of the engine trace's wall time: (CPU time of a 17-token generate - that of a 1-token one) / 16,
so on a shared, loaded CPU the time other processes hold the core is left out (their cache and memory traffic
is not).
    python bench/bench_lora.py --threads 1 --batches 1,4,16,64 --rounds 5 [--dtype bfloat16] [--clock cpu]
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import torch

from rlengine import LLM, SamplingParams
from rlengine.analysis.memory import training_state_bytes
from rlengine.analysis.roofline import param_counts
from rlengine.benchmarks.harness import report
from rlengine.model.config import preset
from rlengine.model.lora import LoraSpec, add_lora, adapters, adapters_disabled, lora_stored_count
from rlengine.model.qwen3 import Qwen3ForCausalLM

SPEC = LoraSpec(r=8, alpha=16.0, targets="all-linear")


def _cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _step_ms(llm, prompts, clock: str) -> float:
    """One decode step's mean time (ms) over a 16-token generate: wall from the engine trace, or thread CPU time."""
    if clock == "cpu":
        t0 = time.thread_time()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        t1 = time.thread_time()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True))
        return 1e3 * ((time.thread_time() - t1) - (t1 - t0)) / 16
    trace = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)).trace
    steps = [r.seconds for r in trace if r.kind == "decode"]
    return 1e3 * sum(steps) / len(steps)


def decode_rows(batches: list[int], rounds: int, dtype: torch.dtype, clock: str = "wall") -> list[dict]:
    model = Qwen3ForCausalLM(preset("qwen3-30m"), dtype=dtype)
    add_lora(model, SPEC, seed=1)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():  # non-zero B: the adapters' arithmetic is what a trained adapter costs
        for a in adapters(model):
            a.lora_B.copy_(torch.randn(a.lora_B.shape, generator=gen).to(dtype) * 0.01 * a.mask)
    llm = LLM(model, max_num_seqs=max(batches), max_model_len=64, attention_backend="cpp")
    rows = []
    for B in batches:
        prompts = torch.randint(3, 4000, (B, 16), generator=torch.Generator().manual_seed(B)).tolist()
        ms = {"lora": [], "base": []}
        for rep in range(rounds + 1):
            for kind in ("lora", "base"):
                if kind == "base":
                    with adapters_disabled(model):
                        step = _step_ms(llm, prompts, clock)
                else:
                    step = _step_ms(llm, prompts, clock)
                if rep:  # round 0 warms up (kernel choices, allocations)
                    ms[kind].append(step)
        lora, base = sorted(ms["lora"])[rounds // 2], sorted(ms["base"])[rounds // 2]
        rows.append({"what": "decode step", "model": "qwen3-30m", "dtype": str(dtype).removeprefix("torch."),
                     "B_act": B, "clock": clock, "base_ms": base, "lora_ms": lora, "ratio": lora / base})
        print(rows[-1], flush=True)
    return rows


def _load_average() -> list[float]:
    """The machine's 1/5/15-minute load averages when the bench ends (how shared the CPU was)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def memory_rows() -> list[dict]:
    rows = []
    for name in ("qwen3-0.6b", "llama-3-8b"):
        cfg = preset(name)
        stored = lora_stored_count(cfg, SPEC)
        full = training_state_bytes(cfg, "bfloat16", kl_reference=True)
        lora = training_state_bytes(cfg, "bfloat16", kl_reference=True, lora_params=stored)
        rows.append({"what": "learner state (plan)", "model": name, "dtype": "bfloat16", "params": param_counts(cfg).total,
                     "lora_params": stored, "full_GiB": full / 2**30, "lora_GiB": lora / 2**30, "ratio": lora / full})
        print(rows[-1], flush=True)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="decode-step time: the engine trace's wall time, or the thread's CPU time (a loaded machine)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = decode_rows([int(b) for b in args.batches.split(",")], args.rounds, getattr(torch, args.dtype), args.clock)
    rows += memory_rows()
    report("bench_lora", rows, out=args.out, extra={"cpu": _cpu_model(), "threads": args.threads, "rank": SPEC.r,
                                                     "targets": list(SPEC.targets), "clock": args.clock,
                                                     "load_average": _load_average()},
           columns=["what", "model", "dtype", "B_act", "base_ms", "lora_ms", "full_GiB", "lora_GiB", "ratio"])


if __name__ == "__main__":
    main()

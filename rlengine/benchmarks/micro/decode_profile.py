"""Benchmark: where a CPU decode step's time goes, per B_act and dtype, next to transformers and the linear floor.

For each dtype in --dtypes and B_act in --batches, B_act sequences of --context prompt tokens
decode in one LLM (cpp attention backend, the engine's own kernel choices); per point, in this
order, side by side in one process:
  - step_ms: the median wall time of --steps plain engine steps (llm.step(): schedule, prepare,
    forward, sampling with its host read, postprocess);
  - the breakdown: --steps more steps with manual perf_counter timers around the step's pieces,
    patched in for those steps only: projections (the q/k/v, o, gate/up and down linears),
    lm_head (compute_logits), attention (KV write + paged decode, backend.attend), norms
    (rms_norm / fused add + RMSNorm), rope (q/k norm + RoPE), act (SiLU * up), embed, sampler,
    prepare (step inputs + backend.plan) and host (the rest of the step: schedule, postprocess
    and the Python of the forward loop). Means over the steps, the slowest fifth dropped (a
    shared CPU's bursts), so the parts add up to the instrumented step;
  - linear_ms: the fastest implementation (torch's linear, the C++ skinny linear, the blocked linear,
    torch's GEMM over weight blocks, the chunked fp32 upcast for bf16; the candidates the engine
    chooses from) of each projection shape,
    chosen by timing a back-to-back chain over the model's real weights of that shape, then all of
    them timed in the step's order (layer by layer, the weights streaming through the cache once,
    as in a step): the weight-streaming floor of a step. step / linear is what the rest of the
    step costs on top;
  - hf_ms: transformers generate() on the same weights and dtype (dynamic cache, eager), the
    median gap between new tokens handed to a streamer; ratio = hf_ms / step_ms.
With --rounds R > 1 the plain steps (on a fresh engine, so every round decodes the same contexts) and
the linear floor alternate R times; step_ms, linear_ms and linear_best come from the round with the
median step / linear (every round is in the JSON): on a shared CPU a burst then moves one round, not
the step against a floor timed minutes apart. --clock cpu times the steps, parts and floor in the
process's CPU seconds instead of wall seconds (run with one thread).
    python bench/bench_decode_profile.py --batches 1,8,32,64 --dtypes float32,bfloat16 --out docs/results
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from rlengine import LLM, SamplingParams
from rlengine.benchmarks.harness import report
from rlengine.benchmarks.hf_baseline import HFProvider, load_pair
from rlengine.model import ops as op_dispatch
from rlengine.model.kernel_choice import projection_shapes

CLOCKS = {"wall": "perf_counter", "cpu": "process_time"}
PARTS = ("projections", "lm_head", "attention", "norms", "rope", "act", "embed", "sampler", "prepare")
COLUMNS = ["dtype", "b_act", "step_ms", "hf_ms", "ratio", "linear_ms", "step_over_linear", "instrumented_ms",
           *(f"{p}_ms" for p in PARTS), "host_ms"]


class Timers:
    """Seconds spent in each named part during one step; wrap() times a callable into a part."""

    def __init__(self, clock: str = "perf_counter"):
        self.s = dict.fromkeys(PARTS, 0.0)
        self.clock = clock  # the name of a `time` function: perf_counter (wall) or process_time (CPU)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            t0 = getattr(time, self.clock)()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s[part] += getattr(time, self.clock)() - t0
        return timed


@contextlib.contextmanager
def instrumented(llm: LLM, timers: Timers):
    """The engine with the timers patched around its step's pieces; everything restored on exit."""
    ops, runner, model = op_dispatch.CPU_OPS, llm.runner, llm.model
    saved = {"sampler": runner.sampler, "prepare": runner.inputs.prepare}
    op_dispatch.CPU_OPS = op_dispatch.FusedOps(timers.wrap("norms", ops.rms_norm),
                                               timers.wrap("norms", ops.fused_add_rms_norm),
                                               timers.wrap("rope", ops.qk_norm_rope),
                                               timers.wrap("act", ops.silu_and_mul),
                                               timers.wrap("projections", ops.linear))
    llm.backend.attend = timers.wrap("attention", llm.backend.attend)
    llm.backend.plan = timers.wrap("prepare", llm.backend.plan)
    model.compute_logits = timers.wrap("lm_head", model.compute_logits)
    model.model.embed_tokens.forward = timers.wrap("embed", model.model.embed_tokens.forward)
    runner.sampler = timers.wrap("sampler", runner.sampler)
    runner.inputs.prepare = timers.wrap("prepare", runner.inputs.prepare)
    try:
        yield
    finally:
        op_dispatch.CPU_OPS = ops
        for obj, name in ((llm.backend, "attend"), (llm.backend, "plan"), (model, "compute_logits"),
                          (model.model.embed_tokens, "forward")):
            del obj.__dict__[name]  # the class's method again
        runner.sampler, runner.inputs.prepare = saved["sampler"], saved["prepare"]


def _decode_engine(model, B: int, context: int, steps: int, cpu_kernels: str = "cache") -> LLM:
    """An LLM whose B sequences are all in the decode phase (prefill and three warm-up steps done:
    the kernel choices for this B are made by then)."""
    max_tokens = 2 * steps + 8
    need = -(-(context + max_tokens + 1) // 16)
    llm = LLM(model, max_num_seqs=B, max_model_len=context + max_tokens + 1, attention_backend="cpp",
              num_kv_blocks=B * need + 2, block_size=16, cpu_kernels=cpu_kernels)
    gen = torch.Generator().manual_seed(B)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(B):
        llm.add_request(torch.randint(3, model.config.vocab_size, (context,), generator=gen).tolist(), params)
    while llm.scheduler.waiting:
        llm.step()
    for _ in range(3):
        llm.step()
    return llm


def _steps(llm: LLM, n: int, timers: Timers | None = None, clock: str = "perf_counter") -> list[dict]:
    """n engine steps: each {"step": seconds, part: seconds...} (parts only with timers), on `time.<clock>`."""
    out = []
    for _ in range(n):
        if timers is not None:
            timers.s = dict.fromkeys(PARTS, 0.0)
        t0 = getattr(time, clock)()
        llm.step()
        rec = {"step": getattr(time, clock)() - t0}
        if timers is not None:
            rec.update(timers.s)
        out.append(rec)
    return out


def _linear_candidates(x, w, logits: bool) -> dict:
    """The implementations the engine chooses from for x @ w.T (ops.py), as callables of (x, w)."""
    cands = {"torch": (lambda a, b: F.linear(a.float(), b.float())) if logits and x.dtype != torch.float32
             else F.linear}
    if op_dispatch._skinny_ok(x, w):
        cands["skinny"] = torch.ops.rlengine.skinny_logits if logits else torch.ops.rlengine.skinny_linear
    if x.dtype == torch.bfloat16:
        out = torch.float32 if logits else torch.bfloat16
        cands["upcast"] = lambda a, b: op_dispatch._upcast_matmul(a, b, out)
    if op_dispatch._blocked_ok(x, w):
        cands["blocked"] = lambda a, b: torch.ops.rlengine.inv_linear(a, b, None, logits)
    if not logits and op_dispatch._chunked_ok(x, w):
        cands["chunked"] = op_dispatch._chunked_linear
    return cands


def linear_floor(model, B: int, reps: int = 5, clock: str = "perf_counter") -> tuple[float, dict]:
    """Seconds of one step's projections and LM head in the step's order, each shape by its fastest
    implementation (timed as a chain over the model's weights of that shape); and {shape: (fastest impl,
    ms per chain)}."""
    layers = model.model.layers
    weights = {"qkv": [l.self_attn.qkv_proj.weight for l in layers], "o": [l.self_attn.o_proj.weight for l in layers],
               "gate_up": [l.mlp.gate_up_proj.weight for l in layers], "down": [l.mlp.down_proj.weight for l in layers],
               "lm_head": [model.lm_head.weight]}
    best, chains = {}, {}
    with torch.inference_mode():
        for name, (N, K) in projection_shapes(model.config).items():
            ws = weights[name]
            x = torch.randn(B, K).to(model.dtype)
            times = {}
            for impl, fn in _linear_candidates(x, ws[0], name == "lm_head").items():
                runs = []
                for _ in range(reps + 1):
                    t0 = getattr(time, clock)()
                    for w in ws:
                        fn(x, w)
                    runs.append(getattr(time, clock)() - t0)
                times[impl] = statistics.median(runs[1:])  # the first run warms the implementation up
            impl = min(times, key=times.get)
            best[name] = (impl, 1e3 * times[impl])
            chains[name] = times
    return _stream_s(model, B, best, chains, reps, clock), best


def _stream_s(model, B: int, best: dict, chains: dict, reps: int, clock: str) -> float:
    """Seconds of every projection of a step in the step's order (layer by layer, then the LM head): the
    weights pass through the cache once per run, as in a step, where a chain over one shape's few layers
    (3-24 MB) may find them in the last-level cache, and a kernel that wins from cache can lose from
    memory. So each shape's implementation is chosen again here, in the stream: one pass over the shapes,
    each trying every candidate with the others at their current best (`best` is updated: the impl and its
    chain's ms)."""
    layers, shapes = model.model.layers, projection_shapes(model.config)
    owner = {"qkv": lambda l: l.self_attn.qkv_proj.weight, "o": lambda l: l.self_attn.o_proj.weight,
             "gate_up": lambda l: l.mlp.gate_up_proj.weight, "down": lambda l: l.mlp.down_proj.weight}
    xs, cands = {}, {}
    for name, (N, K) in shapes.items():
        if name in owner or name == "lm_head":
            xs[name] = torch.randn(B, K).to(model.dtype)
            cands[name] = _linear_candidates(xs[name], torch.empty(N, K, dtype=model.dtype), name == "lm_head")
    order = [(name, owner[name](l)) for l in layers for name in shapes if name in owner]
    order.append(("lm_head", model.lm_head.weight))
    chosen = {name: best[name][0] for name in cands}

    def run(choice) -> float:
        calls = [(cands[name][choice[name]], xs[name], w) for name, w in order]
        runs = []
        for _ in range(reps + 1):
            t0 = getattr(time, clock)()
            for fn, x, w in calls:
                fn(x, w)
            runs.append(getattr(time, clock)() - t0)
        return statistics.median(runs[1:])

    for name in cands:
        if len(cands[name]) > 1:
            times = {impl: run({**chosen, name: impl}) for impl in cands[name]}
            chosen[name] = min(times, key=times.get)
            best[name] = (chosen[name], 1e3 * chains[name][chosen[name]])
    return run(chosen)


def _trimmed_means(recs: list[dict]) -> dict:
    keep = sorted(recs, key=lambda r: r["step"])[: max(1, len(recs) - len(recs) // 5)]
    return {k: sum(r[k] for r in keep) / len(keep) for k in keep[0]}


def _rounds(model, B: int, args):
    """R alternating rounds of plain steps and the linear floor: (the engine of the last round, every
    round as {"step_s", "linear_s", "best"}, the round with the median step / linear)."""
    rounds = []
    for _ in range(args.rounds):
        llm = _decode_engine(model, B, args.context, args.steps, args.cpu_kernels)
        step_s = statistics.median(r["step"] for r in _steps(llm, args.steps, clock=CLOCKS[args.clock]))
        linear_s, best = linear_floor(model, B, clock=CLOCKS[args.clock])
        rounds.append({"step_s": step_s, "linear_s": linear_s, "best": best})
    ranked = sorted(rounds, key=lambda r: r["step_s"] / r["linear_s"])
    return llm, rounds, ranked[(len(ranked) - 1) // 2]


def measure(model, hf, B: int, args) -> dict:
    """One (dtype, B_act) point: plain steps and the linear floor (in rounds), instrumented steps,
    transformers."""
    llm, rounds, mid = _rounds(model, B, args)
    timers = Timers(CLOCKS[args.clock])
    with instrumented(llm, timers):
        parts = _trimmed_means(_steps(llm, args.steps, timers, CLOCKS[args.clock]))
    step_s, linear_s, best = mid["step_s"], mid["linear_s"], mid["best"]
    gen = torch.Generator().manual_seed(B)
    prompts = [torch.randint(3, model.config.vocab_size, (args.context,), generator=gen).tolist() for _ in range(B)]
    provider = HFProvider(hf, "eager")
    provider.step_times(prompts, 4)  # warm-up
    hf_s = statistics.median(provider.step_times(prompts, args.hf_gen_len)[0])
    row = {"dtype": str(model.dtype).removeprefix("torch."), "b_act": B, "step_ms": 1e3 * step_s, "hf_ms": 1e3 * hf_s,
           "ratio": hf_s / step_s, "linear_ms": 1e3 * linear_s, "step_over_linear": step_s / linear_s,
           "instrumented_ms": 1e3 * parts["step"]}
    row.update({f"{p}_ms": 1e3 * parts[p] for p in PARTS})
    row["host_ms"] = 1e3 * (parts["step"] - sum(parts[p] for p in PARTS))
    row["linear_best"] = {k: {"impl": v[0], "ms": v[1]} for k, v in best.items()}
    row["rounds"] = [{"step_ms": 1e3 * r["step_s"], "linear_ms": 1e3 * r["linear_s"],
                      "step_over_linear": r["step_s"] / r["linear_s"]} for r in rounds]
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30m", help="preset name (default: %(default)s)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: %(default)s)")
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated B_act (default: %(default)s)")
    p.add_argument("--context", type=int, default=32, help="prompt tokens per sequence (default: %(default)s)")
    p.add_argument("--steps", type=int, default=16,
                   help="timed steps, plain and instrumented each (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1,
                   help="alternating rounds of plain steps and the linear floor (default: %(default)s)")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="the engine's and the floor's timer: wall, or cpu (the process's CPU seconds: on a CPU"
                        " shared by more runnable processes than cores, what a step costs without the waits for"
                        " a core; transformers is wall time either way) (default: %(default)s)")
    p.add_argument("--hf-gen-len", type=int, default=16, help="tokens per transformers run (default: %(default)s)")
    p.add_argument("--cpu-kernels", default="cache",
                   help="the engine's kernel choice (LLM(cpu_kernels=...): measure, cache, torch, skinny, a table)"
                        " (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", default=None, help="folder for decode_profile.json (default bench/results)")
    p.add_argument("--name", default="decode_profile", help="JSON name without .json (default: %(default)s)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            model, hf = load_pair(args.model, dtype, torch.device("cpu"), tmp)
        for B in [int(b) for b in args.batches.split(",")]:
            rows.append(measure(model, hf, B, args))
            r = rows[-1]
            print(f"{r['dtype']} B_act {B}: step {r['step_ms']:.2f} ms, transformers {r['hf_ms']:.2f} ms "
                  f"(ratio {r['ratio']:.2f}x), linear floor {r['linear_ms']:.2f} ms "
                  f"(step / linear {r['step_over_linear']:.2f})", flush=True)
    report(args.name, rows, out=args.out, columns=COLUMNS, device="cpu",
           extra={"model": args.model, "cpu_kernels": args.cpu_kernels, "context": args.context,
                  "steps": args.steps, "rounds": args.rounds, "clock": args.clock, "threads": torch.get_num_threads(),
                  "goals": {"fp32_ratio_b1": 2.5, "fp32_ratio_b8_64": 1.5, "bf16_ratio": 1.5, "step_over_linear": 1.3}})
    return 0


if __name__ == "__main__":
    sys.exit(main())

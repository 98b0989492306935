"""`rlengine bench costs`: this device's step costs for one model shape and dtype, as a CostTable.

    rlengine bench costs --model tiny --dtype float32                  # measured here (CPU or GPU)
    rlengine bench costs --model qwen3-0.6b --dtype bfloat16 --device H200 --modelled   # Eq. 5 + launches

Measured, with random weights and tokens (a step's time does not depend on their values):
- decode: the engine's own decode steps (its StepRecord trace) at each B_act and context: B_act prompts
  of `context` tokens, `--steps` tokens each, the median over steps at full B_act; the table's context
  is the mean tokens attended over those steps;
- prefill: one prompt of each length, max_tokens = 1, the median prefill step over --reps;
- learner: forward + backward of the log-probs and entropy (the learner's head) over packed sequences of
  --seq-len tokens adding up to each token count, the median of --reps after one warm-up pass;
- optimizer: one AdamW step (with fp32 masters when the dtype is 16-bit, as the learner runs it).
On a GPU every timed region ends in a synchronize. The table (analysis/cost_table.py) is written to
OUT/costs-MODEL-DTYPE.json with its provenance; the device clock (`rlengine report --clock`) reads it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from rlengine.analysis.cost_table import CostTable
from rlengine.benchmarks.args import int_list
from rlengine.benchmarks.report import format_table
from rlengine.telemetry.provenance import provenance


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _prompts(vocab: int, count: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(count)]


def decode_costs(model, batches, contexts, steps: int) -> list[tuple[int, int, float]]:
    """(B_act, mean context, median decode step seconds) at each B_act x context."""
    from rlengine import LLM, SamplingParams

    out = []
    for b in batches:
        llm = LLM(model, max_num_seqs=b, max_model_len=max(contexts) + steps + 1, enforce_eager=True)
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=steps, ignore_eos=True)
        for c in contexts:
            prompts = _prompts(model.config.vocab_size, b, c, seed=b * 7919 + c)
            llm.generate(prompts, params)  # warm-up: kernel choices, first touch of the pool
            trace = llm.generate(prompts, params).trace
            full = [r.seconds for r in trace if r.kind == "decode" and r.b_act == b]
            out.append((b, c + steps // 2, statistics.median(full)))
    return out


def prefill_costs(model, lengths, reps: int) -> list[tuple[int, float]]:
    """(prompt tokens, median prefill step seconds) for one prompt of each length."""
    from rlengine import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=1, max_model_len=max(lengths) + 2, enforce_eager=True)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=1, ignore_eos=True)
    out = []
    for n in lengths:
        prompt = _prompts(model.config.vocab_size, 1, n, seed=n)
        llm.generate(prompt, params)
        times = [r.seconds for _ in range(reps) for r in llm.generate(prompt, params).trace if r.kind == "prefill"]
        out.append((n, statistics.median(times)))
    return out


def learner_costs(model, token_counts, seq_len: int, reps: int) -> list[tuple[int, float]]:
    """(packed tokens, median seconds of the learner's forward + backward) at each token count."""
    from rlengine.rl.learner.batching import TrainBatch
    from rlengine.rl.learner.logprobs import token_logprobs

    fused = model.device.type == "cuda"
    out = []
    for tokens in token_counts:
        length = min(seq_len, tokens)
        mb = TrainBatch.random_tokens(model.config.vocab_size, max(1, tokens // length), length, model.device)
        times = []
        for i in range(reps + 1):  # the first pass makes one-time allocations
            model.zero_grad(set_to_none=True)
            _sync(model.device)
            t0 = time.perf_counter()
            logp, ent = token_logprobs(model, mb, 1.0, fused)
            (logp.sum() + ent.sum()).backward()
            _sync(model.device)
            if i:
                times.append(time.perf_counter() - t0)
        out.append((mb.input_ids.numel(), statistics.median(times)))
    model.zero_grad(set_to_none=True)
    return out


def optimizer_cost(model, reps: int) -> float:
    """Median seconds of one optimizer step over the model's parameters (fp32 masters for 16-bit)."""
    from rlengine.rl.algo.optim import LearnerOptimizer, use_master_weights

    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    opt = LearnerOptimizer(params, lr=1e-9, betas=(0.9, 0.99), weight_decay=0.0,
                           masters=use_master_weights("auto", model.dtype))
    times = []
    for i in range(reps + 1):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.accumulate()
        _sync(model.device)
        t0 = time.perf_counter()
        opt.step()
        _sync(model.device)
        if i:
            times.append(time.perf_counter() - t0)
    with torch.no_grad():  # the weights as they were (the bench must not train the model it times)
        for p, s in zip(params, saved):
            p.copy_(s)
    model.zero_grad(set_to_none=True)
    return statistics.median(times)


def measure_cost_table(model_name: str, dtype: str, device: str, *, batches, contexts, steps: int, prefill,
                       learner_tokens, seq_len: int, reps: int) -> CostTable:
    """A measured CostTable of `model_name` (preset or checkpoint shape, random weights) on `device`."""
    from rlengine.model.factory import model_config
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    model = Qwen3ForCausalLM(model_config(model_name), seed=0, dtype=getattr(torch, dtype), device=device)
    with torch.no_grad():
        decode = decode_costs(model, batches, contexts, steps)
        pre = prefill_costs(model, prefill, reps)
    learner = learner_costs(model, learner_tokens, seq_len, reps)
    opt = optimizer_cost(model, reps)
    info = provenance(model.device, threads=torch.get_num_threads(), method=(
        f"engine decode steps ({steps} tokens, median at full B_act), prefill of one prompt, learner "
        f"forward+backward of log-probs and entropy over packed {seq_len}-token sequences, one AdamW step; "
        f"median of {reps} after a warm-up"))
    return CostTable(model=model_name, dtype=dtype, kind="measured", decode=tuple(decode), prefill=tuple(pre),
                     learner=tuple(learner), optimizer_s=opt, provenance=info)


def print_table(table: CostTable) -> None:
    print(f"{table.kind} step costs: {table.model} {table.dtype} on "
          f"{table.provenance.get('device_name') or table.provenance.get('cpu_model') or table.provenance.get('device')}")
    print(format_table([{"b_act": b, "context": c, "ms": s * 1e3, "tokens_per_s": b / s} for b, c, s in table.decode]))
    print(format_table([{"prefill_tokens": t, "ms": s * 1e3, "tokens_per_s": t / s} for t, s in table.prefill]))
    print(format_table([{"learner_tokens": t, "ms": s * 1e3, "tokens_per_s": t / s} for t, s in table.learner]))
    print(f"optimizer step: {table.optimizer_s * 1e3:.3f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench costs", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="preset or checkpoint directory (its shape; random weights)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="measured: cpu | cuda (default: cuda if present); "
                   "--modelled: the card, H100 | H200")
    p.add_argument("--modelled", action="store_true", help="build the table from Eq. 5 and a launch floor for "
                   "--device instead of measuring (labelled modelled wherever it is used)")
    p.add_argument("--batches", type=lambda t: int_list(t, "--batches"), default=[1, 4, 16, 64])
    p.add_argument("--contexts", type=lambda t: int_list(t, "--contexts"), default=[32, 128, 512])
    p.add_argument("--steps", type=int, default=8, help="decode steps per measured generate")
    p.add_argument("--prefill", type=lambda t: int_list(t, "--prefill"), default=[16, 64, 256, 1024])
    p.add_argument("--learner-tokens", type=lambda t: int_list(t, "--learner-tokens"), default=[256, 1024, 4096])
    p.add_argument("--seq-len", type=int, default=256, help="tokens per packed learner sequence")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="CPU: torch threads (0: torch's default)")
    p.add_argument("--out", default="bench/results", help="directory for costs-MODEL-DTYPE.json")
    args = p.parse_args(argv)
    if args.steps < 2 or args.reps < 1 or args.seq_len < 1:
        p.error("--steps must be >= 2, --reps and --seq-len >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.modelled:
        if args.device not in ("H100", "H200"):
            p.error("--modelled needs --device H100 or H200 (the card whose ceilings model the table)")
        from rlengine.analysis.modelled_costs import modelled_cost_table

        table = modelled_cost_table(args.model, args.dtype, args.device)
    else:
        from rlengine.plan.preflight import check_device, check_model

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        check_device(device, "--device")
        check_model(args.model, "--model")
        table = measure_cost_table(args.model, args.dtype, device, batches=args.batches, contexts=args.contexts,
                                   steps=args.steps, prefill=args.prefill, learner_tokens=args.learner_tokens,
                                   seq_len=args.seq_len, reps=args.reps)
    print_table(table)
    safe = str(args.model).replace("/", "_")
    path = table.save(Path(args.out) / f"costs-{safe}-{args.dtype}{'-' + args.device if args.modelled else ''}.json")
    print(f"wrote {path}")
    return 0

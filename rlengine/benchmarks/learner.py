"""Benchmark: rlengine's learner step against the same step on transformers, side by side in one process.

One micro-batch of --micro-batch sequences of --seq-len tokens (a GRPO group's worth: a --prompt-len
prompt, the rest response; the loss covers the response tokens), both models on the same weights,
dtype and threads. The step, as each side runs it:
  - rlengine: the learner's own path, token_logprobs (packed forward with cu_seqlens, the CPU
    learner's chunked log-prob head, learner/logprobs.py) -> the masked surrogate loss
    (masked_aggregate, token-mean) -> backward;
  - transformers (attn_implementation="sdpa"): forward on the [B, S] batch -> logits in fp32 ->
    log_softmax -> gather at the targets -> the same masked loss -> backward.
Gradients are dropped (set to None) before each step on both sides; no optimizer step (it is the same
for both). Rounds alternate between the providers (rlengine, then transformers) after one warm-up step
each; median of --rounds; ratio = transformers ms / rlengine ms (> 1: rlengine faster). Each call is
also timed on the calling thread's CPU clock (time.thread_time: with --threads 1 every op runs on it),
which leaves out the time the thread waits for a core: ratio_cpu, the figure to read on a loaded
machine (on an idle one the two agree). The loss of
the two sides is compared as a check that they run the same computation. --plain-head adds a third
provider, rlengine's packed forward with the transformers side's head (logits in the model's dtype under
autograd): the difference to the first is what the learner's log-prob head costs.
    rlengine bench learner --dtypes float32,bfloat16 --threads 1 --out docs/results/learner
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from rlengine.benchmarks.args import dtype_list
from rlengine.benchmarks.harness import report
from rlengine.benchmarks.hf_baseline import load_pair
from rlengine.model.config import ConfigError
from rlengine.rl.algo.losses import masked_aggregate
from rlengine.rl.learner.batching import TrainBatch, pack
from rlengine.rl.learner.logprobs import token_logprobs
from rlengine.telemetry.provenance import cpu_model

COLUMNS = ["model", "dtype", "micro_batch", "seq_len", "threads", "rlengine_ms", "hf_ms", "ratio", "ratio_cpu",
           "loss_diff"]


def _batch(vocab: int, B: int, seq_len: int, prompt_len: int, seed: int = 0) -> TrainBatch:
    """B packed sequences of seq_len input tokens: prompt_len prompt + the response (random ids, advantages)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(B)]
    n = seq_len + 1 - prompt_len  # pack() drops the last token of prompt + response from the inputs
    comps = [torch.randint(3, vocab, (n,), generator=g).tolist() for _ in range(B)]
    old = [(-torch.rand(n, generator=g) * 4).tolist() for _ in range(B)]
    adv = torch.randn(B, generator=g).tolist()
    return pack(prompts, comps, old, adv, [0.0] * B)


def _surrogate(logp_T, mb: TrainBatch) -> torch.Tensor:
    """The policy-gradient surrogate, token-mean over the loss mask: -A * exp(logp - old)."""
    return masked_aggregate(-mb.advantages * torch.exp(logp_T - mb.old_logprobs), mb.loss_mask)


def rlengine_step(model, mb: TrainBatch) -> float:
    """One learner step of `model` on `mb`; returns the loss."""
    model.zero_grad(set_to_none=True)
    logp, _ = token_logprobs(model, mb, 1.0, fused=model.device.type == "cuda")
    loss = _surrogate(logp, mb)
    loss.backward()
    return loss.item()


def plain_head_step(model, mb: TrainBatch) -> float:
    """rlengine's packed forward with the transformers side's head instead of the learner's (--plain-head):
    logits in the model's dtype, fp32 log_softmax, gather, all under autograd. Isolates the log-prob head."""
    model.zero_grad(set_to_none=True)

    def head(hidden_TC, w_VC):
        logits_TV = torch.nn.functional.linear(hidden_TC, w_VC).float()
        return logits_TV.log_softmax(-1).gather(-1, mb.targets[:, None])[:, 0]
    loss = _surrogate(model(mb.input_ids, cu_seqlens=mb.cu_seqlens, head=head), mb)
    loss.backward()
    return loss.item()


def hf_step(hf, mb: TrainBatch, B: int) -> float:
    """The same step on transformers: [B, S] forward, fp32 log_softmax, gather, masked loss, backward."""
    hf.zero_grad(set_to_none=True)
    logits = hf(mb.input_ids.view(B, -1)).logits.float()
    logp = logits.log_softmax(-1).gather(-1, mb.targets.view(B, -1, 1)).view(-1)
    loss = _surrogate(logp, mb)
    loss.backward()
    return loss.item()


def measure(model_name: str, dtype: torch.dtype, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf = load_pair(model_name, dtype, torch.device("cpu"), tmp)
    hf.config._attn_implementation = "sdpa"  # read per forward by transformers' attention layers (the default too)
    ours.train(), hf.train()
    mb = _batch(ours.config.vocab_size, args.micro_batch, args.seq_len, args.prompt_len)
    losses = (rlengine_step(ours, mb), hf_step(hf, mb, args.micro_batch))  # warm-up, and the agreement check
    providers = {"rlengine": lambda: rlengine_step(ours, mb), "hf": lambda: hf_step(hf, mb, args.micro_batch)}
    if args.plain_head:
        plain_head_step(ours, mb)  # its warm-up
        providers["plain_head"] = lambda: plain_head_step(ours, mb)
    times: dict[str, list[float]] = {name: [] for name in providers}
    cpu: dict[str, list[float]] = {name: [] for name in providers}
    for _ in range(args.rounds):
        for name, fn in providers.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.thread_time() - c0)
    ms = {k: 1e3 * statistics.median(v) for k, v in times.items()}
    cpu_ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
    plain = {"plain_head_ms": round(ms["plain_head"], 2), "plain_head_ratio": round(ms["hf"] / ms["plain_head"], 3),
             "plain_head_ratio_cpu": round(cpu_ms["hf"] / cpu_ms["plain_head"], 3)} if args.plain_head else {}
    return {"model": model_name, "dtype": str(dtype).removeprefix("torch."), "micro_batch": args.micro_batch,
            "seq_len": args.seq_len, "threads": torch.get_num_threads(), "rlengine_ms": round(ms["rlengine"], 2),
            "hf_ms": round(ms["hf"], 2), "ratio": round(ms["hf"] / ms["rlengine"], 3),
            "ratio_cpu": round(cpu_ms["hf"] / cpu_ms["rlengine"], 3),
            "cpu_ms": {k: round(v, 2) for k, v in cpu_ms.items()},
            "hf_attention": hf.config._attn_implementation, **plain,
            "loss_diff": abs(losses[0] - losses[1]), "rounds_ms": {k: [round(1e3 * t, 2) for t in v]
                                                                    for k, v in times.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30m", help="preset name or checkpoint folder (default: %(default)s)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: %(default)s)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step (default: %(default)s)")
    p.add_argument("--seq-len", type=int, default=256, help="input tokens per sequence (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per sequence (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per provider (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--plain-head", action="store_true",
                   help="also time rlengine's forward with transformers' head (bf16/fp32 logits -> fp32 log_softmax "
                        "-> gather) in place of the learner's log-prob head: what the head costs")
    p.add_argument("--out", default=None, help="folder of the JSON (default bench/results)")
    p.add_argument("--name", default="learner", help="JSON name without .json (default: %(default)s)")
    args = p.parse_args(argv)
    for flag, value, low in (("--micro-batch", args.micro_batch, 1), ("--rounds", args.rounds, 1),
                             ("--prompt-len", args.prompt_len, 1), ("--threads", args.threads or 1, 1)):
        if value < low:
            raise ConfigError(f"{flag} must be >= {low}, got {value}")
    if args.seq_len <= args.prompt_len:
        raise ConfigError(f"--seq-len must exceed --prompt-len ({args.prompt_len}), got {args.seq_len}")
    dtypes = dtype_list(args.dtypes)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for dtype in dtypes:
        rows.append(measure(args.model, dtype, args))
        r = rows[-1]
        print(f"{r['dtype']}: rlengine {r['rlengine_ms']:.1f} ms, transformers {r['hf_ms']:.1f} ms, "
              f"ratio {r['ratio']:.2f}x (thread CPU time {r['ratio_cpu']:.2f}x)"
              + (f"; plain head {r['plain_head_ms']:.1f} ms ({r['plain_head_ratio']:.2f}x, CPU time "
                 f"{r['plain_head_ratio_cpu']:.2f}x)" if args.plain_head else ""), flush=True)
    columns = COLUMNS + (["plain_head_ms", "plain_head_ratio", "plain_head_ratio_cpu"] if args.plain_head else [])
    report(args.name, rows, out=args.out, columns=columns, device="cpu",
           extra={"model": args.model, "cpu_model": cpu_model(), "threads": torch.get_num_threads(),
                  "prompt_len": args.prompt_len, "rounds": args.rounds,
                  "method": "alternating rounds (rlengine, transformers) after one warm-up each, median; step = "
                            "forward + log-prob + masked loss + backward, no optimizer; ratio = hf_ms / rlengine_ms "
                            "(wall clock), ratio_cpu = the same on the thread's CPU clock"})
    return 0

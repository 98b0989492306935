"""Benchmark: a prefill forward of rlengine against transformers (sdpa), side by side in one process.

For each dtype, prompt length S (--lengths) and sequence count B (--batches): B prompts of S tokens, on
the same weights, dtype and threads, as each side prefills them:
  - rlengine: the engine's prefill forward, the fused no-grad path (Qwen3ForCausalLM.hidden_states with
    fast=True over the packed tokens, the packed causal attention of model/attention.py with its
    measured kernel choices; as the engine runs a prefill, the last layer's o_proj and MLP only on each
    sequence's last token, the row it samples), then the fp32 logits of those rows (compute_logits);
  - transformers (attn_implementation="sdpa"): forward of the [B, S] batch with logits_to_keep=1 (what
    generate() runs for a prompt).
No KV-cache write on either side (the engine's store is a copy of K/V, not timed here). One warm-up call
each (it also makes rlengine's kernel choices for the shape), then --rounds alternating rounds, median;
ratio = transformers ms / rlengine ms (> 1: rlengine faster); ratio_cpu the same on the calling thread's CPU
clock (time.thread_time: with --threads 1 every op runs on it; it leaves out the time the thread waits for a
core, so it is the figure to read on a loaded machine). --layers N cuts the model to its first N
decoder layers (the qwen3-0.6b shape at full depth takes tens of seconds per 2048-token call on one core).
    rlengine bench prefill --model qwen3-30m --lengths 64,256,512,2048 --batches 1,4 --threads 1
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlengine.benchmarks.args import dtype_list
from rlengine.benchmarks.harness import report
from rlengine.model.config import ConfigError, preset
from rlengine.telemetry.provenance import cpu_model

COLUMNS = ["model", "layers", "dtype", "seq_len", "batch", "threads", "rlengine_ms", "hf_ms", "ratio", "ratio_cpu"]


def load_pair(name: str, dtype: torch.dtype, layers: int, workdir: str):
    """(rlengine model, transformers model with sdpa) on the same random weights (seed 0)."""
    from transformers import AutoModelForCausalLM

    from rlengine.model import Qwen3ForCausalLM, save_pretrained

    cfg = preset(name)
    if layers:
        cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    ours = Qwen3ForCausalLM(cfg, dtype=dtype)
    path = save_pretrained(ours, f"{workdir}/ckpt")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa").eval()
    return ours, hf


def prefill_calls(ours, hf, B: int, S: int, seed: int = 0):
    """(rlengine call, transformers call) prefilling the same B x S random prompts."""
    from rlengine.model.attention import PackedCausal

    cfg = ours.config
    ids_BS = torch.randint(3, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))
    cu = list(range(0, B * S + 1, S))
    positions = torch.arange(S).repeat(B)
    last = torch.tensor(cu[1:]) - 1

    @torch.inference_mode()
    def ours_call():
        hidden = ours.hidden_states(ids_BS.reshape(-1), positions, PackedCausal(cu, cfg.head_dim ** -0.5), fast=True,
                                    rows=last)
        return ours.compute_logits(hidden)

    @torch.inference_mode()
    def hf_call():
        return hf(ids_BS, logits_to_keep=1).logits

    return ours_call, hf_call


def alternate(calls: dict, rounds: int, cpu: dict[str, list[float]] | None = None) -> dict[str, list[float]]:
    """One warm-up call each, then `rounds` rounds calling each in turn: wall seconds per call (and the
    calling thread's CPU seconds appended to `cpu`, if given)."""
    for fn in calls.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            fn()
            times[name].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(name, []).append(time.thread_time() - c0)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30m", help="preset name (default: %(default)s)")
    p.add_argument("--layers", type=int, default=0, help="keep the first N decoder layers (0: all)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: %(default)s)")
    p.add_argument("--lengths", default="64,256,512,2048", help="prompt tokens S (default: %(default)s)")
    p.add_argument("--batches", default="1,4", help="prompts per prefill B (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per provider (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--out", default=None, help="folder of the JSON (default bench/results)")
    p.add_argument("--name", default="prefill", help="JSON name without .json (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        lengths = [int(x) for x in args.lengths.split(",")]
        batches = [int(x) for x in args.batches.split(",")]
    except ValueError:
        raise ConfigError(f"--lengths / --batches must be comma-separated integers, got {args.lengths!r} / "
                          f"{args.batches!r}") from None
    if min(lengths + batches) < 1 or args.rounds < 1 or args.layers < 0 or (args.threads or 1) < 1:
        raise ConfigError("--lengths, --batches, --rounds and --threads must be >= 1 and --layers >= 0")
    cfg = preset(args.model)
    if max(lengths) > cfg.max_position_embeddings:
        raise ConfigError(f"--lengths: {max(lengths)} exceeds {args.model}'s {cfg.max_position_embeddings} positions")
    if args.layers > cfg.num_hidden_layers:
        raise ConfigError(f"--layers {args.layers} exceeds {args.model}'s {cfg.num_hidden_layers} layers")
    dtypes = dtype_list(args.dtypes)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for dtype in dtypes:
        with tempfile.TemporaryDirectory() as tmp:
            ours, hf = load_pair(args.model, dtype, args.layers, tmp)
        for S in lengths:
            for B in batches:
                ours_call, hf_call = prefill_calls(ours, hf, B, S)
                cpu: dict[str, list[float]] = {}
                t = alternate({"rlengine": ours_call, "hf": hf_call}, args.rounds, cpu)
                ms = {k: 1e3 * statistics.median(v) for k, v in t.items()}
                cpu_ms = {k: 1e3 * statistics.median(v) for k, v in cpu.items()}
                rows.append({"model": args.model, "layers": ours.config.num_hidden_layers,
                             "dtype": str(dtype).removeprefix("torch."), "seq_len": S, "batch": B,
                             "threads": torch.get_num_threads(), "rlengine_ms": round(ms["rlengine"], 2),
                             "hf_ms": round(ms["hf"], 2), "ratio": round(ms["hf"] / ms["rlengine"], 3),
                             "ratio_cpu": round(cpu_ms["hf"] / cpu_ms["rlengine"], 3),
                             "cpu_ms": {k: round(v, 2) for k, v in cpu_ms.items()},
                             "rounds_ms": {k: [round(1e3 * x, 2) for x in v] for k, v in t.items()}})
                print(f"{rows[-1]['dtype']} S={S} B={B}: rlengine {ms['rlengine']:.1f} ms, transformers "
                      f"{ms['hf']:.1f} ms, ratio {rows[-1]['ratio']:.2f}x (thread CPU time "
                      f"{rows[-1]['ratio_cpu']:.2f}x)", flush=True)
                _write(args, rows, final=False)  # a long sweep stopped early still leaves its rows
    _write(args, rows, final=True)
    return 0


def _write(args, rows: list[dict], *, final: bool) -> None:
    from rlengine.model.ops import KERNELS
    from rlengine.telemetry.provenance import write_json

    extra = {"model": args.model, "cpu_model": cpu_model(), "threads": torch.get_num_threads(), "rounds": args.rounds,
             "kernel_choices": KERNELS.summary(), "complete": final,
             "method": "one warm-up each, alternating rounds (rlengine, transformers), median; "
                       "ratio = hf_ms / rlengine_ms (wall clock), ratio_cpu = the same on the thread's CPU clock"}
    if final:
        report(args.name, rows, out=args.out, columns=COLUMNS, device="cpu", extra=extra)
    else:
        out = Path(args.out) if args.out else Path("bench") / "results"
        write_json(out / f"{args.name}.json", {"name": args.name, "rows": rows, **extra}, device="cpu")

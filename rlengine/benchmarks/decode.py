"""`rlengine bench decode`: decode throughput and step time per active batch, next to transformers.

For each B_act in --batches, B_act prompts of --prompt-len random tokens are generated greedily
for --gen-len tokens (EOS ignored), by rlengine's LLM and by transformers' generate() on the SAME
weights (our model saved with save_pretrained and loaded with AutoModelForCausalLM). Method:
  - rlengine: mean of the decode StepRecords of llm.generate(...).trace. A step record covers
    the whole engine step: schedule, copy-on-write, forward, sampling (with its host read of the
    tokens) and postprocess. All B_act sequences run every decode step (equal lengths).
  - transformers: (t(gen-len new tokens) - t(1 new token)) / (gen-len - 1). Both calls run the
    same prefill and setup, so the difference is gen-len - 1 decode steps, each with generate()'s
    own per-step work (cache update, logits processors, stopping criteria).
  - The two run alternately per B_act and per repetition (the median of --reps is reported), so
    machine noise hits both alike: compare the ratio column, measured within one run.
  - CUDA graphs: on a GPU rlengine replays a captured decode step per batch bucket (captured in
    the warm-up); --enforce-eager turns them off, --compare-eager times an eager twin on the same
    weights in the same run (columns eager_ms_per_step, graph_speedup).
  - Roofline (PAPER.md Eq. 5): ceilings measured once here (copy bandwidth, matmul FLOP/s for the
    dtype; or read with --ceilings), bound at the mean context length prompt + gen/2;
    fraction = measured / bound.
Rows go to {--out}/{--name}.json with keys b_act, tokens_per_s, ms_per_step, hf_tokens_per_s,
hf_ms_per_step, ratio, roofline_tokens_per_s, roofline_fraction (tools/plots.py decode reads them).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from rlengine.analysis.ceilings import measure_ceilings
from rlengine.analysis.roofline import decode_roofline
from rlengine.config import preset
from rlengine.engine.kv_cache import bytes_per_block
from rlengine.engine.llm import DTYPES, LLM
from rlengine.engine.sampling_params import SamplingParams

COLUMNS = ["b_act", "tokens_per_s", "ms_per_step", "hf_tokens_per_s", "hf_ms_per_step", "ratio",
           "roofline_tokens_per_s", "roofline_fraction"]
EAGER_COLUMNS = ["eager_ms_per_step", "graph_speedup"]


def _load(model: str, dtype: torch.dtype, device: torch.device, workdir: str):
    """(our model, transformers model) with the same weights; a preset gets random weights (seed 0)."""
    from transformers import AutoModelForCausalLM

    from rlengine.model import Qwen3ForCausalLM, load_pretrained, save_pretrained

    moe_impl = "triton" if device.type == "cuda" else "ref"  # sync-free experts: capturable in CUDA graphs
    if Path(model).is_dir():
        ours, path = load_pretrained(model, dtype=dtype, device=device, moe_impl=moe_impl), model
    else:
        ours = Qwen3ForCausalLM(preset(model), dtype=dtype, device=device, moe_impl=moe_impl)
        path = save_pretrained(ours, Path(workdir) / "ckpt")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    return ours, hf


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rlengine_step_s(llm: LLM, prompts: list[list[int]], gen_len: int) -> tuple[float, list[int]]:
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True))
    steps = [r.seconds for r in outs.trace if r.kind == "decode"]
    assert all(r.b_act == len(prompts) for r in outs.trace if r.kind == "decode"), "B_act varied within a run"
    return sum(steps) / len(steps), outs[0].outputs[0].token_ids


@torch.inference_mode()
def _hf_step_s(hf, prompts: list[list[int]], gen_len: int) -> tuple[float, list[int]]:
    ids = torch.tensor(prompts, device=hf.device)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
    _sync(ids.device)
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
    _sync(ids.device)
    t1 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=gen_len, min_new_tokens=gen_len, **kw)
    _sync(ids.device)
    t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (gen_len - 1), out[0, len(prompts[0]):].tolist()


def _conditions(args, cfg, ceilings) -> dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=False).stdout.strip() or None
    except OSError:
        commit = None
    import transformers

    device = torch.device(args.device)
    return {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "cpu": platform.processor() or platform.machine(),
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), "commit": commit,
            "model": args.model, "dtype": args.dtype, "backend": args.backend, "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "reps": args.reps,
            "shapes": {k: getattr(cfg, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                       "num_hidden_layers", "num_attention_heads",
                                                       "num_key_value_heads", "head_dim", "num_experts")},
            "ceilings": ceilings}


def _table(rows: list[dict]) -> str:
    columns = COLUMNS + (EAGER_COLUMNS if any("eager_ms_per_step" in r for r in rows) else [])
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else ("-" if v is None else str(v))  # noqa: E731
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    line = lambda vals: "  ".join(v.rjust(w) for v, w in zip(vals, widths))  # noqa: E731
    return "\n".join([line(columns), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _engine(args, ours, device: torch.device, enforce_eager: bool, share: float = 0.6) -> tuple[LLM, list[int]]:
    """An LLM on `ours`, its KV cache sized for the largest B_act (capped by `share` of free GPU memory),
    and the B_act that fit."""
    batches = [b for b in args.batches if b <= args.max_batch]
    if not batches:
        raise SystemExit(f"no B_act in --batches {args.batches} is <= --max-batch {args.max_batch}")
    max_len = args.prompt_len + args.gen_len + 1
    blocks = max(batches) * -(-max_len // 16)
    if device.type == "cuda":  # a share of what the weights leave: the rest for transformers' cache
        free, _ = torch.cuda.mem_get_info(device)
        blocks = min(blocks, int(share * free) // bytes_per_block(ours.config, 16, ours.dtype))
    llm = LLM(ours, max_num_seqs=max(batches), max_model_len=max_len, attention_backend=args.backend,
              num_kv_blocks=blocks, block_size=16, enforce_eager=enforce_eager)
    fits = blocks // llm.block_manager.blocks_for(max_len)
    if any(b > fits for b in batches):
        print(f"KV cache holds {fits} sequences at full length: dropping B_act > {fits}")
    return llm, [b for b in batches if b <= fits]


def _measure(args, llm: LLM, hf, prompts: list[list[int]], eager: LLM | None = None):
    """Per-step seconds of each repetition for rlengine, transformers and the eager twin (if any),
    and whether rlengine's tokens agree with transformers'."""
    # warm-up: allocator, oneDNN primitives, Triton JIT, the bucket's CUDA graph capture
    _rlengine_step_s(llm, prompts, min(args.gen_len, 8))
    if eager is not None:
        _rlengine_step_s(eager, prompts, min(args.gen_len, 8))
    if not args.no_hf:
        _hf_step_s(hf, prompts, min(args.gen_len, 8))
    ours_s, hf_s, eager_s, same = [], [], [], None
    for _ in range(args.reps):  # alternate, so drift in machine load hits every provider
        step, ours_tokens = _rlengine_step_s(llm, prompts, args.gen_len)
        ours_s.append(step)
        if eager is not None:
            eager_s.append(_rlengine_step_s(eager, prompts, args.gen_len)[0])
        if not args.no_hf:
            step, hf_tokens = _hf_step_s(hf, prompts, args.gen_len)
            hf_s.append(step)
            same = ours_tokens == hf_tokens
    return ours_s, hf_s, eager_s, same


def run(args) -> tuple[list[dict], dict]:
    """The sweep: table rows and the conditions they were measured under."""
    dtype, device = DTYPES[args.dtype], torch.device(args.device)
    if args.ceilings:  # a ceilings.json from `rlengine bench ceilings` on this machine
        ceilings = json.loads(Path(args.ceilings).read_text())["ceilings"]
    else:
        ceilings = measure_ceilings(device)
    with tempfile.TemporaryDirectory() as tmp:
        ours, hf = _load(args.model, dtype, device, tmp)
    cfg = ours.config
    compare = args.compare_eager and not args.enforce_eager
    llm, batches = _engine(args, ours, device, args.enforce_eager, share=0.3 if compare else 0.6)
    eager = _engine(args, ours, device, True, share=0.3)[0] if compare else None
    print(f"CUDA graphs: {'on' if llm.cuda_graphs_off is None else 'off (' + llm.cuda_graphs_off + ')'}")
    elem = torch.empty((), dtype=dtype).element_size()
    flops = ceilings["flops_per_s"].get(args.dtype) or max(ceilings["flops_per_s"].values())
    gen = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        prompts = torch.randint(3, cfg.vocab_size, (b, args.prompt_len), generator=gen).tolist()
        ours_s, hf_s, eager_s, same = _measure(args, llm, hf, prompts, eager)
        t = statistics.median(ours_s)
        roof = decode_roofline(cfg, b_act=b, context_len=args.prompt_len + args.gen_len // 2,
                               bandwidth=ceilings["bandwidth_bytes_per_s"], flops=flops, weight_bytes=elem,
                               kv_bytes=elem)
        row = {"b_act": b, "tokens_per_s": b / t, "ms_per_step": 1e3 * t, "hf_tokens_per_s": None,
               "hf_ms_per_step": None, "ratio": None, "roofline_tokens_per_s": roof.tokens_per_s,
               "roofline_fraction": b / t / roof.tokens_per_s, "same_tokens_as_hf": same,
               "ms_per_step_reps": [1e3 * x for x in ours_s], "hf_ms_per_step_reps": [1e3 * x for x in hf_s]}
        if hf_s:
            th = statistics.median(hf_s)
            row.update(hf_tokens_per_s=b / th, hf_ms_per_step=1e3 * th, ratio=th / t)
        if eager_s:
            te = statistics.median(eager_s)
            row.update(eager_ms_per_step=1e3 * te, graph_speedup=te / t)
        rows.append(row)
        print(_table(rows).splitlines()[-1] if len(rows) > 1 else _table(rows), flush=True)
    conditions = _conditions(args, cfg, ceilings)
    conditions["cuda_graphs"] = "on" if llm.cuda_graphs_off is None else f"off: {llm.cuda_graphs_off}"
    return rows, conditions


def _batches(text: str) -> list[int]:
    values = sorted({int(v) for v in text.split(",") if v.strip()})
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"--batches must be positive integers, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlengine bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-30m", help="preset name or HF checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto", help="attention backend (auto, cpp, torch, ...)")
    p.add_argument("--batches", type=_batches, default=[2**i for i in range(9)], help="comma-separated B_act")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="CPU: torch.set_num_threads for both providers")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers side")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for rlengine's decode steps")
    p.add_argument("--compare-eager", action="store_true",
                   help="GPU: also time an eager (no CUDA graph) rlengine engine, side by side")
    p.add_argument("--ceilings", default=None, help="reuse a ceilings.json (rlengine bench ceilings) instead of "
                                                     "measuring")
    p.add_argument("--out", default="bench/results", help="directory for the JSON")
    p.add_argument("--name", default="decode", help="JSON file name (without .json)")
    args = p.parse_args(argv)
    if args.gen_len < 2 or args.prompt_len < 1:
        p.error("--gen-len must be >= 2 and --prompt-len >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, conditions = run(args)
    print()
    print(_table(rows))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{args.name}.json"
    path.write_text(json.dumps({"name": "decode", "conditions": conditions, "rows": rows}, indent=2, default=str))
    print(f"wrote {path}")
    return 0

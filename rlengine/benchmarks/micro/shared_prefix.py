"""Benchmark: decode step time with and without shared-prefix (cascade) decode, side by side in one run.

Three engine shapes, each generated with LLM(shared_prefix_decode=False) ("plain") and =True
("cascade") on the cpp backend in --dtype (fp32 by default), alternating the two engines over
--rounds rounds so a burst of load on the shared CPU hits both alike:
  - grpo-512: G = 16 samples of 4 prompts of 512 tokens, 64-token responses (B_act 64), on --model;
  - default-job: the embedded default job's shape (rlengine/configs/grpo.toml: the tiny preset,
    group_size 16, prompts_per_step 8, max_tokens 4, first-digit prompts);
  - no-sharing: G = 1, 64 distinct 512-token prompts: cascade finds nothing to share, so the rows
    show what the check costs (it must be nothing).
A step's time is the engine's own StepRecord (schedule to read), median over the decode steps at the
full B_act of every round; `attn_ms` is the attention op alone at that shape (the same page tables
through paged_decode and cascade_decode, median over --iters calls), which says how much of the
step attention is. Speedup = plain / cascade. A third engine runs the default (shared_prefix_decode=None:
cascade only on steps whose plan saves at least AUTO_SHARED_FRACTION of the page reads): auto_ms and
auto_speedup = plain / auto, auto_cascade_steps the steps it ran as cascade.

    python bench/bench_shared_prefix.py [--model qwen3-30m] [--dtype bfloat16] [--rounds 3] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from rlengine import LLM, SamplingParams
from rlengine.benchmarks.harness import report
from rlengine.engine.attention.cascade import plan_cascade

P = 16
COLUMNS = ["case", "model", "G", "B_act", "prompt", "response", "plain_ms", "cascade_ms", "speedup",
           "attn_plain_ms", "attn_cascade_ms", "attn_speedup", "cascade_steps", "auto_ms", "auto_speedup",
           "auto_cascade_steps"]


def _cases(model: str, prompt_len: int = 512, response: int = 64) -> list[dict]:
    from rlengine.model.factory import tokenizer_for
    from rlengine.rl.data.tasks import build_task

    tok = tokenizer_for("tiny")
    digits = [tok.encode(p.prompt) for p in build_task("first-digit").train[:8]]
    gen = torch.Generator().manual_seed(0)
    long = lambda n, k: [torch.randint(3, 250, (n,), generator=gen).tolist() for _ in range(k)]  # noqa: E731
    return [dict(case=f"grpo-{prompt_len}", model=model, G=16, prompts=long(prompt_len, 4), response=response),
            dict(case="default-job", model="tiny", G=16, prompts=digits, response=4),
            dict(case="no-sharing", model=model, G=1, prompts=long(prompt_len, 64), response=response)]


def _engine(case: dict, shared: bool | None, dtype: str, backend: str, device: str) -> LLM:
    B = case["G"] * len(case["prompts"])
    longest = max(map(len, case["prompts"])) + case["response"] + 1
    # eager steps on both sides: CUDA-graph replays run plain decode (README, shared-prefix decode)
    return LLM(case["model"], dtype=dtype, attention_backend=backend, device=device, block_size=P, max_num_seqs=B,
               max_model_len=max(longest, 64), num_kv_blocks=B * -(-longest // P) + 8,
               shared_prefix_decode=shared, seed=0, enforce_eager=True)


def _round(llm: LLM, case: dict) -> list[float]:
    """One generate of the case; the seconds of each decode step at the full B_act."""
    B = case["G"] * len(case["prompts"])
    params = SamplingParams(n=case["G"], temperature=1.0, seed=1, max_tokens=case["response"], ignore_eos=True)
    outs = llm.generate(case["prompts"], params)
    return [r.seconds for r in outs.trace if r.kind == "decode" and r.b_act == B]


def _attention_ms(llm: LLM, case: dict, iters: int, dtype: str, backend: str, device: str) -> tuple[float, float]:
    """(paged_decode, cascade_decode) median ms of one layer at the case's mid-response page tables."""
    cfg, G = llm.config, case["G"]
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = [len(p) + case["response"] // 2 for p in case["prompts"] for _ in range(G)]
    B = len(ctx)
    indptr, indices, nxt = [0], [], 0
    for i, n in enumerate(ctx):
        if i % G == 0:  # a group's leader: fresh pages; members list its whole prompt pages, then their own
            shared, nxt = list(range(nxt, nxt + len(case["prompts"][i // G]) // P)), nxt + len(case["prompts"][i // G]) // P
        own = -(-n // P) - len(shared)
        indices += shared + list(range(nxt, nxt + own))
        nxt += own
        indptr.append(len(indices))
    dt = getattr(torch, dtype)
    k = torch.randn(nxt, P, Hkv, D).to(device, dt)
    v = torch.randn(nxt, P, Hkv, D).to(device, dt)
    q = torch.randn(B, H, D).to(device, dt)
    i32 = lambda x: torch.as_tensor(np.asarray(x, dtype=np.int32)).to(device)  # noqa: E731
    ptr_t, idx_t = i32(indptr), i32(indices)
    last = i32([n - (-(-n // P) - 1) * P for n in ctx])
    out = torch.empty_like(q)
    plan = plan_cascade(np.array(indptr), np.array(indices, dtype=np.int32))
    tables = None if plan is None else [i32(a) for a in (plan.chunk_indptr, plan.prefix_indptr, plan.prefix_indices,
                                                          plan.suffix_indptr, plan.suffix_indices)]
    if backend == "cpp":
        plain = lambda: torch.ops.rlengine.paged_decode(q, k, v, ptr_t, idx_t, last, D**-0.5, out)  # noqa: E731
        po, pl = torch.empty(B * H * D), torch.empty(B * H)
        cascade = lambda: torch.ops.rlengine.cascade_decode(q, k, v, *tables, last, D**-0.5, po, pl, out)  # noqa: E731
    else:
        from rlengine.kernels import cascade_decode as casc
        from rlengine.kernels import paged_decode as pd
        pages = max(b - a for a, b in zip(indptr, indptr[1:]))
        ws = pd.alloc_workspace(B, H, D, pd.MAX_SPLITS, device)
        plain = lambda: pd.paged_decode(q, k, v, ptr_t, idx_t, last, sm_scale=D**-0.5,  # noqa: E731
                                        max_num_pages=pages, out=out, workspace=ws)
        if plan is not None:
            cws = casc.alloc_cascade_workspace(B, H, D, device)
            own = int(np.diff(plan.suffix_indptr).max())
            cascade = lambda: casc.cascade_decode(q, k, v, *tables, last, sm_scale=D**-0.5,  # noqa: E731
                                                  max_rows=plan.max_rows, max_suffix_pages=own, workspace=cws,
                                                  out=out)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    return _median_ms(plain, iters, sync), _median_ms(plain if plan is None else cascade, iters, sync)


def _median_ms(fn, iters: int, sync) -> float:
    fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def measure(case: dict, rounds: int, iters: int, dtype: str = "float32", backend: str = "cpp",
            device: str = "cpu") -> dict:
    modes = (False, True, None)  # plain, cascade wherever a page is shared, the default (auto)
    engines = {mode: _engine(case, mode, dtype, backend, device) for mode in modes}
    for mode, llm in engines.items():
        _round(llm, case)  # warm-up: kernel choices, first-touch of the KV pool
    steps = {m: [] for m in modes}
    for _ in range(rounds):
        for mode, llm in engines.items():
            steps[mode] += _round(llm, case)
    plain, cascade, auto = (1e3 * statistics.median(steps[m]) for m in modes)
    attn_plain, attn_cascade = _attention_ms(engines[True], case, iters, dtype, backend, device)
    return dict(case=case["case"], model=case["model"], G=case["G"], B_act=case["G"] * len(case["prompts"]),
                prompt=max(map(len, case["prompts"])), response=case["response"], plain_ms=round(plain, 3),
                cascade_ms=round(cascade, 3), speedup=round(plain / cascade, 3), attn_plain_ms=round(attn_plain, 3),
                attn_cascade_ms=round(attn_cascade, 3), attn_speedup=round(attn_plain / attn_cascade, 3),
                cascade_steps=engines[True].backend.num_cascade_steps, auto_ms=round(auto, 3),
                auto_speedup=round(plain / auto, 3), auto_cascade_steps=engines[None].backend.num_cascade_steps)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen3-30m", help="preset of the grpo-512 and no-sharing cases")
    parser.add_argument("--cases", default="grpo-512,default-job,no-sharing", help="comma-separated subset")
    parser.add_argument("--rounds", type=int, default=3, help="generate rounds per engine (alternating)")
    parser.add_argument("--iters", type=int, default=20, help="timed calls of the attention op alone")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="weights, activations and KV cache (default: %(default)s)")
    parser.add_argument("--backend", default="cpp", choices=["cpp", "triton"],
                        help="attention backend; triton runs on CUDA when there is a GPU (default: %(default)s)")
    parser.add_argument("--prompt-len", type=int, default=512, help="tokens per prompt of the grpo and "
                        "no-sharing cases (default: %(default)s)")
    parser.add_argument("--response-len", type=int, default=64, help="tokens per response (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="directory for shared_prefix.json (default bench/results)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if args.backend == "triton" and torch.cuda.is_available() else "cpu"
    kinds = {w.split("-")[0] for w in args.cases.split(",")}  # grpo-512 names the grpo case at any --prompt-len
    rows = [measure(c, args.rounds, args.iters, args.dtype, args.backend, device)
            for c in _cases(args.model, args.prompt_len, args.response_len) if c["case"].split("-")[0] in kinds]
    report("shared_prefix", rows, out=args.out, columns=COLUMNS,
           extra={"threads": torch.get_num_threads(), "rounds": args.rounds, "page_size": P, "dtype": args.dtype,
                  "backend": args.backend},
           device=device)

"""The decode step on a GPU, profiled: what tools/gpu_check.sh's `profile` step runs, one part per command.

    python -m rlengine.benchmarks.decode_gpu_profile kernels --out DIR   per-kernel table at B_act 1 and 64
        (name, launches per step, us per step) from torch.profiler over graph-replayed decode steps; GPU
        busy time (the union of kernel intervals) against the steps' wall time; whether the kernels of a
        graph replay appear in the trace at all (CUPTI reports them on recent drivers).
    python -m rlengine.benchmarks.decode_gpu_profile events --out DIR    CUDA-event times of the graph replay,
        the LM head, the sampler and the whole engine step, async scheduling on and off.
    python -m rlengine.benchmarks.decode_gpu_profile paged --out DIR     paged decode at B 1 and a 32K context
        over split counts and BLOCK_N: ms and GB/s of K/V read.
Each writes DIR/profile_<part>.json (rows + conditions). The model is Qwen3-0.6B's shape in bf16 with random
weights (launch counts and times do not depend on the values), context 32, max_model_len 40,960.
Written without a device in the session that wrote it: the first GPU run is its test.
Dimension legend: B sequences, C hidden, V vocab.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

BATCHES = (1, 64)
CONTEXT = 32
MAX_MODEL_LEN = 40960


def _llm(batch: int, *, async_scheduling: bool = True, layers: int | None = None):
    from rlengine import LLM, SamplingParams
    from rlengine.model.config import preset
    from rlengine.model.qwen3 import Qwen3ForCausalLM

    cfg = preset("qwen3-0.6b")
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    pages = batch * (-(-(CONTEXT + 200) // 16)) + 8
    llm = LLM(model, max_num_seqs=batch, max_model_len=MAX_MODEL_LEN, num_kv_blocks=pages, block_size=16,
              async_scheduling=async_scheduling)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0.0, max_tokens=190, ignore_eos=True)
    for _ in range(batch):
        llm.add_request(torch.randint(3, cfg.vocab_size, (CONTEXT,), generator=gen).tolist(), params)
    for _ in range(6):  # prefill, bucket capture, warm-up
        llm.step()
    torch.cuda.synchronize()
    return llm


def _kernel_rows(prof, steps: int) -> tuple[list[dict], float, list[tuple[float, float]]]:
    """Per kernel name: launches and us per step; the kernels' [start, end] intervals (us)."""
    table, spans = {}, []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        n, us = table.get(ev.name, (0, 0.0))
        table[ev.name] = (n + 1, us + ev.device_time)
        spans.append((ev.time_range.start, ev.time_range.end))
    rows = sorted(({"name": k[:90], "count": n / steps, "us": us / steps} for k, (n, us) in table.items()),
                  key=lambda r: -r["us"])
    return rows, sum(r["us"] for r in rows), spans


def _busy(spans: list[tuple[float, float]]) -> float:
    """Length of the union of the intervals (us): the time the GPU ran at least one kernel."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def part_kernels(steps: int = 5) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for b in BATCHES:
        llm = _llm(b)
        replays = llm.runner.graphs.num_replays if llm.runner.graphs else 0
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                llm.step()
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - t0) * 1e6 / steps
        kernels, kernel_us, spans = _kernel_rows(prof, steps)
        replayed = (llm.runner.graphs.num_replays - replays) if llm.runner.graphs else 0
        launches = sum(r["count"] for r in kernels)
        rows.append({"b_act": b, "kernels": kernels, "launches_per_step": launches, "kernel_us_per_step": kernel_us,
                     "busy_us_per_step": _busy(spans) / steps, "wall_us_per_step": wall_us,
                     "graph_replays": replayed, "graph_kernels_in_trace": launches > 3 and replayed > 0,
                     "cuda_graphs_off": llm.cuda_graphs_off})
    return rows


def _event_ms(fn, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def part_events() -> list[dict]:
    from rlengine.engine.sampler import make_sampling_batch
    from rlengine.engine.sampling_params import SamplingParams

    rows = []
    for b in BATCHES:
        for overlap in (True, False):
            llm = _llm(b, async_scheduling=overlap)
            graphs = llm.runner.graphs
            row = {"b_act": b, "async_scheduling": overlap, "step_ms": _event_ms(llm.step)}
            if graphs is not None and graphs.graphs.get(b):
                bucket = graphs.graphs[b]
                key, graph = next(iter(bucket.items()))
                row.update(graph_replay_ms=_event_ms(graph.replay), graph_key=str(key))
            hidden = torch.randn(b, llm.config.hidden_size, device="cuda", dtype=torch.bfloat16)
            row["head_ms"] = _event_ms(lambda: llm.model.compute_logits(hidden))
            logits = llm.model.compute_logits(hidden)
            for name, p in (("greedy", SamplingParams(temperature=0.0)),
                            ("top_p", SamplingParams(temperature=0.8, top_p=0.9))):
                sb = make_sampling_batch([p] * b, device="cuda", vocab_size=llm.config.vocab_size)
                row[f"sampler_{name}_ms"] = _event_ms(lambda: llm.runner.sampler(logits, sb))
            rows.append(row)
    return rows


def part_paged(ctx: int = 32768, splits=(1, 2, 4, 8, 16, 33, 64), block_ns=(16, 32, 64)) -> list[dict]:
    from rlengine.kernels import paged_decode as pd

    H, Hkv, D, P = 16, 8, 128, 16
    pages = ctx // P
    k = torch.randn(pages + 1, P, Hkv, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(1, H, D, device="cuda", dtype=torch.bfloat16)
    indptr = torch.tensor([0, pages], dtype=torch.int32, device="cuda")
    indices = torch.randperm(pages, device="cuda").to(torch.int32)
    last = torch.tensor([P], dtype=torch.int32, device="cuda")
    ws = pd.alloc_workspace(1, H, D, pd.MAX_SPLITS, "cuda")
    out = torch.empty_like(q)
    kv_bytes = 2 * ctx * Hkv * D * 2
    rows, default = [], pd._BLOCK_N
    try:
        for bn in block_ns:
            pd._BLOCK_N = bn
            for s in splits:
                ms = _event_ms(lambda: pd.paged_decode(q, k, v, indptr, indices, last, sm_scale=D ** -0.5,
                                                       max_num_pages=pages, out=out, workspace=ws, num_splits=s))
                rows.append({"B": 1, "ctx": ctx, "splits": s, "BLOCK_N": bn, "ms": ms, "GB/s": kv_bytes / ms / 1e6})
    finally:
        pd._BLOCK_N = default
    return rows


PARTS = {"kernels": part_kernels, "events": part_events, "paged": part_paged}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("part", choices=sorted(PARTS))
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_gpu_profile: needs a CUDA device")
        return 2
    rows = PARTS[args.part]()
    cond = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "context": CONTEXT,
            "max_model_len": MAX_MODEL_LEN, "model": "qwen3-0.6b shape, bf16, random weights"}
    path = Path(args.out) / f"profile_{args.part}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": f"profile_{args.part}", "rows": rows, "conditions": cond}, indent=1,
                               default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

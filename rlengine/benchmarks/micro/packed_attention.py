"""Benchmark: packed causal attention (prefill and the learner) as one padded SDPA vs a per-sequence loop.

Providers: "loop" = one SDPA call per sequence; "padded" = one causal SDPA over the right-padded
batch (rlengine.model.attention.PackedCausal with layout="loop" / "padded"; its default "auto"
pads when gradients flow or on a GPU); "tiled" = csrc/prefill_attention.cpp over the packed rows
(CPU, forward only, AVX-512 builds; the engine's prefill takes it where its kernel choice measured it
faster). tiled_speedup = loop ms / tiled ms.
Per layer, forward and forward+backward, for batches of B sequences of ragged length (uniform in
[L/2, 3L/2]; B=1: exactly L), GQA 8:4, D 64 (qwen3-30m's attention; --heads 16,8,128 is qwen3-0.6b's),
fp32 on CPU / bf16 on GPU (--dtype). Also one full
GRPO learner step (forward + backward + AdamW over 8 layers) on the qwen3-30m preset with each
(there the layout is switched through PackedCausal.MAX_PAD_FACTOR: 0 disables padding).
Attention is compute-bound: each provider's TFLOP/s counts the useful causal FLOPs only
(4 * n^2 / 2 * H * D per sequence forward, 2.5x that with the backward), and its fraction of
the measured matmul ceiling with --ceilings. The sweep is declarative:
    python bench/bench_packed_attention.py --grid "B=8,32 L=64,256 mode=fwd,fwd+bwd" --plot pa.png
    rlengine bench packed_attention --grid "B=1 L=64,256,512,2048 mode=fwd" --heads 16,8,128 --threads 1 --learner ""
    ncu --profile-from-start off python bench/bench_packed_attention.py --shape "B=32 L=256 mode=fwd" --ncu
"""

from __future__ import annotations

import argparse

import torch

from rlengine.model.config import ConfigError, preset
from rlengine.model.attention import TILED, PackedCausal
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import grpo_batch
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.learner import Learner
from rlengine.rl.rollout_group import RolloutGroup

from rlengine.benchmarks.harness import (add_sweep_args, load_ceilings, measure, one_launch, rates, report,
                                         selected_providers, sweep_cases)

PROVIDERS = ["loop", "padded", "tiled"]  # "loop" is the reference


def _lens(B: int, L: int, seed: int) -> list[int]:
    if B == 1:
        return [L]
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(L // 2, 3 * L // 2 + 1, (B,), generator=gen).tolist()


def _causal_flops(lens: list[int], H: int, D: int, backward: bool) -> float:
    fwd = sum(4 * n * n / 2 * H * D for n in lens)  # QK^T and PV over the causal half
    return fwd * (3.5 if backward else 1.0)          # backward: about 2.5x the forward


def _attention_case(B, L, dtype, device, backward, layout, iters, ncu=False, heads=(8, 4, 64)):
    lens = _lens(B, L, seed=B * 1000 + L)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T, (H, Hkv, D) = cu[-1], heads
    q, k, v = (torch.randn(T, h, D, device=device, dtype=dtype, requires_grad=backward) for h in (H, Hkv, Hkv))
    if layout == "tiled":
        cu_t = torch.tensor(cu, dtype=torch.int64)

        def run():
            with torch.inference_mode():
                torch.ops.rlengine.prefill_attention(q, k, v, cu_t, D ** -0.5)
    else:
        ctx = PackedCausal(cu, D ** -0.5, layout=layout)

        def run():
            out = ctx.attend(0, q, k, v)
            if backward:
                out.sum().backward()
    if ncu:
        return one_launch(run, label=f"{layout} B={B} L={L}", device=device), T, 0.0
    return measure(run, iters=iters, device=device), T, _causal_flops(lens, H, D, backward)


def _learner_case(P, G, L, device, dtype, pad_factor, iters):
    PackedCausal.MAX_PAD_FACTOR = pad_factor
    model = Qwen3ForCausalLM(preset("qwen3-30m"), device=device, dtype=dtype)
    learner = Learner(model, TrainSection(prompts_per_step=P, group_size=G, lr=1e-9))
    gen = torch.Generator().manual_seed(0)
    groups = []
    for i in range(P):
        prompt = torch.randint(3, 4000, (16,), generator=gen).tolist()
        comps = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in _lens(G, L, seed=i)]
        groups.append(RolloutGroup(i, prompt, comps, [[-1.0] * len(c) for c in comps],
                                   [float(j % 2) for j in range(G)], [[0] * len(c) for c in comps],
                                   ["length"] * G))
    batch = grpo_batch(groups, normalize_std=True).to(device)
    return measure(lambda: learner.step(batch), warmup=1, iters=iters, device=device)


def main(argv=None) -> None:
    on_gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_sweep_args(p, "B=8,32,128 L=64,256 mode=fwd,fwd+bwd", PROVIDERS)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--heads", default="8,4,64", help="H,Hkv,D of the attention cases (default: %(default)s)")
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 (default: bfloat16 on a GPU, else float32)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--learner", default="8,8,48", help="P,G,L of the learner step case ('' to skip)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if on_gpu else "cpu")
    dname = args.dtype or ("bfloat16" if on_gpu else "float32")
    if dname not in ("float32", "bfloat16"):
        raise ConfigError(f"--dtype must be float32 or bfloat16, got {dname!r}")
    dtype = getattr(torch, dname)
    try:
        heads = tuple(int(x) for x in args.heads.split(","))
    except ValueError:
        heads = ()
    if len(heads) != 3 or min(heads) < 1 or heads[0] % heads[1]:
        raise ConfigError(f"--heads must be H,Hkv,D with H a multiple of Hkv, got {args.heads!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    ceilings = load_ceilings(args.ceilings)
    providers = selected_providers(args, PROVIDERS)
    rows = []
    for case in sweep_cases(args):
        B, L, mode = int(case["B"]), int(case["L"]), str(case.get("mode", "fwd"))
        row = {"case": "attention", "B": B, "L": L, "mode": mode}
        for name in providers:
            if name == "tiled" and (mode != "fwd" or on_gpu or not TILED or heads[2] % 16 or heads[2] > 256):
                continue  # forward only, the CPU op of AVX-512 builds
            timing, T, flops = _attention_case(B, L, dtype, device, mode == "fwd+bwd", name, args.iters, args.ncu,
                                               heads)
            if args.ncu:
                print(timing)
                continue
            row[f"{name}_ms"], row["T"] = timing["ms"], T
            row[f"{name}_p90_ms"] = timing["p90_ms"]
            r = rates(timing["ms"], flops=flops, ceilings=ceilings, dtype=dname)
            row[f"{name}_TFLOPs"], row[f"{name}_flops_frac"] = r["TFLOPs"], r.get("flops_frac")
            row["method"] = timing["method"]
        if args.ncu:
            continue
        if "loop_ms" in row and "padded_ms" in row:
            row["speedup"] = row["loop_ms"] / row["padded_ms"]
        if "loop_ms" in row and "tiled_ms" in row:
            row["tiled_speedup"] = row["loop_ms"] / row["tiled_ms"]
        rows.append(row)
        print(rows[-1], flush=True)
    if args.ncu:
        return
    default_factor = PackedCausal.MAX_PAD_FACTOR
    if args.learner and not args.shape:
        P, G, L = (int(x) for x in args.learner.split(","))
        row = {"case": "learner_step", "B": P * G, "L": L, "mode": "fwd+bwd+adamw"}
        for name, factor in {"loop": 0.0, "padded": default_factor}.items():  # name -> MAX_PAD_FACTOR
            row[f"{name}_ms"] = _learner_case(P, G, L, device, dtype, factor, max(3, args.iters // 3))["ms"]
        row["speedup"] = row["loop_ms"] / row["padded_ms"]
        rows.append(row)
    PackedCausal.MAX_PAD_FACTOR = default_factor
    report("bench_packed_attention", rows, out=args.out, device=device,
           columns=["case", "B", "L", "T", "mode", "loop_ms", "padded_ms", "speedup", "tiled_ms", "tiled_speedup",
                    "loop_TFLOPs", "padded_TFLOPs", "tiled_TFLOPs"],
           extra={"dtype": str(dtype), "heads": "H={} Hkv={} D={}".format(*heads), "grid": args.shape or args.grid,
                  "threads": torch.get_num_threads()},
           plot={"path": args.plot, "x": "B", "y": [f"{n}_ms" for n in providers], "group": ["L", "mode"]})


if __name__ == "__main__":
    main()

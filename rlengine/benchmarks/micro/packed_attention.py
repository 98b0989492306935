"""Benchmark: packed causal attention (prefill and the learner) as one padded SDPA vs a per-sequence loop.

Providers: "loop" = one SDPA call per sequence; "padded" = one causal SDPA over the right-padded
batch (rlengine.model.attention.PackedCausal with layout="loop" / "padded"; its default "auto"
pads when gradients flow or on a GPU).
Per layer, forward and forward+backward, for batches of B sequences of ragged length (uniform in
[L/2, 3L/2]), GQA 8:4, D 64 (qwen3-30m's attention), fp32 on CPU / bf16 on GPU. Also one full
GRPO learner step (forward + backward + AdamW over 8 layers) on the qwen3-30m preset with each
(there the layout is switched through PackedCausal.MAX_PAD_FACTOR: 0 disables padding).
Attention is compute-bound: each provider's TFLOP/s counts the useful causal FLOPs only
(4 * n^2 / 2 * H * D per sequence forward, 2.5x that with the backward), and its fraction of
the measured matmul ceiling with --ceilings. The sweep is declarative:
    python bench/bench_packed_attention.py --grid "B=8,32 L=64,256 mode=fwd,fwd+bwd" --plot pa.png
    ncu --profile-from-start off python bench/bench_packed_attention.py --shape "B=32 L=256 mode=fwd" --ncu
"""

from __future__ import annotations

import argparse

import torch

from rlengine.model.config import preset
from rlengine.model.attention import PackedCausal
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.learner.batching import grpo_batch
from rlengine.rl.config import TrainSection
from rlengine.rl.learner.learner import Learner
from rlengine.rl.rollout_group import RolloutGroup

from rlengine.benchmarks.harness import (add_sweep_args, load_ceilings, measure, one_launch, rates, report,
                                         selected_providers, sweep_cases)

PROVIDERS = ["loop", "padded"]  # "loop" is the reference


def _lens(B: int, L: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(L // 2, 3 * L // 2 + 1, (B,), generator=gen).tolist()


def _causal_flops(lens: list[int], H: int, D: int, backward: bool) -> float:
    fwd = sum(4 * n * n / 2 * H * D for n in lens)  # QK^T and PV over the causal half
    return fwd * (3.5 if backward else 1.0)          # backward: about 2.5x the forward


def _attention_case(B, L, dtype, device, backward, layout, iters, ncu=False):
    lens = _lens(B, L, seed=B * 1000 + L)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    T, H, Hkv, D = cu[-1], 8, 4, 64
    q, k, v = (torch.randn(T, h, D, device=device, dtype=dtype, requires_grad=backward) for h in (H, Hkv, Hkv))
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
    p.add_argument("--learner", default="8,8,48", help="P,G,L of the learner step case ('' to skip)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    dname = "bfloat16" if on_gpu else "float32"
    ceilings = load_ceilings(args.ceilings)
    providers = selected_providers(args, PROVIDERS)
    rows = []
    for case in sweep_cases(args):
        B, L, mode = int(case["B"]), int(case["L"]), str(case.get("mode", "fwd"))
        row = {"case": "attention", "B": B, "L": L, "mode": mode}
        for name in providers:
            timing, T, flops = _attention_case(B, L, dtype, device, mode == "fwd+bwd", name, args.iters, args.ncu)
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
           columns=["case", "B", "L", "T", "mode", "loop_ms", "padded_ms", "speedup", "loop_TFLOPs", "padded_TFLOPs",
                    "padded_flops_frac"],
           extra={"dtype": str(dtype), "heads": "H=8 Hkv=4 D=64", "grid": args.shape or args.grid},
           plot={"path": args.plot, "x": "B", "y": [f"{n}_ms" for n in providers], "group": ["L", "mode"]})


if __name__ == "__main__":
    main()

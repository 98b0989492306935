"""Benchmark: packed causal attention (prefill and the learner) as one padded SDPA vs a per-sequence loop.

Providers: "loop" = one SDPA call per sequence; "padded" = one causal SDPA over the right-padded
batch (rlengine.model.attention.PackedCausal with layout="loop" / "padded"; its default "auto"
pads when gradients flow or on a GPU).
Per layer, forward and forward+backward, for batches of B sequences of ragged length (uniform in
[L/2, 3L/2]), GQA 8:4, D 64 (qwen3-30m's attention), fp32 on CPU / bf16 on GPU. Also one full
GRPO learner step (forward + backward + AdamW over 8 layers) on the qwen3-30m preset with each
(there the layout is switched through PackedCausal.MAX_PAD_FACTOR: 0 disables padding).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from rlengine.config import preset
from rlengine.model.attention import PackedCausal
from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.rl.batching import grpo_batch
from rlengine.rl.config import TrainSection
from rlengine.rl.learner import Learner
from rlengine.rl.rollout import RolloutGroup

from bench.harness import measure, report


def _lens(B: int, L: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(L // 2, 3 * L // 2 + 1, (B,), generator=gen).tolist()


def _attention_case(B, L, dtype, device, backward, layout, iters):
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
    return measure(run, iters=iters, device=device), T


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
    p.add_argument("--batches", default="8,32,128", help="comma-separated B (sequences)")
    p.add_argument("--lens", default="64,256", help="comma-separated mean sequence lengths L")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--learner", default="8,8,48", help="P,G,L of the learner step case ('' to skip)")
    p.add_argument("--out", default=None, help="output folder for the JSON (default bench/results)")
    args = p.parse_args(argv)
    device = torch.device("cuda" if on_gpu else "cpu")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    default_factor = PackedCausal.MAX_PAD_FACTOR
    providers = {"loop": 0.0, "padded": default_factor}  # name -> MAX_PAD_FACTOR for the learner case
    rows = []
    for B in (int(x) for x in args.batches.split(",")):
        for L in (int(x) for x in args.lens.split(",")):
            for backward in (False, True):
                row = {"case": "attention", "B": B, "L": L, "mode": "fwd+bwd" if backward else "fwd"}
                for name in providers:
                    timing, T = _attention_case(B, L, dtype, device, backward, name, args.iters)
                    row[f"{name}_ms"], row["T"] = timing["ms"], T
                row["speedup"] = row["loop_ms"] / row["padded_ms"]
                rows.append(row)
                print(rows[-1], flush=True)
    if args.learner:
        P, G, L = (int(x) for x in args.learner.split(","))
        row = {"case": "learner_step", "B": P * G, "L": L, "mode": "fwd+bwd+adamw"}
        for name, factor in providers.items():
            row[f"{name}_ms"] = _learner_case(P, G, L, device, dtype, factor, max(3, args.iters // 3))["ms"]
        row["speedup"] = row["loop_ms"] / row["padded_ms"]
        rows.append(row)
    PackedCausal.MAX_PAD_FACTOR = default_factor
    report("bench_packed_attention", rows, out=args.out, device=device,
           columns=["case", "B", "L", "T", "mode", "loop_ms", "padded_ms", "speedup"],
           extra={"dtype": str(dtype), "heads": "H=8 Hkv=4 D=64"})


if __name__ == "__main__":
    main()

"""Where a copy-digits model's heads look: the attention each head puts on the copy offset, and its entropy.

For each saved model (a run's checkpoints/update-N/model directory), 16 random 24-digit prompts are
followed by their correct answer (teacher forced, transformers' eager attention). Per head: the mean
weight that response slot t's query puts on prompt position t (the copy offset; uniform attention
gives about 1/36), and the mean entropy of its attention over the keys it can see (uniform: 3.2-3.9
nats). A head near 0 nats looks at one token whatever the prompt: it cannot become the copy head.

    python tools/copy_attention.py RUN_DIR/checkpoints/update-000001/model [...] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import random

import torch


def head_stats(model_dir: str, prompts: int = 16, digits: int = 24, seed: int = 0) -> dict[str, dict]:
    from transformers import AutoModelForCausalLM

    from rlengine.model.tokenizer import Tokenizer

    tok, rng = Tokenizer.builtin(), random.Random(seed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").float().eval()
    sums: dict[str, list[float]] = {}
    for _ in range(prompts):
        d = "".join(rng.choice("0123456789") for _ in range(digits))
        ids = tok.encode(d + ":") + tok.encode(d)
        with torch.no_grad():
            att = model(torch.tensor([ids]), output_attentions=True).attentions
        for layer, a in enumerate(att):
            for h in range(a.shape[1]):
                rows = [a[0, h, digits + t, : digits + 1 + t] for t in range(digits)]
                on_copy = sum(float(r[t]) for t, r in enumerate(rows)) / digits
                entropy = sum(float(-(r.clamp_min(1e-12).log() * r).sum()) for r in rows) / digits
                acc = sums.setdefault(f"layer{layer}.head{h}", [0.0, 0.0])
                acc[0] += on_copy / prompts
                acc[1] += entropy / prompts
    return {k: {"weight_on_copy_offset": round(v[0], 4), "entropy_nats": round(v[1], 3)} for k, v in sums.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+", help="model directories (config.json + model.safetensors)")
    p.add_argument("--out", default=None, help="also write {model: {head: stats}} as JSON here")
    args = p.parse_args(argv)
    result = {}
    for path in args.models:
        result[path] = head_stats(path)
        print(path)
        for head, st in result[path].items():
            print(f"  {head}: weight on the copy offset {st['weight_on_copy_offset']:.3f}, "
                  f"entropy {st['entropy_nats']:.2f} nats")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

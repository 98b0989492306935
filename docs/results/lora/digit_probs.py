"""Per first digit, the probability a LoRA run's last checkpoint puts on the right answer of the first-digit task
(docs/results/lora/README.md, "Seed 2 locks"): 40 random 10-digit prompts per first digit, the next-token
distribution after ":", its mean probability of the right digit and the most frequent argmax answers.

    python docs/results/lora/digit_probs.py RUN_DIR
"""

import argparse
import random
from pathlib import Path

import torch

from rlengine.model import load_pretrained
from rlengine.model.lora_peft import load_lora
from rlengine.model.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path)
    p.add_argument("--prompts", type=int, default=40)
    a = p.parse_args()
    tok = Tokenizer.builtin()
    model = load_pretrained(a.run_dir / "base", dtype=torch.float32)
    ckpt = sorted((a.run_dir / "checkpoints").glob("update-*"))[-1]
    load_lora(model, ckpt / "adapter")
    rng = random.Random(0)
    print(f"{ckpt}: first digit, mean P(right digit), argmax answers")
    with torch.no_grad():
        for d in "0123456789":
            right, tops = [], {}
            for _ in range(a.prompts):
                s = d + "".join(rng.choice("0123456789") for _ in range(9)) + ":"
                probs = torch.softmax(model(torch.tensor(tok.encode(s))[None])[0, -1], -1)
                right.append(probs[tok.encode(d)[0]].item())
                top = tok.decode([int(probs.argmax())])
                tops[top] = tops.get(top, 0) + 1
            print(d, f"{sum(right) / len(right):.3f}", dict(sorted(tops.items(), key=lambda x: -x[1])[:3]))


if __name__ == "__main__":
    main()

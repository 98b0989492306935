"""What slot 0 of a copy-digits model does: the first answer digit, the only one read from ":".

    python docs/results/long_job/first_slot_probe.py RUN/checkpoints/update-000100/model [...]

For each saved model, over the task's 128 held-out prompts (teacher forced): slot 0's distribution over
the 10 digits (renormalised); its mean entropy per prompt (H_cond) and the entropy of its mean over
prompts (H_marg: ln 10 = 2.30 when no digit is favoured overall); the probability it gives the right
digit (prompt position 0) and the prompt position it gives the most (best_pos); and the mean
probability of the right digit at slots 1-23. H_cond near 0 with best_pos != 0 is the stall: every
sample of a prompt writes the same wrong digit, read from another prompt position.
"""

from __future__ import annotations

import json
import sys

import torch


def probe(model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from rlengine.model.tokenizer import Tokenizer
    from rlengine.rl.data.tasks import build_task

    tok, problems = Tokenizer.builtin(), build_task("copy-digits").eval
    digit_ids = [tok.encode(d)[0] for d in "0123456789"]
    model = AutoModelForCausalLM.from_pretrained(model_dir).float().eval()
    ids = torch.tensor([tok.encode(p.prompt) + tok.encode(p.answer) for p in problems])
    with torch.no_grad():
        logp = model(ids).logits.float().log_softmax(-1)
    L = len(tok.encode(problems[0].prompt))
    p0 = logp[:, L - 1, digit_ids].exp()
    p0 = p0 / p0.sum(-1, keepdim=True)                                   # [128, 10]
    h_cond = float(-(p0 * p0.clamp_min(1e-12).log()).sum(-1).mean())
    mean = p0.mean(0)
    h_marg = float(-(mean * mean.clamp_min(1e-12).log()).sum())
    digits = torch.tensor([[int(c) for c in p.prompt[:-1]] for p in problems])  # [128, 24]
    by_pos = torch.stack([p0.gather(1, digits[:, j:j + 1]).mean() for j in range(digits.shape[1])])
    right = logp[:, L - 1:-1].gather(2, ids[:, L:].unsqueeze(-1)).squeeze(-1).exp()  # [128, 24]
    return {"H_cond": round(h_cond, 3), "H_marg": round(h_marg, 3), "p_first_digit": round(float(by_pos[0]), 3),
            "best_pos": int(by_pos.argmax()), "p_slots_1_23": round(float(right[:, 1:].mean()), 3)}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(path, json.dumps(probe(path)), flush=True)

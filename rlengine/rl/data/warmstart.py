"""Supervised FORMAT warm start: teach the answer format with answers that ignore the task's rule.

Answers come from Task.warmstart_answer: by default random alphabet strings; for the digit
tasks a digit of the prompt at a uniformly random position. The warm start thus teaches
"answer with one digit from the prompt, then <eos>" but not WHICH digit, so held-out
accuracy after it is near chance (about 20% for 8-digit prompts) and everything above that
is the RL phase's work. Without it a randomly initialised tiny model almost never emits a
parseable answer and RL has no signal. This is the only supervised step of the default job.
"""

from __future__ import annotations

import random

import torch
import torch.nn.functional as F

from rlengine.model.qwen3 import Qwen3ForCausalLM
from rlengine.model.tokenizer import Tokenizer
from rlengine.rl.data.tasks import Task


def format_warmstart(model: Qwen3ForCausalLM, tok: Tokenizer, task: Task, *, steps: int, lr: float, batch: int,
                     seed: int, encode_prompt=None) -> list[float]:
    """Run `steps` AdamW steps of next-token loss on answer tokens; returns the loss curve.
    encode_prompt: prompt text -> ids as the rollout encodes it (default tok.encode).
    A model in batch-invariant mode trains here with the default kernels: nothing is sampled, so
    there is no engine log-prob to match, and every mode starts RL from the same weights."""
    encode_prompt = encode_prompt or tok.encode
    if steps <= 0:
        return []
    invariant = model.batch_invariant
    model.batch_invariant = False
    try:
        return _train(model, tok, task, steps, lr, batch, seed, encode_prompt)
    finally:
        model.batch_invariant = invariant


def _train(model, tok, task, steps, lr, batch, seed, encode_prompt) -> list[float]:
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        ids, targets, cu = [], [], [0]
        for _ in range(batch):
            problem = rng.choice(task.train)
            prompt = encode_prompt(problem.prompt)
            answer = tok.encode(task.warmstart_answer(problem, rng))
            seq = prompt + answer + [tok.eos_token_id]
            ids.extend(seq[:-1])
            targets.extend([-100] * (len(prompt) - 1) + seq[len(prompt):])
            cu.append(len(ids))
        logits = model.forward_packed(torch.tensor(ids, device=model.device), cu)
        loss = F.cross_entropy(logits.float(), torch.tensor(targets, device=model.device), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses

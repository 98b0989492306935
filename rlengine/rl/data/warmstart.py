"""Supervised FORMAT warm start: teach the answer format with answers that ignore the task's rule.

Answers come from Task.warmstart_answer: by default random alphabet strings; for the digit
tasks a digit of the prompt at a uniformly random position. The warm start thus teaches
"answer with one digit from the prompt, then <eos>" but not WHICH digit, so held-out
accuracy after it is near chance (about 20% for 8-digit prompts) and everything above that
is the RL phase's work. Without it a randomly initialised tiny model almost never emits a
parseable answer and RL has no signal. This is the only supervised step of the default job.

The warm start depends on the model, the task, its own settings, the seed and the thread count,
not on the RL settings, so runs that differ only in those (a tune's B_train / LR / B_gen grid)
can share it: `run.warmstart_cache` DIR stores the warm-started weights (safetensors) under a key
of everything else, and a later run with the same key loads them instead of training again. The
weights are the same bits either way, so the run is too.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
from pathlib import Path
from typing import Callable

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


# fields of a TrainConfig that act only after the warm start: a change in them keeps the key
RL_ONLY = {"train": ("lr", "b0", "lr_rule", "b_train", "prompts_per_step", "group_size", "updates"),
           "gen": ("b_gen", "max_lag")}


def warmstart_key(config: dict, *, threads: int, device: str) -> str:
    """The cache key of a job's warm start: the config without its eval and run sections (the seed
    kept) and without the RL-only fields, plus the thread count, device and versions (the summation
    order and kernels). Anything else that differs gives a different key: a miss, never a wrong hit."""
    import rlengine

    d = copy.deepcopy(config)
    d.pop("eval", None)
    d["seed"] = d.pop("run")["seed"]
    for section, keys in RL_ONLY.items():
        for k in keys:
            d.get(section, {}).pop(k, None)
    d.update(threads=threads, device=device, torch=torch.__version__, rlengine=rlengine.__version__)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:20]


def cached_warmstart(model: Qwen3ForCausalLM, cache_dir: str | Path, key: str,
                     train: Callable[[], list[float]]) -> tuple[list[float], bool]:
    """(losses, loaded): the weights stored under cache_dir/key loaded into model, else train() run
    and its result stored (written to a private directory, then renamed: of two processes storing
    the same key at once one rename wins, and both hold identical weights)."""
    from safetensors.torch import load_model, save_model

    path = Path(cache_dir) / key
    weights, meta = path / "model.safetensors", path / "warmstart.json"
    if weights.is_file() and meta.is_file():
        load_model(model, weights, strict=True, device=str(model.device))
        return json.loads(meta.read_text())["losses"], True
    losses = train()
    tmp = Path(cache_dir) / f".{key}.{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"))
    (tmp / "warmstart.json").write_text(json.dumps({"losses": losses}))
    try:
        os.rename(tmp, path)
    except OSError:  # stored by another process meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return losses, False

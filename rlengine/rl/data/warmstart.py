"""Supervised FORMAT warm start: teach the answer format with answers that ignore the task's rule.

Answers come from Task.warmstart_answer: by default random alphabet strings; for the digit
tasks a digit of the prompt at a uniformly random position (copy-digits: its first answer digit,
the one read from ":", then random prompt digits; rl/data/tasks.py). The warm start thus teaches
"answer with one digit from the prompt, then <eos>" but not WHICH digit, so held-out
accuracy after it is near chance (about 20% for 8-digit prompts) and everything above that
is the RL phase's work. Without it a randomly initialised tiny model almost never emits a
parseable answer and RL has no signal. This is the only supervised step of the default job.

The warm start depends on the model, the task, its own settings, the seed and the thread count,
not on the RL settings, so runs that differ only in those (a tune's B_train / LR / B_gen grid)
can share it: `run.warmstart_cache` DIR stores the warm-started weights (safetensors) under a key
of everything else, and a later run with the same key loads them instead of training again. The
weights are the same bits either way, so the run is too. A damaged entry is trained again and replaced;
a store that fails (a full disk) or is interrupted leaves no partial entry and is one ConfigError line.
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

from rlengine.model.config import ConfigError
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
    the same key at once one rename wins, and both hold identical weights). An entry that cannot be
    read (cut short by a crash, damaged) is a miss: trained again and replaced, with one line saying
    so. A store that fails (a full disk) or is interrupted removes what it wrote and leaves every other
    entry as it was; the failure is a ConfigError naming the entry."""
    path = Path(cache_dir) / key
    losses, damaged = _read_entry(model, path)
    if losses is not None:
        return losses, True
    if damaged:
        print(f"warm-start cache entry {path} is damaged ({damaged}); training the warm start again and "
              "replacing it", flush=True)
    losses = train()
    _store_entry(model, path, losses, replace=bool(damaged))
    return losses, False


def _read_entry(model, path: Path) -> tuple[list[float] | None, str]:
    """(losses, "") with the entry's weights loaded into model; (None, "") when there is no entry; (None,
    why) when it cannot be read. The files are checked whole before a single weight is copied."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import load_model

    weights, meta = path / "model.safetensors", path / "warmstart.json"
    if not path.exists():
        return None, ""
    try:
        losses = json.loads(meta.read_text())["losses"]
        with safe_open(str(weights), "pt") as f:  # the header and the file's length: a truncated file fails here
            f.keys()
        if not isinstance(losses, list):
            raise ValueError("no list of losses")
    except (OSError, ValueError, KeyError, TypeError, SafetensorError) as exc:
        return None, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".rstrip(": ")
    load_model(model, weights, strict=True, device=str(model.device))
    return losses, ""


def check_cache_dir(cache_dir: str | Path) -> None:
    """run.warmstart_cache can hold entries: a directory (made if missing) this process can write to;
    else a ConfigError, before any warm start runs."""
    path = Path(cache_dir)
    probe = path / f".write-check-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"run.warmstart_cache {str(cache_dir)!r}: cannot write there "
                          f"({exc.strerror or exc})") from None


def _store_entry(model, path: Path, losses: list[float], *, replace: bool) -> None:
    from safetensors.torch import save_model

    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        save_model(model, str(tmp / "model.safetensors"))
        (tmp / "warmstart.json").write_text(json.dumps({"losses": losses}))
        if replace:  # the damaged entry out of the way first (a rename does not replace a full directory)
            old = path.with_name(f".{path.name}.damaged.{os.getpid()}")
            try:
                os.rename(path, old)
            except FileNotFoundError:  # another process (a rank) replacing it too moved it first
                pass
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:
            if not ((path / "model.safetensors").is_file() and (path / "warmstart.json").is_file()):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # stored by another process meanwhile
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(f"cannot write the warm-start cache entry {path} (run.warmstart_cache): "
                          f"{exc.strerror or exc}") from None
    except BaseException:  # interrupted (a signal): no half-written entry stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        raise

"""The memory plan of a job: analysis.memory_plan's pure arithmetic applied to a TrainConfig.

The job-level glue lives here, not in analysis/: reading the model's config (a preset or a
checkpoint directory), the engines' max_model_len from the task's longest prompt, and the device's
memory. `rlengine info --plan` and the trainer's engine sizing both come through plan_for_config.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlengine.analysis.memory_plan import GiB, MemoryPlan, plan_memory
from rlengine.config import preset
from rlengine.model.factory import tokenizer_for
from rlengine.model.loader import load_config
from rlengine.rl.data.tasks import build_task


def plan_for_config(tc, *, device_bytes: int, max_model_len: int, activations: int | None = None,
                    reserve: int | None = None, alpha: float = 0.9, device_type: str = "cuda",
                    world_size: int = 1) -> MemoryPlan:
    """The plan of a TrainConfig's run (rlengine/rl/config) on a device of device_bytes, checked (see check()).

    max_model_len: the engines' (the trainer's: longest prompt + gen.max_tokens + 1). reserve defaults
    to 1 GiB on CUDA (context, graph pools, FlashInfer / Triton workspaces), 64 MiB elsewhere.
    world_size: ranks of the run (train.parallel = fsdp shards the training state over them).
    """
    name = tc.model.name
    cfg = load_config(name) if Path(name).is_dir() else preset(name)
    t, g = tc.train, tc.gen
    mini = -(-t.b_train // t.mini_batches)  # sequences of one optimizer step (train.mini_batches parts)
    micro = min(t.micro_batch, mini) if t.micro_batch else mini
    return plan_memory(
        cfg, device_bytes=device_bytes, dtype=tc.model.dtype, max_model_len=max_model_len,
        micro_batch_tokens=micro * max_model_len, block_size=g.block_size, master_weights=t.master_weights,
        critic=t.algo == "ppo", kl_reference=t.kl_coef > 0 or t.kl_in_reward, ref_offload=t.ref_offload,
        activation_checkpointing=t.activation_checkpointing,
        materialized_logits=g.logprobs_mode == "processed" and g.filtered, activations=activations,
        reserve=(GiB if device_type == "cuda" else 64 * 2**20) if reserve is None else reserve, alpha=alpha,
        b_gen=g.b_gen, group_size=t.group_size, fsdp_shards=world_size if t.parallel == "fsdp" else 1).check()


def engine_max_model_len(tc) -> int:
    """The engines' max_model_len for a TrainConfig, as the trainer sizes it: the longest train / eval
    prompt + gen.max_tokens + 1, capped at the model's max_position_embeddings (builds the task)."""
    name = tc.model.name
    mpe = (load_config(name) if Path(name).is_dir() else preset(name)).max_position_embeddings
    t = tc.task
    task = build_task(t.name, path=t.path, eval_path=t.eval_path, reward=t.reward, num_train=t.num_train,
                      num_eval=t.num_eval, seed=t.seed)
    encode = tokenizer_for(name).encode
    longest = max(len(encode(p.prompt)) for p in task.train + task.eval)
    return min(longest + tc.gen.max_tokens + 1, mpe)


def device_memory() -> tuple[int, str]:
    """(bytes, where from) of this machine's device: CUDA total memory, else physical RAM."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory, f"CUDA device 0 ({torch.cuda.get_device_name(0)})"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine's RAM (no CUDA device)"

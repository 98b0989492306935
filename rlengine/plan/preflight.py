"""Checks that a job can run on this machine, before anything is built or any rank is started.

The command line (rlengine/cli/commands.py) and the installed benchmarks call these with what the user
typed: the device, the attention backend, the model (a preset, a checkpoint directory with a
config.json, or a Hugging Face hub id), and for a training job its task (every data row, the
reward) and prompt lengths.
Each failure is a ConfigError (or the loader's CheckpointError) naming the option and the fix,
which the CLI prints as one line. Simplification: the job later reads the same files again (the
JSONL rows, config.json); that costs milliseconds next to a run and keeps the builders unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlengine.model.config import ConfigError, ModelConfig, preset


def check_device(device: str | None, what: str) -> torch.device:
    """The torch.device `device` names (None / "auto": cuda if available, else cpu); ConfigError when it
    is not cpu / cuda / cuda:N or names a GPU this machine does not have. `what` is the option's name."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{what} {device!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"{what} {device!r}: rlengine runs on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no GPU is visible"
        raise ConfigError(f"{what} {device!r}: CUDA is not available here ({why}); use {what} cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"{what} {device!r}: this machine has {torch.cuda.device_count()} GPU(s)")
    return dev


def check_backend(name: str, device: torch.device, what: str) -> None:
    """ConfigError when attention backend `name` is unknown or cannot run on `device`."""
    from rlengine.engine.attention import resolve_backend

    try:
        resolve_backend(name, device)
    except ValueError as exc:  # resolve_backend's message names the backend and the reason
        raise ConfigError(f"{what}: {exc}") from None


def check_model(name: str, what: str, revision: str | None = None) -> ModelConfig:
    """The ModelConfig of preset, checkpoint directory or hub id `name` (at `revision`; model/hub.py finds or
    downloads it); ConfigError / CheckpointError naming the preset, id or file otherwise (a checkpoint's
    config.json and that its weight files exist: the tensors themselves are checked when loaded)."""
    from rlengine.model.hub import resolve_model

    path = resolve_model(name, revision=revision, what=what)
    if Path(path).is_dir():
        from rlengine.model.loader import _weight_files, load_model_config

        cfg = load_model_config(path)
        _weight_files(Path(path))  # the loader's own file discovery: a missing shard or safetensors file
        return cfg
    return preset(path)


def check_train_config(cfg) -> None:
    """Everything a TrainConfig needs from this machine and its files, checked as the Trainer checks it
    (the same task, eval sets, prompt encoder and prompt-length check), without loading any weights."""
    from rlengine.model.factory import tokenizer_for
    from rlengine.rl.rollout.evaluation import build_eval_sets
    from rlengine.rl.data.prompts import PromptEncoder, check_job_prompts
    from rlengine.rl.data.tasks import build_task

    device = check_device(cfg.model.device, "model.device")
    model = check_model(cfg.model.name, "model.name", cfg.model.revision)
    check_backend(cfg.attention_backend, device, "gen.backend")
    if cfg.model.moe_impl == "triton":
        from rlengine.model.moe import triton_available

        if not triton_available():
            raise ConfigError("model.moe_impl = 'triton' needs triton, which is not installed "
                              "(pip install 'rlengine[gpu]'); use model.moe_impl = 'ref' or 'auto'")
    t = cfg.task
    task = build_task(t.name, path=t.path, eval_path=t.eval_path, reward=t.reward, num_train=t.num_train,
                      num_eval=t.num_eval, seed=t.seed)
    tok = tokenizer_for(cfg.model.name, revision=cfg.model.revision, tokenizer=cfg.model.tokenizer or None,
                        what="model.tokenizer")
    encode = PromptEncoder(tok, chat_template=t.chat_template, system_prompt=t.system_prompt)
    check_job_prompts(task, build_eval_sets(task, cfg.eval) if cfg.eval.sets else [], encode,
                      max_position_embeddings=model.max_position_embeddings, max_tokens=cfg.gen.max_tokens)

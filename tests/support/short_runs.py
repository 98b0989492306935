"""The short GRPO run (tiny preset, 4 updates of 4 prompts x 4 responses) that trainer-level tests start from."""

from rlengine.rl.config import load_config

SHORT_RUN = ["--warmstart.steps", "5", "--train.updates", "4", "--train.prompts_per_step", "4", "--train.group_size",
             "4", "--eval.every", "2", "--task.num_eval", "8", "--task.num_train", "50", "--run.progress", "false"]


def short_run_config(tmp_path, name, extra=()):
    """The bundled GRPO job cut to SHORT_RUN, writing to tmp_path/name, with `extra` overrides last."""
    return load_config("rlengine/configs/grpo.toml", SHORT_RUN + ["--run.out_dir", str(tmp_path / name), *extra])

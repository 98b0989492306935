"""The short GRPO run (tiny preset, 4 updates of 4 prompts x 4 responses) that trainer-level tests start from."""

from rlengine.rl.config import load_job_config

SHORT_RUN = ["--warmstart.steps", "5", "--train.updates", "4", "--train.prompts_per_step", "4", "--train.group_size",
             "4", "--eval.every", "2", "--task.num_eval", "8", "--task.num_train", "50", "--run.progress", "false"]


def short_run_config(tmp_path, name, extra=()):
    """The bundled GRPO job cut to SHORT_RUN, writing to tmp_path/name, with `extra` overrides last."""
    return load_job_config("rlengine/configs/grpo.toml", SHORT_RUN + ["--run.out_dir", str(tmp_path / name), *extra])


# Fields of a metrics record that are measured in wall-clock time (or process memory), so two runs
# that compute the same updates still differ in them.
TIMINGS = {"t_gen", "t_train", "q_gen", "q", "b_act_mean", "b_act_p50", "b_act_p90", "b_act_frac_time_below"}
WALL_PREFIXES = ("timing_s/", "perf/")


def without_timings(record: dict) -> dict:
    """A metrics record without its wall-clock and memory fields: what two identical runs share."""
    return {k: v for k, v in record.items() if k not in TIMINGS and not k.startswith(WALL_PREFIXES)}

"""The RL side of rlengine, by role; each layer imports only the ones listed above it.

    rollout_group RolloutGroup, the scored group that rollout, algo and learner hand on
    distributed   Dist (ranks and global reductions) and the DDP / FSDP2 wrapping
    algo/         the algorithm as math: advantages, policy / value / KL losses, over-long shaping,
                  LR schedules, the optimizer with master weights, the critic's value head
    data/         tasks and data files, reward functions and plugins, the reward worker pool,
                  scoring, prompt encoding, the format warm start
    config/       the job's settings: section dataclasses, typed values, TOML + overrides
    rollout/      prompts -> engine -> scored groups (collector), and held-out evaluation
    learner/      groups -> packed TrainBatch (batching), and one optimizer update (learner)
    trainer/      the job: the loop, its parts, checkpoints, run directories, outputs (its plan: rlengine/plan)

`from rlengine.rl import Trainer, TrainConfig, load_job_config` gives the entry points.
"""

__all__ = ["Trainer", "TrainConfig", "load_job_config", "load_config"]


def __getattr__(name: str):
    # lazy: importing one layer (e.g. rlengine.rl.algo.losses) must not build the whole job's imports
    if name == "Trainer":
        from rlengine.rl.trainer import Trainer
        return Trainer
    if name in ("TrainConfig", "load_job_config", "load_config"):
        from rlengine.rl import config
        return getattr(config, name)
    raise AttributeError(f"module 'rlengine.rl' has no attribute {name!r}")

"""The training job: the loop (loop.py: collect, update, evaluate, record, checkpoint), its parts
built from a TrainConfig (parts.py), the metrics record of an update (record.py), checkpoints
(checkpoint.py), run directories and resume (run_dir.py), run outputs (run_outputs.py), the
progress line (progress.py). The job's plan (memory, specs) is the plan stage's: rlengine/plan."""

from rlengine.rl.trainer.loop import Trainer

__all__ = ["Trainer"]

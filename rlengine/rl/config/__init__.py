"""The RL job's configuration: section dataclasses (sections.py), the TrainConfig that holds them
(train_config.py), typed values (values.py), and loading from TOML files and dotted overrides (loading.py)."""

from rlengine.rl.config.loading import load_config, load_job_config, packaged_config, split_overrides
from rlengine.rl.config.sections import (EvalSection, GenSection, ModelSection, RunSection, TaskSection, TrainSection,
                                         WarmStartSection)
from rlengine.rl.config.train_config import TrainConfig

__all__ = ["TrainConfig", "ModelSection", "TaskSection", "GenSection", "TrainSection", "WarmStartSection",
           "EvalSection", "RunSection", "load_job_config", "load_config", "packaged_config", "split_overrides"]

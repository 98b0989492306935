"""Compatibility path: the model's config and presets live in rlengine.model.config."""

from rlengine.model.config import *  # noqa: F401,F403
from rlengine.model.config import ConfigError, ModelConfig, PRESETS, preset  # noqa: F401

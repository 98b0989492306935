"""The decoder (Qwen3, Qwen3-MoE, Qwen2 / Qwen2.5, Llama 3.x) shared by the generator and the learner, and its HF loader."""

from rlengine.model.loader import CheckpointError, load_config, load_model_config, load_pretrained, save_pretrained
from rlengine.model.qwen3 import Qwen3ForCausalLM

__all__ = ["Qwen3ForCausalLM", "load_pretrained", "save_pretrained", "load_model_config", "load_config", "CheckpointError"]

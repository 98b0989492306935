"""rlengine: a single-process RL engine for LLMs.

The generator (paged-KV engine) and the learner (GRPO / PPO) run one nn.Module and share
one copy of its weights. See README.md for the two commands that start everything.
"""

__version__ = "0.1.0"

from rlengine.engine import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "__version__"]

"""The generation engine: paged KV cache, continuous batching, paged-decode backends, sampler."""

from rlengine.engine.llm import LLM
from rlengine.engine.outputs import CompletionOutput, Logprob, RequestOutput
from rlengine.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]

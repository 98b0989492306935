"""Tests of rlengine/engine: scheduler, block manager, sampler, CUDA-graph replay, LLM API."""

"""Tests of rlengine/telemetry: NVML sampler, timers, boundary records, NVTX and the profiler."""

"""CUDA-event timing of a GPU callable, shared by the kernels' tuners and the tuning benches."""

from __future__ import annotations

from typing import Callable

import torch


def cuda_seconds(fn: Callable[[], object], reps: int, *, warmup: int = 0) -> float:
    """Seconds per call of `fn` over `reps` back-to-back calls between two CUDA events, after `warmup`
    untimed calls; one host sync (at the end event)."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / reps

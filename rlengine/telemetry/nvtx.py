"""Named ranges in the project's vocabulary, for nsys / ncu timelines and torch.profiler traces.

The engine step (engine.schedule, engine.prepare, engine.forward, engine.sample,
engine.postprocess) and the learner update (learner.forward-backward, learner.optimizer) open a
range per phase with `with ranges("engine.forward"):`. A `PhaseRanges` pushes NVTX ranges
(torch.cuda.nvtx) when `nvtx` is on, and torch.profiler `record_function` labels when `record`
is on (the profiler driver turns it on for its window). When both are off, which is the default
on a CPU, a call is one attribute check returning a shared null context: nothing reaches torch.
Simplification: NVTX is on by default on a CUDA device with a CUDA build of torch; pushing a
range with no tool attached costs well under a microsecond, so it is not gated further.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

ENGINE_PHASES = ("engine.schedule", "engine.prepare", "engine.forward", "engine.sample", "engine.postprocess")
LEARNER_PHASES = ("learner.forward-backward", "learner.optimizer")

_NULL = contextlib.nullcontext()  # stateless and re-enterable: one instance serves every disabled call


def nvtx_unavailable_reason(device: torch.device | str | None) -> str | None:
    """Why NVTX ranges cannot be pushed for `device`, or None when they can."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type != "cuda":
        return f"NVTX ranges are for CUDA devices; this runs on {device}"
    try:
        torch.cuda.nvtx.range_push("rlengine.probe")
        torch.cuda.nvtx.range_pop()
    except (RuntimeError, AttributeError) as exc:  # a CPU build of torch has no NVTX bindings
        return f"torch.cuda.nvtx is unusable ({exc})"
    return None


class _Range:
    __slots__ = ("owner", "name")

    def __init__(self, owner: "PhaseRanges", name: str):
        self.owner, self.name = owner, name

    def __enter__(self) -> None:
        self.owner.push(self.name)

    def __exit__(self, *exc) -> None:
        self.owner.pop()


class PhaseRanges:
    """Push/pop named ranges to NVTX and/or torch.profiler; inert (a null context) when both are off.

    nvtx: a module with range_push(name) / range_pop() (torch.cuda.nvtx, or a fake in tests), or None.
    record: emit torch.profiler.record_function labels (visible in a Chrome / Perfetto trace).
    """

    __slots__ = ("nvtx", "record", "enabled", "_stack")

    def __init__(self, *, nvtx=None, record: bool = False):
        self.nvtx = nvtx
        self.record = record
        self.enabled = nvtx is not None or record
        self._stack: list = []  # open record_function handles (None where record was off at push)

    @classmethod
    def for_device(cls, device: torch.device | str | None, *, nvtx: bool | None = None) -> "PhaseRanges":
        """NVTX on for a CUDA device with a CUDA build (nvtx=None), forced on/off otherwise; record off."""
        reason = nvtx_unavailable_reason(device)
        if nvtx and reason:
            raise ValueError(f"PhaseRanges: nvtx=True but {reason}")
        use = reason is None if nvtx is None else nvtx
        return cls(nvtx=torch.cuda.nvtx if use else None)

    def set_record(self, on: bool) -> None:
        """Turn record_function labels on or off (the profiler driver does this around its window)."""
        self.record = on
        self.enabled = self.nvtx is not None or on

    def __call__(self, name: str) -> ContextManager[None]:
        """A context manager for range `name`; the shared null context when disabled."""
        if not self.enabled:
            return _NULL
        return _Range(self, name)

    def push(self, name: str) -> None:
        """Open range `name` (for phases that do not nest lexically); pair with pop()."""
        if not self.enabled:
            return
        if self.nvtx is not None:
            self.nvtx.range_push(name)
        handle = None
        if self.record:
            handle = torch.profiler.record_function(name)
            handle.__enter__()
        self._stack.append(handle)

    def pop(self) -> None:
        """Close the innermost open range (no-op when none is open, e.g. enabled between push and pop)."""
        if not self._stack:
            return
        handle = self._stack.pop()
        if handle is not None:
            handle.__exit__(None, None, None)
        if self.nvtx is not None:
            self.nvtx.range_pop()

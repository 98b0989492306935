"""triton for the kernel modules, or a stand-in on an install without it (a CPU install).

Every kernel module imports `triton` and `tl` from here, so its dataclasses, launch heuristics and
plain-torch reference (<op>_ref) import on a machine without triton: the learner's CPU path uses
fused_logprob_ref, for one. The stand-in only lets `@triton.jit` definitions be evaluated; anything
that would launch a kernel (`kernel[grid](...)`, `triton.cdiv`, ...) raises ImportError naming the
missing package. AVAILABLE says which one this is; callers that pick a kernel check it first.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    AVAILABLE = True
except ImportError:
    AVAILABLE = False
    MISSING = ("triton is not installed; the Triton kernels need it (pip install 'rlengine[gpu]', "
               "or triton itself); the torch and C++ paths run without it")

    class _Unlaunchable:
        """What @triton.jit returns without triton: a kernel that raises when launched."""

        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            raise ImportError(MISSING)

        def __call__(self, *args, **kwargs):
            raise ImportError(MISSING)

    class _Runtime:
        JITFunction = _Unlaunchable

    class _MissingTriton:
        """`triton` and `triton.language` without triton: jit and runtime for module-level code."""

        runtime = _Runtime

        @staticmethod
        def jit(fn=None, **_options):
            return _Unlaunchable(fn) if fn is not None else _Unlaunchable

        def __getattr__(self, name):
            raise ImportError(f"{MISSING} (triton.{name})")

    triton = tl = _MissingTriton()

__all__ = ["AVAILABLE", "triton", "tl"]

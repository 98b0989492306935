"""Loads the optional C++ extension (rlengine._C) and says once which ops fall back.

The extension registers CPU ops as torch.ops.rlengine.<name> (csrc/*.cpp) and, in a build
against a CUDA torch, CUDA implementations of some of them (csrc/cuda/*.cu). When it is not
built (a failed or skipped compile), every caller uses its plain-torch implementation instead;
`has_op(name)` and `has_cuda_op(name)` are how callers choose.
"""

import sys

import torch

CPP_OPS = ("rms_norm", "store_kvcache", "paged_decode", "fused_add_rms_norm", "qk_norm_rope", "silu_and_mul",
           "skinny_linear")

try:
    from rlengine import _C  # noqa: F401  (import registers torch.ops.rlengine.*)

    AVAILABLE = True
    LOAD_ERROR = None
except ImportError as exc:  # pragma: no cover - depends on the build
    AVAILABLE = False
    LOAD_ERROR = str(exc)
    print(f"rlengine: C++ extension not built ({exc}); ops {', '.join(CPP_OPS)} use torch fallbacks",
          file=sys.stderr)


def has_op(name: str) -> bool:
    """True when torch.ops.rlengine.<name> is registered by the built extension."""
    if not AVAILABLE:
        return False
    return hasattr(torch.ops.rlengine, name)


def has_cuda_op(name: str) -> bool:
    """True when torch.ops.rlengine.<name> also has a CUDA kernel (a GPU build of csrc/cuda/)."""
    return has_op(name) and torch._C._dispatch_has_kernel_for_dispatch_key(f"rlengine::{name}", "CUDA")

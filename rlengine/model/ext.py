"""Loads the optional C++ extensions and says once which ops fall back, and why.

rlengine._C registers the CPU ops as torch.ops.rlengine.<name> (csrc/*.cpp); rlengine._C_cuda,
built separately against a CUDA torch, adds CUDA kernels for some of them (csrc/cuda/). Either
may be missing (a failed or skipped compile): callers then use their plain-torch versions;
`has_op(name)` and `has_cuda_op(name)` are how they choose. setup.py records each build's outcome
(with the compiler's output on failure) in rlengine/_build_status.json; `status_lines()` turns
that and the import results into the lines `rlengine info` prints.
"""

import functools
import hashlib
import importlib
import json
import sys
from pathlib import Path

import torch

CPP_OPS = ("rms_norm", "store_kvcache", "paged_decode", "fused_add_rms_norm", "qk_norm_rope", "silu_and_mul",
           "skinny_linear", "skinny_logits", "nucleus_filter", "lora_expand")
CUDA_OPS = ("store_kvcache",)


def _read_build_status() -> dict:
    path = Path(__file__).parents[1] / "_build_status.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # no build attempted here (or an install that did not ship the file)


BUILD_STATUS = _read_build_status()
"""{"rlengine._C" | "rlengine._C_cuda": {"ok": bool, "error"?: compiler output tail, "skipped"?: reason}}."""


def build_error(name: str) -> str | None:
    """The recorded compiler output of a failed build of extension `name`, else None."""
    return BUILD_STATUS.get(name, {}).get("error")


def _first_error_line(name: str) -> str:
    text = build_error(name)
    if not text:
        return ""
    lines = [ln for ln in text.splitlines() if "error" in ln.lower()] or text.splitlines()
    return f"; build failed: {lines[0].strip()[:200]}"


try:
    importlib.import_module("rlengine._C")  # registers torch.ops.rlengine.*

    AVAILABLE, LOAD_ERROR = True, None
except ImportError as exc:  # pragma: no cover - depends on the build
    AVAILABLE, LOAD_ERROR = False, str(exc)
    print(f"rlengine: C++ extension not built ({exc}{_first_error_line('rlengine._C')}); ops "
          f"{', '.join(CPP_OPS)} use torch fallbacks (`rlengine info` shows the build log)", file=sys.stderr)

CUDA_AVAILABLE, CUDA_LOAD_ERROR = False, "needs the CPU extension" if not AVAILABLE else None
if AVAILABLE:
    try:
        importlib.import_module("rlengine._C_cuda")  # registers the CUDA kernels

        CUDA_AVAILABLE = True
    except ImportError as exc:  # pragma: no cover - depends on the build
        CUDA_LOAD_ERROR = str(exc)
        if torch.version.cuda is not None:  # a CPU torch has no CUDA extension to miss
            print(f"rlengine: CUDA extension not built ({exc}{_first_error_line('rlengine._C_cuda')}); CUDA ops "
                  f"{', '.join(CUDA_OPS)} use torch fallbacks", file=sys.stderr)


@functools.cache
def build_id() -> str:
    """sha1 (12 hex digits) of the loaded rlengine._C binary, "none" without one: a rebuilt extension
    (other kernels) is another build, so measurements keyed by it are not reused across builds."""
    try:
        path = importlib.import_module("rlengine._C").__file__
        return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:12]
    except (ImportError, OSError, TypeError):
        return "none"


# The CPU learner's autograd Functions (model/train_ops.py) run when all of these are built.
TRAIN_OPS = ("rms_norm", "rms_norm_backward", "silu_and_mul", "silu_and_mul_backward", "qk_norm_rope",
             "qk_norm_rope_backward", "silu_backward_vectorized")


def has_train_ops() -> bool:
    """True when the extension has every op of TRAIN_OPS."""
    return all(has_op(op) for op in TRAIN_OPS)


def train_silu() -> bool:
    """True when the CPU learner's SiLU * up Function runs here (has_train_ops and an AVX-512 build)."""
    return has_train_ops() and bool(torch.ops.rlengine.silu_backward_vectorized())


def has_op(name: str) -> bool:
    """True when torch.ops.rlengine.<name> is registered by the built extension."""
    if not AVAILABLE:
        return False
    return hasattr(torch.ops.rlengine, name)


def has_cuda_op(name: str) -> bool:
    """True when torch.ops.rlengine.<name> also has a CUDA kernel (rlengine._C_cuda loaded)."""
    return has_op(name) and torch._C._dispatch_has_kernel_for_dispatch_key(f"rlengine::{name}", "CUDA")


def status_lines() -> list[str]:
    """Human-readable state of both extensions, the recorded build errors included."""
    lines = []
    for name, loaded, err in (("rlengine._C (CPU ops)", AVAILABLE, LOAD_ERROR),
                              ("rlengine._C_cuda (CUDA kernels)", CUDA_AVAILABLE, CUDA_LOAD_ERROR)):
        key = name.split()[0]
        status = BUILD_STATUS.get(key, {})
        if loaded:
            lines.append(f"{name}: loaded")
        elif "skipped" in status:
            lines.append(f"{name}: not built ({status['skipped']})")
        else:
            lines.append(f"{name}: not loaded ({err})")
        if status.get("error"):
            lines.append("  last build failed; compiler output (tail):\n    "
                         + "\n    ".join(status["error"].splitlines()[-20:]))
    return lines

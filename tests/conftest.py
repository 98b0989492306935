"""Shared test settings: one tolerance table, deterministic fp32, gpu marker handling."""

import os

import torch

# Triton kernels run on the CPU through the interpreter in this test tier.
os.environ.setdefault("TRITON_INTERPRET", "1")

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

# (atol, rtol) per dtype, for kernel-vs-reference comparisons.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def tol(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    # Without a GPU the gpu-marked tests are deselected (not skipped): they cannot run here.
    keep = [item for item in items if "gpu" not in item.keywords]
    dropped = [item for item in items if "gpu" in item.keywords]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep

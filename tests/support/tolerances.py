"""One tolerance table for kernel-vs-reference comparisons, per dtype."""

import torch

# (atol, rtol) per dtype, for kernel-vs-reference comparisons.
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-2, 2e-2),
    torch.bfloat16: (5e-2, 5e-2),
}


def tol(dtype: torch.dtype) -> dict:
    atol, rtol = TOLERANCES[dtype]
    return {"atol": atol, "rtol": rtol}

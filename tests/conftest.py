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


def store_kvcache_ref(k, v, k_cache, v_cache, slots):
    """Plain-torch paged KV write (slot -1 skipped) into copies of the caches -> (k_cache, v_cache)."""
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    ref_k.view(-1, Hkv, D)[slots[valid]] = k[valid]
    ref_v.view(-1, Hkv, D)[slots[valid]] = v[valid]
    return ref_k, ref_v


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    # Without a GPU the gpu-marked tests are deselected (not skipped): they cannot run here.
    keep = [item for item in items if "gpu" not in item.keywords]
    dropped = [item for item in items if "gpu" in item.keywords]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep

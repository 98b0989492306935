"""C++ CPU ops (csrc/) against their plain-torch references."""

import pytest
import torch

from conftest import tol
from rlengine import _ext  # noqa: F401  (loads torch.ops.rlengine; fails loudly if the build is missing)
from rlengine.model.layers import rms_norm_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 97), (33, 512)], ids=["row", "odd-3d", "wide"])
def test_rms_norm_matches_reference(dtype, shape):
    x = torch.randn(shape, dtype=dtype) * 3
    w = torch.randn(shape[-1], dtype=dtype)
    got = torch.ops.rlengine.rms_norm(x, w, 1e-6)
    ref = rms_norm_ref(x, w, 1e-6)
    torch.testing.assert_close(got, ref, **tol(dtype))


def test_rms_norm_rejects_bad_weight():
    with pytest.raises(RuntimeError, match="w must be"):
        torch.ops.rlengine.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_writes_slots_and_skips_padding(dtype):
    num_blocks, P, Hkv, D, T = 6, 4, 2, 8, 9
    k_cache = torch.randn(num_blocks, P, Hkv, D, dtype=dtype)
    v_cache = torch.randn(num_blocks, P, Hkv, D, dtype=dtype)
    k, v = torch.randn(T, Hkv, D, dtype=dtype), torch.randn(T, Hkv, D, dtype=dtype)
    slots = torch.randperm(num_blocks * P)[:T]
    slots[3] = -1
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    ref_k.view(-1, Hkv, D)[slots[valid]] = k[valid]
    ref_v.view(-1, Hkv, D)[slots[valid]] = v[valid]
    torch.ops.rlengine.store_kvcache(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


def test_store_kvcache_rejects_out_of_range_slot():
    k_cache = torch.randn(2, 4, 1, 8)
    v_cache = torch.randn(2, 4, 1, 8)
    before = k_cache.clone()
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.rlengine.store_kvcache(torch.randn(1, 1, 8), torch.randn(1, 1, 8), k_cache, v_cache,
                                         torch.tensor([8]))
    assert torch.equal(k_cache, before)

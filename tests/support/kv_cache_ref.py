"""Plain-torch reference of the paged KV-cache write, shared by the C++, Triton and CUDA store tests."""


def store_kvcache_ref(k, v, k_cache, v_cache, slots):
    """Plain-torch paged KV write (slot -1 skipped) into copies of the caches -> (k_cache, v_cache)."""
    Hkv, D = k_cache.shape[2], k_cache.shape[3]
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    ref_k.view(-1, Hkv, D)[slots[valid]] = k[valid]
    ref_v.view(-1, Hkv, D)[slots[valid]] = v[valid]
    return ref_k, ref_v

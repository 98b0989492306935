// Argument checks of store_kvcache, shared by the CPU (kv_cache.cpp) and CUDA (cuda/kv_cache.cu)
// implementations so both reject the same input with the same message.
#pragma once
#include <ATen/ATen.h>

namespace rlengine {

inline void check_store_kvcache_args(const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
                                     const at::Tensor& v_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "store_kvcache: k and v must both be [T, Hkv, D], got ",
              k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "store_kvcache: caches must both be [num_blocks, P, Hkv, D]");
  TORCH_CHECK(k_cache.size(2) == k.size(1) && k_cache.size(3) == k.size(2),
              "store_kvcache: cache [.., .., Hkv, D] = ", k_cache.sizes(), " does not match k ", k.sizes());
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == v_cache.scalar_type(),
              "store_kvcache: k/v dtype must equal the cache dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "store_kvcache: caches must be contiguous");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0) &&
                  slot_mapping.scalar_type() == at::kLong,
              "store_kvcache: slot_mapping must be int64 [T] with T = ", k.size(0));
}

}  // namespace rlengine

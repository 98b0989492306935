// Paged KV write on the CPU: k_cache[slot // P, slot % P] = k[t] for every token t.
// Shapes: k, v [T, Hkv, D]; k_cache, v_cache [num_blocks, P, Hkv, D] (FlashInfer NHD);
// slot_mapping [T] int64, where -1 means "skip this token" (padding).
// Writes the caches in place; no allocation, no host sync beyond reading slot_mapping.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>

#include "kv_cache_checks.h"

namespace {

void store_kvcache(const torch::Tensor& k, const torch::Tensor& v, torch::Tensor k_cache, torch::Tensor v_cache,
                   const torch::Tensor& slot_mapping) {
  rlengine::check_store_kvcache_args(k, v, k_cache, v_cache, slot_mapping);
  auto kc = k.contiguous();
  auto vc = v.contiguous();
  const int64_t T = k.size(0);
  const int64_t row = k.size(1) * k.size(2);
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t elem = k.element_size();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(slots[t] >= -1 && slots[t] < num_slots, "store_kvcache: slot ", slots[t], " at token ", t,
                " is outside the cache (", num_slots, " slots)");
  }
  auto* ksrc = static_cast<const char*>(kc.data_ptr());
  auto* vsrc = static_cast<const char*>(vc.data_ptr());
  auto* kdst = static_cast<char*>(k_cache.data_ptr());
  auto* vdst = static_cast<char*>(v_cache.data_ptr());
  at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = slots[t];
      if (s < 0) continue;
      std::memcpy(kdst + s * row * elem, ksrc + t * row * elem, row * elem);
      std::memcpy(vdst + s * row * elem, vsrc + t * row * elem, row * elem);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def("store_kvcache(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(rlengine, CPU, m) {
  m.impl("store_kvcache", &store_kvcache);
}

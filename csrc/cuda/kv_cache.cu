// Paged KV write on the GPU: the CUDA implementation of torch.ops.rlengine.store_kvcache (the
// schema and the CPU implementation live in csrc/kv_cache.cpp).
//   k_cache[slot // P, slot % P] = k[t], v_cache[...] = v[t] for every token t; slot -1 skips t.
// One launch writes K and V of every token (the torch fallback is two index_copy_ launches),
// one block per token, threads striding over its Hkv * D values as raw bytes: 16-byte (uint4)
// accesses when every row start is 16-byte aligned (bf16 rows of 8 * 128 values are 128 uint4
// stores each), otherwise the widest power-of-two width that divides every address and stride.
// No dtype dispatch: it is a copy. Nothing syncs with the host, so the op can sit inside a captured
// CUDA graph. Slots are not range-checked on the host (that would need a sync): an out-of-range
// slot trips a device assert instead of writing elsewhere.
// Built only when torch has CUDA and nvcc is found (setup.py); tools/check_cuda_sources.sh
// compile-checks it on machines without a GPU.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include "../kv_cache_checks.h"

#include <algorithm>
#include <cstdint>
#include <initializer_list>

namespace {

// vec_t: the access width (uint4 = 16 B down to uint8_t = 1 B). Sizes and strides in vec_t units.
template <typename vec_t>
__global__ void store_kvcache_kernel(const vec_t* __restrict__ k, const vec_t* __restrict__ v,
                                     vec_t* __restrict__ k_cache, vec_t* __restrict__ v_cache,
                                     const int64_t* __restrict__ slots, int64_t row, int64_t k_stride,
                                     int64_t v_stride, int64_t num_slots) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  CUDA_KERNEL_ASSERT(slot < num_slots);
  vec_t* kd = k_cache + slot * row;
  vec_t* vd = v_cache + slot * row;
  const vec_t* ks = k + t * k_stride;
  const vec_t* vs = v + t * v_stride;
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

// Widest power-of-two byte width <= 16 dividing every value (addresses, row and stride bytes).
int64_t access_width(std::initializer_list<int64_t> values) {
  int64_t width = 16;
  for (int64_t x : values) {
    while (x % width != 0) width /= 2;
  }
  return width;
}

template <typename vec_t>
void launch(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
            const at::Tensor& slots, int64_t row_bytes, cudaStream_t stream) {
  constexpr int64_t w = sizeof(vec_t);
  const int64_t row = row_bytes / w;
  const int threads = static_cast<int>(std::min<int64_t>(row, 256));
  store_kvcache_kernel<vec_t><<<static_cast<unsigned>(k.size(0)), threads, 0, stream>>>(
      static_cast<const vec_t*>(k.data_ptr()), static_cast<const vec_t*>(v.data_ptr()),
      static_cast<vec_t*>(k_cache.data_ptr()), static_cast<vec_t*>(v_cache.data_ptr()), slots.data_ptr<int64_t>(),
      row, k.stride(0) * k.element_size() / w, v.stride(0) * v.element_size() / w,
      k_cache.size(0) * k_cache.size(1));
}

void store_kvcache_cuda(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                        const at::Tensor& slot_mapping) {
  rlengine::check_store_kvcache_args(k, v, k_cache, v_cache, slot_mapping);
  TORCH_CHECK(slot_mapping.is_contiguous(), "store_kvcache: slot_mapping must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "store_kvcache: k and v must have one dtype");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&v, &k_cache, &v_cache, &slot_mapping}) {
    TORCH_CHECK(t->device() == k.device(), "store_kvcache: all tensors must be on ", k.device());
  }
  if (k.size(0) == 0) return;
  // each token's [Hkv, D] values must be one contiguous run; tokens may be strided (qkv views)
  const auto kc = (k.stride(2) == 1 && k.stride(1) == k.size(2)) ? k : k.contiguous();
  const auto vc = (v.stride(2) == 1 && v.stride(1) == v.size(2)) ? v : v.contiguous();
  const int64_t elem = k.element_size();
  const int64_t row_bytes = k.size(1) * k.size(2) * elem;
  auto addr = [](const at::Tensor& t) { return static_cast<int64_t>(reinterpret_cast<uintptr_t>(t.data_ptr())); };
  const int64_t width = access_width({row_bytes, kc.stride(0) * elem, vc.stride(0) * elem, addr(kc), addr(vc),
                                      addr(k_cache), addr(v_cache)});
  const c10::cuda::CUDAGuard guard(k.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  switch (width) {
    case 16: launch<uint4>(kc, vc, k_cache, v_cache, slot_mapping, row_bytes, stream); break;
    case 8: launch<uint2>(kc, vc, k_cache, v_cache, slot_mapping, row_bytes, stream); break;
    case 4: launch<uint32_t>(kc, vc, k_cache, v_cache, slot_mapping, row_bytes, stream); break;
    case 2: launch<uint16_t>(kc, vc, k_cache, v_cache, slot_mapping, row_bytes, stream); break;
    default: launch<uint8_t>(kc, vc, k_cache, v_cache, slot_mapping, row_bytes, stream); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(rlengine, CUDA, m) {
  m.impl("store_kvcache", &store_kvcache_cuda);
}

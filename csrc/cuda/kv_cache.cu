// Paged KV write on the GPU: the CUDA implementation of torch.ops.rlengine.store_kvcache (the
// schema and the CPU implementation live in csrc/kv_cache.cpp).
//   k_cache[slot // P, slot % P] = k[t], v_cache[...] = v[t] for every token t; slot -1 skips t.
// One launch writes K and V of every token (the torch fallback is two index_copy_ launches),
// one block per token, threads striding over its Hkv * D values. Nothing syncs with the host, so
// the op can sit inside a captured CUDA graph. Slots are not range-checked on the host (that
// would need a sync): an out-of-range slot trips a device assert instead of writing elsewhere.
// Built only when torch has CUDA and nvcc is found (setup.py); tools/check_cuda_sources.sh
// compile-checks it on machines without a GPU.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/macros/Macros.h>
#include <torch/library.h>

#include "../kv_cache_checks.h"

#include <algorithm>
#include <initializer_list>

namespace {

template <typename scalar_t>
__global__ void store_kvcache_kernel(const scalar_t* __restrict__ k, const scalar_t* __restrict__ v,
                                     scalar_t* __restrict__ k_cache, scalar_t* __restrict__ v_cache,
                                     const int64_t* __restrict__ slots, int64_t row, int64_t k_stride,
                                     int64_t v_stride, int64_t num_slots) {
  const int64_t t = blockIdx.x;
  const int64_t slot = slots[t];
  if (slot < 0) return;
  CUDA_KERNEL_ASSERT(slot < num_slots);
  scalar_t* kd = k_cache + slot * row;
  scalar_t* vd = v_cache + slot * row;
  const scalar_t* ks = k + t * k_stride;
  const scalar_t* vs = v + t * v_stride;
  for (int64_t i = threadIdx.x; i < row; i += blockDim.x) {
    kd[i] = ks[i];
    vd[i] = vs[i];
  }
}

void store_kvcache_cuda(const at::Tensor& k, const at::Tensor& v, at::Tensor k_cache, at::Tensor v_cache,
                        const at::Tensor& slot_mapping) {
  rlengine::check_store_kvcache_args(k, v, k_cache, v_cache, slot_mapping);
  TORCH_CHECK(slot_mapping.is_contiguous(), "store_kvcache: slot_mapping must be contiguous");
  TORCH_CHECK(k.scalar_type() == v.scalar_type(), "store_kvcache: k and v must have one dtype");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&v, &k_cache, &v_cache, &slot_mapping}) {
    TORCH_CHECK(t->device() == k.device(), "store_kvcache: all tensors must be on ", k.device());
  }
  const int64_t T = k.size(0);
  if (T == 0) return;
  const int64_t row = k.size(1) * k.size(2);
  // each token's [Hkv, D] values must be one contiguous run; tokens may be strided (qkv views)
  const auto kc = (k.stride(2) == 1 && k.stride(1) == k.size(2)) ? k : k.contiguous();
  const auto vc = (v.stride(2) == 1 && v.stride(1) == v.size(2)) ? v : v.contiguous();
  const c10::cuda::CUDAGuard guard(k.device());
  const auto stream = c10::cuda::getCurrentCUDAStream();
  const int threads = static_cast<int>(std::min<int64_t>(row, 512));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, k.scalar_type(), "store_kvcache_cuda", [&] {
    store_kvcache_kernel<scalar_t><<<static_cast<unsigned>(T), threads, 0, stream>>>(
        kc.data_ptr<scalar_t>(), vc.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
        slot_mapping.data_ptr<int64_t>(), row, kc.stride(0), vc.stride(0), k_cache.size(0) * k_cache.size(1));
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(rlengine, CUDA, m) {
  m.impl("store_kvcache", &store_kvcache_cuda);
}

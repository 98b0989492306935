// RMSNorm on the CPU: y = x / sqrt(mean(x^2) + eps) * w over the last dimension.
// Accumulates in fp32 for every input dtype (the Hugging Face Qwen3 definition upcasts x
// to fp32, normalises, casts back, then multiplies by w in the input dtype).
// Shapes: x [..., C] contiguous, w [C]. Returns a new tensor shaped like x.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

#include "norm_row.h"

namespace {

template <typename scalar_t>
void rms_norm_rows(const scalar_t* x, const scalar_t* w, scalar_t* y, int64_t rows, int64_t C, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rlengine_norm::norm_row(x + r * C, w, y + r * C, C, eps);
  });
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: x and w must be CPU tensors");
  TORCH_CHECK(x.dim() >= 1, "rms_norm: x must have at least one dimension");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1),
              "rms_norm: w must be [C] with C = x.size(-1) = ", x.size(-1), ", got ", w.sizes());
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and w dtypes differ (", x.scalar_type(),
              " vs ", w.scalar_type(), ")");
  auto xc = x.contiguous();
  auto wc = w.contiguous();
  auto y = torch::empty_like(xc);
  const int64_t C = x.size(-1);
  const int64_t rows = C == 0 ? 0 : xc.numel() / C;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), rows, C,
                            static_cast<float>(eps));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlengine, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}

// Skinny linear for the CPU decode path: y[B, N] = x[B, K] @ w[N, K]^T for a few rows B (1..8), fp32 or bf16.
//
// At decode, B_act token rows meet every weight matrix once: the op is a weight stream (a GEMV
// per row), bound by memory bandwidth. Each task owns 4 consecutive weight rows (2 above B = 4,
// so the 2*B-8 accumulators still fit the 32 vector registers), loads each 16-wide chunk of them
// once and applies it to all B input rows, so the FMA latency chain never stalls the stream. bf16
// weights are widened to fp32 in registers; accumulation is fp32. skinny_linear rounds the output
// once to x's dtype; skinny_logits keeps it fp32 (the LM head: fp32 logits from bf16 weights with
// no fp32 copy of the [V, C] matrix).
// Whether this beats at::linear depends on the CPU (AMX, AVX-512 width, memory bandwidth) and the
// row count: rlengine/model/kernel_choice.py decides per shape class by timing both at first use.
// This op only says what it can run: more rows, other dtypes, no AVX-512 at build time, a
// non-contiguous weight or autograd go to at::linear (skinny_logits: at::linear in fp32).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RLENGINE_SKINNY_AVX512 1
#endif

namespace {

constexpr int64_t kMaxRows = 8;

#ifdef RLENGINE_SKINNY_AVX512

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);  // 16 bf16 = the high halves of 16 fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline void store_out(float* y, float v) { *y = v; }
inline void store_out(c10::BFloat16* y, float v) { *y = c10::BFloat16(v); }

// Rows [r0, r0 + R) of w against all B rows of xf (fp32, [B, K]); R in 1..4. Y: W's type, or float.
// K >= 1 (supported() checks it): a do-while, and the sums taken in unrolled loops, keep the
// accumulators in registers (otherwise GCC stores the array on every step); the next R weight rows
// are prefetched, so the stream from memory keeps several rows in flight.
template <int B, int R, typename W, typename Y>
inline void rows_kernel(const float* xf, const W* w, int64_t K, int64_t r0, int64_t N, Y* y) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  int64_t k = 0;
  do {
    const __mmask16 m = K - k >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[B];
    for (int b = 0; b < B; ++b) xv[b] = _mm512_maskz_loadu_ps(m, xf + b * K + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + R + r) * K + k), _MM_HINT_T0);
      const __m512 wv = load16(w + (r0 + r) * K + k, m);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(wv, xv[b], acc[r][b]);
    }
    k += 16;
  } while (k < K);
  float sums[R][B];
  _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r)
    _Pragma("GCC unroll 32") for (int b = 0; b < B; ++b) sums[r][b] = _mm512_reduce_add_ps(acc[r][b]);
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) store_out(y + b * N + r0 + r, sums[r][b]);
}

template <int B, typename W, typename Y>
void skinny(const float* xf, const W* w, Y* y, int64_t N, int64_t K) {
  constexpr int R = B <= 4 ? 4 : 2;  // R*B accumulators + B inputs + 1 weight vector <= 32 registers
  const int64_t blocks = N / R;
  // >= ~64 KB of weights per task, so two threads split big matrices and small ones stay serial
  const int64_t grain = std::max<int64_t>(1, 16384 * 4 / R / std::max<int64_t>(1, K));
  at::parallel_for(0, blocks, grain, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) rows_kernel<B, R>(xf, w, K, R * q, N, y);
  });
  for (int64_t r = blocks * R; r < N; ++r) rows_kernel<B, 1>(xf, w, K, r, N, y);
}

template <typename W, typename Y>
void dispatch_rows(int64_t B, const float* xf, const W* w, Y* y, int64_t N, int64_t K) {
  switch (B) {
    case 1: skinny<1>(xf, w, y, N, K); break;
    case 2: skinny<2>(xf, w, y, N, K); break;
    case 3: skinny<3>(xf, w, y, N, K); break;
    case 4: skinny<4>(xf, w, y, N, K); break;
    case 5: skinny<5>(xf, w, y, N, K); break;
    case 6: skinny<6>(xf, w, y, N, K); break;
    case 7: skinny<7>(xf, w, y, N, K); break;
    default: skinny<8>(xf, w, y, N, K); break;
  }
}

#endif  // RLENGINE_SKINNY_AVX512

bool supported(const torch::Tensor& x, const torch::Tensor& w) {
#ifdef RLENGINE_SKINNY_AVX512
  const auto dt = x.scalar_type();
  return x.device().is_cpu() && w.device().is_cpu() && x.dim() == 2 && w.dim() == 2 && x.size(0) >= 1 &&
         x.size(0) <= kMaxRows && x.size(1) == w.size(1) && w.scalar_type() == dt &&
         (dt == torch::kFloat || dt == torch::kBFloat16) && w.is_contiguous() &&
         x.size(1) > 0 && !(at::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad()));
#else
  (void)x;
  (void)w;
  return false;
#endif
}

// fp32_out: y is fp32 whatever x's dtype (skinny_logits); else y has x's dtype.
torch::Tensor run_skinny(const torch::Tensor& x, const torch::Tensor& w, bool fp32_out) {
#ifdef RLENGINE_SKINNY_AVX512
  const int64_t B = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({B, N}, x.options().dtype(fp32_out ? torch::kFloat : x.scalar_type()));
  const auto xf = x.to(torch::kFloat).contiguous();  // B*K values: negligible next to the weights
  const float* xp = xf.data_ptr<float>();
  if (x.scalar_type() == torch::kFloat) {
    dispatch_rows(B, xp, w.data_ptr<float>(), y.data_ptr<float>(), N, K);
  } else if (fp32_out) {
    dispatch_rows(B, xp, w.data_ptr<c10::BFloat16>(), y.data_ptr<float>(), N, K);
  } else {
    dispatch_rows(B, xp, w.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), N, K);
  }
  return y;
#else
  (void)fp32_out;
  return at::linear(x, w);
#endif
}

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& w) {
  return supported(x, w) ? run_skinny(x, w, false) : at::linear(x, w);
}

torch::Tensor skinny_logits(const torch::Tensor& x, const torch::Tensor& w) {
  return supported(x, w) ? run_skinny(x, w, true) : at::linear(x.to(torch::kFloat), w.to(torch::kFloat));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def("skinny_linear(Tensor x, Tensor w) -> Tensor");
  m.def("skinny_logits(Tensor x, Tensor w) -> Tensor");
}

// CompositeImplicitAutograd: with gradients required the op is at::linear, which autograd records
// as usual; the raw kernel runs only where no gradient can flow. Any device: non-CPU goes to at::linear.
TORCH_LIBRARY_IMPL(rlengine, CompositeImplicitAutograd, m) {
  m.impl("skinny_linear", &skinny_linear);
  m.impl("skinny_logits", &skinny_logits);
}

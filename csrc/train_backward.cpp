// Backward kernels of the learner's CPU elementwise layers: one pass per row where autograd's replay of
// the torch expressions runs six to ten. Per layer of qwen3-30m at 2048 tokens (bf16, one thread)
// autograd took ~10 ms for each [T, 512] RMSNorm, ~7 ms for the q norm and ~13 ms for SwiGLU; see
// rlengine/model/train_ops.py, which wraps these with the forward kernels into autograd Functions.
//   rms_norm_backward(g, x, w, eps) -> (dx, dw): y = w * round(x * s), s = (mean(x^2) + eps)^-1/2 over
//     the last dim. dx = s (u - x^ mean(u x^)) with u = g w and x^ = x s (the rounding passed straight
//     through, as autograd does); dw = sum over rows of g * round(x^), the value the forward multiplied.
//   silu_and_mul_backward(go, gu) -> dgu: a = silu(gate) * up with gu = [gate | up] on the last dim;
//     d gate = go * up * sigmoid(gate) (1 + gate (1 - sigmoid(gate))), d up = go * round(silu(gate)).
//   qk_norm_rope_backward(gq, gk, gv?, qkv, q_w?, k_w?, cos_sin, positions, H, Hkv, eps) -> (dqkv, dq_w, dk_w):
//     per-head RMSNorm then rotate-half RoPE (qk_norm_rope) backwards, v's gradient copied in: the
//     gradient of the fused qkv projection's output with no concatenation of q / k / v parts.
// Everything is computed in fp32 and rounded once to the input dtype (autograd rounds every
// intermediate: the results agree to the rounding of those steps). Rows are split over threads; dw is
// summed per thread chunk in fp32, then over the chunks in a fixed order (deterministic for a thread count).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "norm_row.h"
#include "paged_attention.h"  // exp_nonpositive(16)

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define RLENGINE_TRAIN_AVX512 1
#endif

namespace {

using rlengine_norm::load;
using rlengine_norm::norm_row_backward;
using rlengine_norm::round_to;
using rlengine_norm::store;

template <typename T>
void rms_norm_backward_rows(const T* g, const T* x, const T* w, T* dx, float* dw_parts, int64_t rows, int64_t C,
                            float eps, int64_t chunks) {
  const int64_t per = (rows + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> wf(C), gy(C), xh(C);
    for (int64_t c = 0; c < C; ++c) wf[c] = load(w, c);
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      float* dw = dw_parts + chunk * C;
      std::fill(dw, dw + C, 0.f);
      for (int64_t r = chunk * per; r < std::min(rows, (chunk + 1) * per); ++r) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) gy[c] = load(g + r * C, c);
        norm_row_backward(x + r * C, gy.data(), wf.data(), xh.data(), dx + r * C, dw, C, eps);
      }
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor> rms_norm_backward(const torch::Tensor& g, const torch::Tensor& x,
                                                           const torch::Tensor& w, double eps) {
  TORCH_CHECK(g.device().is_cpu() && x.device().is_cpu() && w.device().is_cpu(),
              "rms_norm_backward: g, x and w must be CPU tensors");
  TORCH_CHECK(x.dim() >= 1 && g.sizes() == x.sizes(), "rms_norm_backward: g must be shaped like x ", x.sizes(),
              ", got ", g.sizes());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), "rms_norm_backward: w must be [C] with C = x.size(-1) = ",
              x.size(-1), ", got ", w.sizes());
  TORCH_CHECK(g.scalar_type() == x.scalar_type() && w.scalar_type() == x.scalar_type(),
              "rms_norm_backward: g, x and w dtypes differ (", g.scalar_type(), ", ", x.scalar_type(), ", ",
              w.scalar_type(), ")");
  auto gc = g.contiguous(), xc = x.contiguous(), wc = w.contiguous();
  auto dx = torch::empty_like(xc);
  const int64_t C = x.size(-1);
  const int64_t rows = C == 0 ? 0 : xc.numel() / C;
  // a fixed chunk count per thread count: the order of dw's sums does not depend on the scheduler
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(rows, at::get_num_threads()));
  auto parts = torch::empty({chunks, C}, x.options().dtype(torch::kFloat32));
  if (rows == 0) parts.zero_();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "rms_norm_backward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "rms_norm_backward: float64 is not supported (the torch expressions are the reference)");
    } else {
      rms_norm_backward_rows<scalar_t>(gc.data_ptr<scalar_t>(), xc.data_ptr<scalar_t>(), wc.data_ptr<scalar_t>(),
                                       dx.data_ptr<scalar_t>(), parts.data_ptr<float>(), rows, C,
                                       static_cast<float>(eps), chunks);
    }
  });
  return {dx, parts.sum(0).to(w.scalar_type())};
}

// sigmoid(t) on 16 lanes from exp(-|t|) (never overflows): 1 / (1 + e) for t >= 0, e / (1 + e) below.
#if defined(RLENGINE_TRAIN_AVX512)
inline __m512 sigmoid16(__m512 t) {
  const __m512 e = rlengine_attn::exp_nonpositive16(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(t)));
  const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __mmask16 neg = _mm512_cmp_ps_mask(t, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mask_mul_ps(inv, neg, inv, e);
}

inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i bits = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline void store16(float* p, __mmask16 m, __m512 v) { _mm512_mask_storeu_ps(p, m, v); }
inline __m512 round16(__m512 v, const float*) { return v; }
// v rounded to bf16 (round to nearest even on the bits; NaN is not produced from finite inputs here), as fp32
inline __m512 round16(__m512 v, const c10::BFloat16*) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline void store16(c10::BFloat16* p, __mmask16 m, __m512 v) {
  const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round16(v, p)), 16);
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(top));
}
#endif

// The vectorised row (AVX-512 builds, fp32 / bf16): the sigmoid from exp_nonpositive16.
constexpr bool kVectorSigmoid =
#if defined(RLENGINE_TRAIN_AVX512)
    true;
#else
    false;
#endif

template <typename T>
constexpr bool vector_row() { return kVectorSigmoid && (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>); }

// sg: the row's sigmoid(gate) in fp32 where the vectorised row does not run (computed by ATen's vectorised
// sigmoid: a scalar std::exp per element here would make the op slower than autograd's ops).
template <typename T>
void silu_mul_backward_row(const T* go, const T* gu, T* dgu, int64_t F, const float* sg_row) {
  int64_t f = 0;
#if defined(RLENGINE_TRAIN_AVX512)
  if constexpr (vector_row<T>()) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (; f < F; f += 16) {
      const __mmask16 m = static_cast<__mmask16>(F - f >= 16 ? 0xFFFF : (1u << (F - f)) - 1u);
      const __m512 a = load16(gu + f, m), b = load16(gu + F + f, m), o = load16(go + f, m);
      const __m512 sg = sigmoid16(a);
      const __m512 silu = _mm512_mul_ps(a, sg);
      // sigmoid (1 + a (1 - sigmoid)) = sigmoid + silu (1 - sigmoid)
      const __m512 ds = _mm512_fmadd_ps(silu, _mm512_sub_ps(one, sg), sg);
      store16(dgu + f, m, _mm512_mul_ps(_mm512_mul_ps(o, b), ds));
      store16(dgu + F + f, m, _mm512_mul_ps(o, round16(silu, gu)));
    }
    return;
  }
#endif
#pragma omp simd
  for (f = 0; f < F; ++f) {
    const float a = load(gu, f), b = load(gu, F + f), o = load(go, f);
    const float sg = sg_row[f];
    const float silu = a * sg;
    store(dgu, f, o * b * (sg + silu * (1.f - sg)));
    store(dgu, F + f, o * round_to<T>(silu));
  }
}

torch::Tensor silu_and_mul_backward(const torch::Tensor& go, const torch::Tensor& gu) {
  TORCH_CHECK(go.device().is_cpu() && gu.device().is_cpu(), "silu_and_mul_backward: go and gu must be CPU tensors");
  TORCH_CHECK(gu.dim() >= 1 && gu.size(-1) % 2 == 0, "silu_and_mul_backward: gu must be [..., 2F], got ",
              gu.sizes());
  const int64_t F = gu.size(-1) / 2;
  auto expect = gu.sizes().vec();
  expect.back() = F;
  TORCH_CHECK(go.sizes() == c10::IntArrayRef(expect), "silu_and_mul_backward: go must be [..., F] = ", expect,
              ", got ", go.sizes());
  TORCH_CHECK(go.scalar_type() == gu.scalar_type(), "silu_and_mul_backward: go and gu dtypes differ (",
              go.scalar_type(), " vs ", gu.scalar_type(), ")");
  auto goc = go.contiguous(), guc = gu.contiguous();
  auto dgu = torch::empty_like(guc);
  const int64_t rows = F == 0 ? 0 : goc.numel() / F;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, gu.scalar_type(), "silu_and_mul_backward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "silu_and_mul_backward: float64 is not supported (the torch expressions are the reference)");
    } else {
      const scalar_t* o = goc.data_ptr<scalar_t>();
      const scalar_t* x = guc.data_ptr<scalar_t>();
      scalar_t* d = dgu.data_ptr<scalar_t>();
      torch::Tensor sg;  // [rows, F] fp32 sigmoid(gate), only where the vectorised row does not run
      if constexpr (!vector_row<scalar_t>()) sg = at::sigmoid(guc.reshape({rows, 2 * F}).narrow(1, 0, F).to(at::kFloat));
      const float* sgp = vector_row<scalar_t>() ? nullptr : sg.data_ptr<float>();
      at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r)
          silu_mul_backward_row(o + r * F, x + r * 2 * F, d + r * 2 * F, F, sgp == nullptr ? nullptr : sgp + r * F);
      });
    }
  });
  return dgu;
}

// qk_norm_rope's backward (csrc/fused_ops.cpp): per token and q/k head, RoPE's transpose (the rotation by
// -sin: d x~_i = g_i c_i + g_{i+D/2} s_{i+D/2} in the first half, g_i c_i - g_{i-D/2} s_{i-D/2} in the second,
// c and s rounded to the dtype as the forward used them), then the head's RMSNorm backward on its qkv slice.
// v's gradient (gv, optional) is copied into its columns, so dqkv is the whole projection's gradient.
template <typename T>
void qk_norm_rope_backward_rows(const T* gq, const T* gk, const T* gv, const T* qkv, const T* qw, const T* kw,
                                const float* cs, const int64_t* pos, T* dqkv, float* dw_parts, int64_t Tn,
                                int64_t H, int64_t Hkv, int64_t D, int64_t max_pos, float eps, int64_t chunks) {
  const int64_t W = (H + 2 * Hkv) * D, half = D / 2, per = (Tn + chunks - 1) / chunks;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    float dxt[1024], xh[1024], wq[1024], wk[1024];
    if (qw != nullptr)
      for (int64_t i = 0; i < D; ++i) wq[i] = load(qw, i), wk[i] = load(kw, i);
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      float* dw = dw_parts + chunk * 2 * D;  // [q_w | k_w] partial sums of this chunk
      std::fill(dw, dw + 2 * D, 0.f);
      for (int64_t t = chunk * per; t < std::min(Tn, (chunk + 1) * per); ++t) {
        const float* cosr = cs + pos[t] * D;
        const float* sinr = cs + max_pos * D + pos[t] * D;
        for (int64_t h = 0; h < H + Hkv; ++h) {
          const bool is_q = h < H;
          const T* g = is_q ? gq + (t * H + h) * D : gk + (t * Hkv + (h - H)) * D;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            dxt[i] = load(g, i) * round_to<T>(cosr[i]) + load(g, i + half) * round_to<T>(sinr[i + half]);
            dxt[i + half] = load(g, i + half) * round_to<T>(cosr[i + half]) - load(g, i) * round_to<T>(sinr[i]);
          }
          T* out = dqkv + t * W + h * D;
          if (qw != nullptr) {
            norm_row_backward(qkv + t * W + h * D, dxt, is_q ? wq : wk, xh, out, is_q ? dw : dw + D, D, eps);
          } else {
#pragma omp simd
            for (int64_t i = 0; i < D; ++i) store(out, i, dxt[i]);
          }
        }
        T* vout = dqkv + t * W + (H + Hkv) * D;
        if (gv != nullptr) std::copy(gv + t * Hkv * D, gv + (t + 1) * Hkv * D, vout);
        else std::fill(vout, vout + Hkv * D, T(0));
      }
    }
  });
}

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> qk_norm_rope_backward(
    const torch::Tensor& gq, const torch::Tensor& gk, const std::optional<torch::Tensor>& gv, const torch::Tensor& qkv,
    const std::optional<torch::Tensor>& q_w, const std::optional<torch::Tensor>& k_w, const torch::Tensor& cos_sin,
    const torch::Tensor& positions, int64_t H, int64_t Hkv, double eps) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 2, "qk_norm_rope_backward: qkv must be a CPU tensor [T, (H+2Hkv)*D]");
  TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.size(0) == 2 && cos_sin.scalar_type() == torch::kFloat &&
                  cos_sin.is_contiguous(), "qk_norm_rope_backward: cos_sin must be contiguous fp32 [2, max_pos, D]");
  const int64_t D = cos_sin.size(2), Tn = qkv.size(0), max_pos = cos_sin.size(1);
  TORCH_CHECK(D % 2 == 0 && D <= 1024 && qkv.size(1) == (H + 2 * Hkv) * D,
              "qk_norm_rope_backward: qkv width ", qkv.size(1), " != (H + 2Hkv) * D with an even D <= 1024, D = ", D);
  TORCH_CHECK(gq.sizes() == c10::IntArrayRef({Tn, H, D}) && gk.sizes() == c10::IntArrayRef({Tn, Hkv, D}),
              "qk_norm_rope_backward: gq must be [T, H, D] and gk [T, Hkv, D], got ", gq.sizes(), ", ", gk.sizes());
  TORCH_CHECK(!gv.has_value() || gv->sizes() == c10::IntArrayRef({Tn, Hkv, D}),
              "qk_norm_rope_backward: gv must be [T, Hkv, D]");
  TORCH_CHECK(q_w.has_value() == k_w.has_value(), "qk_norm_rope_backward: q_w and k_w must both be given or both None");
  const bool norm = q_w.has_value();
  const auto st = qkv.scalar_type();
  TORCH_CHECK(gq.scalar_type() == st && gk.scalar_type() == st && (!gv.has_value() || gv->scalar_type() == st) &&
                  (!norm || (q_w->scalar_type() == st && k_w->scalar_type() == st && q_w->numel() == D &&
                             k_w->numel() == D)),
              "qk_norm_rope_backward: gradients and q_w / k_w [D] must be in qkv's dtype");
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == Tn && positions.scalar_type() == torch::kLong,
              "qk_norm_rope_backward: positions must be int64 [T]");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < Tn; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "qk_norm_rope_backward: position ", pos[t], " outside the RoPE table");
  auto gqc = gq.contiguous(), gkc = gk.contiguous(), qkvc = qkv.contiguous();
  auto gvc = gv.has_value() ? gv->contiguous() : torch::Tensor();
  auto qwc = norm ? q_w->contiguous() : torch::Tensor(), kwc = norm ? k_w->contiguous() : torch::Tensor();
  auto dqkv = torch::empty_like(qkvc);
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(Tn, at::get_num_threads()));
  auto parts = torch::zeros({chunks, 2, D}, qkv.options().dtype(torch::kFloat32));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, st, "qk_norm_rope_backward", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "qk_norm_rope_backward: float64 is not supported (the torch expressions are the reference)");
    } else {
      qk_norm_rope_backward_rows<scalar_t>(
          gqc.data_ptr<scalar_t>(), gkc.data_ptr<scalar_t>(), gv.has_value() ? gvc.data_ptr<scalar_t>() : nullptr,
          qkvc.data_ptr<scalar_t>(), norm ? qwc.data_ptr<scalar_t>() : nullptr,
          norm ? kwc.data_ptr<scalar_t>() : nullptr, cos_sin.data_ptr<float>(), pos, dqkv.data_ptr<scalar_t>(),
          parts.data_ptr<float>(), Tn, H, Hkv, D, max_pos, static_cast<float>(eps), chunks);
    }
  });
  if (!norm) return {dqkv, torch::empty({0}, qkv.options()), torch::empty({0}, qkv.options())};
  auto dw = parts.sum(0).to(st);
  return {dqkv, dw[0], dw[1]};
}

// True when silu_and_mul_backward runs its AVX-512 row for fp32 / bf16. Elsewhere (AVX2, a portable build) its
// row with ATen's sigmoid was slower in bf16 than autograd's own backward (12 against 8.5 ms at [2048, 2 x 1536],
// AMD EPYC built without AVX-512), so model/train_ops.py keeps the torch expressions for SiLU * up there.
bool silu_backward_vectorized() { return kVectorSigmoid; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def("silu_backward_vectorized() -> bool", &silu_backward_vectorized);  // no tensors: a catch-all kernel
  m.def("rms_norm_backward(Tensor g, Tensor x, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("silu_and_mul_backward(Tensor go, Tensor gu) -> Tensor");
  m.def("qk_norm_rope_backward(Tensor gq, Tensor gk, Tensor? gv, Tensor qkv, Tensor? q_w, Tensor? k_w, Tensor cos_sin, "
        "Tensor positions, int H, int Hkv, float eps) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(rlengine, CPU, m) {
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("silu_and_mul_backward", &silu_and_mul_backward);
  m.impl("qk_norm_rope_backward", &qk_norm_rope_backward);
}

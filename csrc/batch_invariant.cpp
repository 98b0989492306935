// Batch-invariant CPU ops: every output row is computed by the same instructions in the same
// order whatever else is in the batch, so a token's numbers do not depend on B_act, packing,
// padding, the page layout or preemption (rlengine/model/batch_invariant.py uses them on both the
// engine's and the learner's forward).
//   inv_linear(x[M, K], w[N, K], bias[N]?, fp32_out) -> y[M, N]: each y[m, n] is one dot product over
//       K in 16 fp32 lanes (lane l takes k = l mod 16, in order, by fused multiply-add), the lanes
//       summed by one fixed tree, then + bias, rounded once to x's dtype (fp32 with fp32_out).
//       Blocking over M (rows of x) and N (rows of w) only: no split of K, no choice by shape.
//   inv_attention_varlen(q[T, H, D], k[T, Hkv, D], v, cu_seqlens[B+1] int64, scale) -> o[T, H, D]
//   inv_paged_decode(q[B, H, D], k_cache[blocks, P, Hkv, D], v_cache, kv_indptr, kv_indices,
//       kv_last_page_len, scale, out[B, H, D]): both run one routine per (query, head): the query's
//       causal prefix is read in chunks of kKeyChunk keys aligned to absolute positions
//       [0, 32), [32, 64), ..., each chunk's softmax statistics taken in key order, and the chunks
//       merged into the running (max, sum, accumulator) in position order. Paged decode and the
//       packed causal pass hand that routine the same rows, so they give the same bits.
//   inv_logsumexp(z[N, V] fp32) -> [N]: max, then exp(z - max) summed in 16 lanes and one tree.
//   inv_log(x), inv_exp(x): elementwise, one scalar routine for every element (the sampler's draws).
//   inv_silu_and_mul(x[..., 2F]) -> silu(x[..., :F]) * x[..., F:], row by row.
// All arithmetic sits in non-template, non-inlined functions (one machine-code instance for every
// caller) and uses explicit std::fma where it fuses, so no caller gets a differently contracted or
// vectorised copy. exp is the polynomial below, the same code in every lane and every tail.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RLENGINE_INV_AVX512 1
#if defined(__AVX512BF16__)
#define RLENGINE_INV_DPBF16 1
#endif
#endif

namespace {

constexpr int kLanes = 16;
constexpr int64_t kKeyChunk = 32;
constexpr int64_t kMaxHeadDim = 1024;
constexpr int64_t kBlockRows = 8;

// The fixed lane sum: halves, quarters, eighths, pairs.
__attribute__((noinline)) float reduce_lanes(const float* l) {
  float a[8], b[4];
  for (int i = 0; i < 8; ++i) a[i] = l[i] + l[i + 8];
  for (int i = 0; i < 4; ++i) b[i] = a[i] + a[i + 4];
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// exp(x) for x <= 0 (and -inf): 2^n * p(r) with n = round(x / ln2) (the 1.5 * 2^23 trick: two
// adds in round-to-nearest, which vectorise), r = x - n ln2 (Cody-Waite), p Cephes' degree-6
// polynomial; 0 below -87 (where fp32 underflows to denormals).
inline float exp_nonpos(float x) {
  const float xc = std::max(x, -87.f);
  const float n = (xc * 1.44269504088896341f + 12582912.f) - 12582912.f;
  float r = std::fma(n, -0.693359375f, xc);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// ---- linear

template <typename W>
inline float load1(const W* p) { return static_cast<float>(*p); }

#ifdef RLENGINE_INV_AVX512
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// The 16 lanes summed by one fixed sequence: halves, quarters, pairs, the last two. By value (GCC's
// _mm512_reduce_add_ps made the accumulator array addressable: a store per accumulator per step).
inline float hsum(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
  __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  b = _mm_add_ps(b, _mm_movehl_ps(b, b));
  b = _mm_add_ss(b, _mm_movehdup_ps(b));
  return _mm_cvtss_f32(b);
}
#endif

// y[b, r0 + r] for B rows of x and R rows of w: every (b, r) pair runs the same lane recurrence
// whatever B and R are, so a row's result does not depend on its block. X: float (x widened) or,
// with AVX512-BF16, bf16 (pairs of products summed into fp32 lanes by vdpbf16ps).
#ifdef RLENGINE_INV_AVX512
// Each accumulator loop is its own function with its accumulators local to it and a do-while
// (K >= 1), so GCC keeps the R * B accumulators in registers.
// The sums are taken in fully unrolled loops: an accumulator indexed at run time would put the
// array in memory, and GCC then stores it on every step of the k loop.
#define RLENGINE_INV_EPILOGUE                                    \
  float sums[R][B];                                              \
  _Pragma("GCC unroll 32") for (int r = 0; r < R; ++r)           \
    _Pragma("GCC unroll 32") for (int b = 0; b < B; ++b)         \
      sums[r][b] = hsum(acc[r][b]);                              \
  for (int r = 0; r < R; ++r)                                    \
    for (int b = 0; b < B; ++b) {                                \
      float s = sums[r][b];                                      \
      if (bias != nullptr) s += bias[r0 + r];                    \
      y[b * N + r0 + r] = static_cast<Y>(s);                     \
    }

template <int B, int R, typename W, typename Y>
void tile_fma(const float* x, const W* w, int64_t K, int64_t r0, int64_t N, const float* bias, Y* y) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  int64_t k = 0;
  do {
    const __mmask16 m = K - k >= kLanes ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[B];
    for (int b = 0; b < B; ++b) xv[b] = load16(x + b * K + k, m);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + R + r) * K + k), _MM_HINT_T0);  // the next tile's rows
      const __m512 wv = load16(w + (r0 + r) * K + k, m);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_fmadd_ps(wv, xv[b], acc[r][b]);
    }
    k += kLanes;
  } while (k < K);
  RLENGINE_INV_EPILOGUE
}

#ifdef RLENGINE_INV_DPBF16
// bf16 x and w: vdpbf16ps adds the two products of each bf16 pair into one fp32 lane.
template <int B, int R, typename Y>
void tile_dp(const c10::BFloat16* x, const c10::BFloat16* w, int64_t K, int64_t r0, int64_t N, const float* bias,
             Y* y) {
  __m512 acc[R][B];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) acc[r][b] = _mm512_setzero_ps();
  int64_t k = 0;
  do {
    const __mmask32 m = K - k >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu) : static_cast<__mmask32>((1u << (K - k)) - 1);
    __m512bh xv[B];
    for (int b = 0; b < B; ++b) xv[b] = (__m512bh)_mm512_maskz_loadu_epi16(m, x + b * K + k);
    for (int r = 0; r < R; ++r) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (r0 + R + r) * K + k), _MM_HINT_T0);  // the next tile's rows
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(m, w + (r0 + r) * K + k);
      for (int b = 0; b < B; ++b) acc[r][b] = _mm512_dpbf16_ps(acc[r][b], wv, xv[b]);
    }
    k += 32;
  } while (k < K);
  RLENGINE_INV_EPILOGUE
}
#endif
#undef RLENGINE_INV_EPILOGUE
#endif  // RLENGINE_INV_AVX512

// y[b, r0 + r] for B rows of x and R rows of w: every (b, r) pair runs the same lane recurrence
// whatever B and R are, so a row's result does not depend on its block. X: float (x widened) or,
// with AVX512-BF16, bf16 (pairs of products summed into fp32 lanes by vdpbf16ps).
template <int B, int R, typename X, typename W, typename Y>
void tile(const X* x, const W* w, int64_t K, int64_t r0, int64_t N, const float* bias, Y* y) {
#ifdef RLENGINE_INV_AVX512
#ifdef RLENGINE_INV_DPBF16
  if constexpr (std::is_same_v<X, c10::BFloat16>) {
    tile_dp<B, R>(x, w, K, r0, N, bias, y);
    return;
  } else
#endif
  {
    tile_fma<B, R>(reinterpret_cast<const float*>(x), w, K, r0, N, bias, y);
  }
#else
  alignas(64) float lanes[R][B][kLanes];
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b)
      for (int l = 0; l < kLanes; ++l) lanes[r][b][l] = 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const int l = static_cast<int>(k % kLanes);
    for (int r = 0; r < R; ++r) {
      const float wv = load1(w + (r0 + r) * K + k);
      for (int b = 0; b < B; ++b) lanes[r][b][l] = std::fma(wv, static_cast<float>(x[b * K + k]), lanes[r][b][l]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int b = 0; b < B; ++b) {
      float s = reduce_lanes(lanes[r][b]);
      if (bias != nullptr) s += bias[r0 + r];
      y[b * N + r0 + r] = static_cast<Y>(s);
    }
#endif
}

template <int B, typename X, typename W, typename Y>
void row_block(const X* x, const W* w, int64_t K, int64_t n0, int64_t n1, int64_t N, const float* bias, Y* y) {
  constexpr int R = B <= 4 ? 4 : 2;  // R * B accumulators + B inputs + 1 weight vector <= 32 registers
  int64_t n = n0;
  for (; n + R <= n1; n += R) tile<B, R>(x, w, K, n, N, bias, y);
  for (; n < n1; ++n) tile<B, 1>(x, w, K, n, N, bias, y);
}

template <typename X, typename W, typename Y>
void linear_rows(const X* x, const W* w, const float* bias, Y* y, int64_t M, int64_t N, int64_t K) {
  // Work items: (panel of w rows, block of up to 8 x rows: a decode step's rows read the weights
  // once); a panel of w rows stays in cache while the x blocks pass. The item grid depends on M and
  // N, never what an item computes for a given (row, output).
  const int64_t panel = std::max<int64_t>(4, (int64_t{64} * 1024 / std::max<int64_t>(1, K * 4)) / 4 * 4);
  const int64_t panels = (N + panel - 1) / panel, blocks = (M + kBlockRows - 1) / kBlockRows;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, panel * K * 4));
  at::parallel_for(0, panels * blocks, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i / blocks, mb = i % blocks;
      const int64_t n0 = p * panel, n1 = std::min(N, n0 + panel), m0 = mb * kBlockRows;
      const int64_t rows = std::min<int64_t>(kBlockRows, M - m0);
      const X* xb = x + m0 * K;
      Y* yb = y + m0 * N;
      switch (rows) {
        case 8: row_block<8>(xb, w, K, n0, n1, N, bias, yb); break;
        case 7: row_block<7>(xb, w, K, n0, n1, N, bias, yb); break;
        case 6: row_block<6>(xb, w, K, n0, n1, N, bias, yb); break;
        case 5: row_block<5>(xb, w, K, n0, n1, N, bias, yb); break;
        case 4: row_block<4>(xb, w, K, n0, n1, N, bias, yb); break;
        case 3: row_block<3>(xb, w, K, n0, n1, N, bias, yb); break;
        case 2: row_block<2>(xb, w, K, n0, n1, N, bias, yb); break;
        default: row_block<1>(xb, w, K, n0, n1, N, bias, yb); break;
      }
    }
  });
}

torch::Tensor inv_linear(const torch::Tensor& x, const torch::Tensor& w, const std::optional<torch::Tensor>& bias,
                         bool fp32_out) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "inv_linear: x and w must be CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "inv_linear: x must be [M, K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  const auto dt = x.scalar_type();
  TORCH_CHECK(w.scalar_type() == dt && (dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf),
              "inv_linear: x and w must share one dtype of float32, bfloat16, float16; got ", dt, " and ",
              w.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == N),
              "inv_linear: bias must be [N] = [", N, "]");
  auto y = torch::empty({M, N}, x.options().dtype(fp32_out ? at::kFloat : dt));
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias.has_value() ? y.copy_(bias->to(at::kFloat).expand({M, N})) : y.zero_();
  const auto wc = w.contiguous();
  torch::Tensor bf;
  if (bias.has_value()) bf = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bf.data_ptr<float>() : nullptr;
#ifdef RLENGINE_INV_DPBF16
  const bool raw_bf16 = dt == at::kBFloat16;  // vdpbf16ps reads bf16 x as it is
#else
  const bool raw_bf16 = false;
#endif
  const auto xs = raw_bf16 ? x.contiguous() : x.to(at::kFloat).contiguous();  // widening is exact
  auto run = [&](const auto* xp, const auto* wp) {
    if (fp32_out || dt == at::kFloat) linear_rows(xp, wp, bp, y.data_ptr<float>(), M, N, K);
    else if (dt == at::kBFloat16) linear_rows(xp, wp, bp, y.data_ptr<c10::BFloat16>(), M, N, K);
    else linear_rows(xp, wp, bp, y.data_ptr<c10::Half>(), M, N, K);
  };
  if (dt == at::kFloat) run(xs.data_ptr<float>(), wc.data_ptr<float>());
  else if (raw_bf16) run(xs.data_ptr<c10::BFloat16>(), wc.data_ptr<c10::BFloat16>());
  else if (dt == at::kBFloat16) run(xs.data_ptr<float>(), wc.data_ptr<c10::BFloat16>());
  else run(xs.data_ptr<float>(), wc.data_ptr<c10::Half>());
  return y;
}

// ---- attention

struct Running {
  float m = -std::numeric_limits<float>::infinity();
  float l = 0.f;
  bool first = true;
};

// Dot product over D in 16 lanes and the fixed tree.
inline float dot_lanes(const float* a, const float* b, int64_t D) {
  alignas(64) float lanes[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= D; i += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
  for (int l = 0; i + l < D; ++l) lanes[l] = std::fma(a[i + l], b[i + l], lanes[l]);
  return reduce_lanes(lanes);
}

// One chunk of n <= kKeyChunk keys (fp32 rows k_nD, v_nD) into the running state of one query.
__attribute__((noinline)) void chunk_update(const float* q, const float* k_nD, const float* v_nD, int64_t n, int64_t D,
                                            float scale, Running& st, float* acc, float* acc_c) {
  float s[kKeyChunk], p[kKeyChunk];
  for (int64_t j = 0; j < n; ++j) s[j] = dot_lanes(q, k_nD + j * D, D) * scale;
  float mc = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mc = std::max(mc, s[j]);
  for (int64_t j = 0; j < n; ++j) p[j] = exp_nonpos(s[j] - mc);
  float lc = 0.f;
  for (int64_t j = 0; j < n; ++j) lc += p[j];
  for (int64_t d = 0; d < D; ++d) acc_c[d] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float pj = p[j];
    const float* vj = v_nD + j * D;
    for (int64_t d = 0; d < D; ++d) acc_c[d] = std::fma(pj, vj[d], acc_c[d]);
  }
  if (st.first) {
    st.m = mc;
    st.l = lc;
    st.first = false;
    for (int64_t d = 0; d < D; ++d) acc[d] = acc_c[d];
    return;
  }
  const float mn = std::max(st.m, mc);
  const float a = exp_nonpos(st.m - mn), b = exp_nonpos(mc - mn);
  st.l = std::fma(st.l, a, lc * b);
  st.m = mn;
  for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(acc[d], a, acc_c[d] * b);
}

template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// The G query rows q_rows[g * q_stride] of one KV head against its keys 0..L-1; row_at(j) gives key /
// value j's offset (elements). Each chunk of K/V rows is widened once and applied to every query of
// the group: a query's arithmetic (chunk_update, in chunk order) is the same whatever G and the layout.
template <typename T, typename RowAt>
void attend_group(const T* q_rows, int64_t q_stride, int64_t G, const T* k, const T* v, int64_t L, int64_t D,
                  float scale, RowAt row_at, T* out, int64_t out_stride, std::vector<float>& buf,
                  std::vector<Running>& st) {
  float* kb = buf.data();
  float* vb = kb + kKeyChunk * D;
  float* acc_c = vb + kKeyChunk * D;
  float* qf = acc_c + D;          // [G, D]
  float* acc = qf + G * D;        // [G, D]
  for (int64_t g = 0; g < G; ++g) {
    widen_row(q_rows + g * q_stride, qf + g * D, D);
    st[g] = Running();
  }
  for (int64_t c0 = 0; c0 < L; c0 += kKeyChunk) {
    const int64_t n = std::min(kKeyChunk, L - c0);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t off = row_at(c0 + j);
      widen_row(k + off, kb + j * D, D);
      widen_row(v + off, vb + j * D, D);
    }
    for (int64_t g = 0; g < G; ++g) chunk_update(qf + g * D, kb, vb, n, D, scale, st[g], acc + g * D, acc_c);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; ++d) out[g * out_stride + d] = static_cast<T>(acc[g * D + d] / st[g].l);
}

inline int64_t scratch_floats(int64_t D, int64_t G) { return D * (1 + 2 * kKeyChunk + 2 * G); }

void check_qkv(const char* op, const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), op, ": inputs must be CPU tensors");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, op,
              ": dtype must be float32, bfloat16 or float16, got ", dt);
  TORCH_CHECK(k.scalar_type() == dt && v.scalar_type() == dt, op, ": q, k and v dtypes differ");
  TORCH_CHECK(q.size(-1) <= kMaxHeadDim, op, ": head dim above ", kMaxHeadDim);
}

torch::Tensor inv_attention_varlen(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                   const torch::Tensor& cu_seqlens, double scale) {
  check_qkv("inv_attention_varlen", q, k, v);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && k.size(0) == q.size(0) &&
                  k.size(2) == q.size(2),
              "inv_attention_varlen: q must be [T, H, D] and k, v [T, Hkv, D], got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  const int64_t T = q.size(0), H = q.size(1), Hkv = k.size(1), D = q.size(2);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "inv_attention_varlen: H = ", H, " is not a multiple of Hkv = ", Hkv);
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1 &&
                  cu_seqlens.device().is_cpu(),
              "inv_attention_varlen: cu_seqlens must be a CPU int64 [B+1]");
  auto cu = cu_seqlens.contiguous();
  const int64_t* c = cu.data_ptr<int64_t>();
  const int64_t B = cu.size(0) - 1;
  TORCH_CHECK(c[0] == 0 && c[B] == T, "inv_attention_varlen: cu_seqlens must run from 0 to T = ", T);
  std::vector<int64_t> seq_of(T);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(c[b + 1] >= c[b], "inv_attention_varlen: cu_seqlens must not decrease");
    for (int64_t t = c[b]; t < c[b + 1]; ++t) seq_of[t] = b;
  }
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto out = torch::empty_like(qc);
  const int64_t G = H / Hkv;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "inv_attention_varlen", [&] {
    const scalar_t* qp = qc.data_ptr<scalar_t>();
    const scalar_t* kp = kc.data_ptr<scalar_t>();
    const scalar_t* vp = vc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, T * Hkv, 4, [&](int64_t i0, int64_t i1) {
      std::vector<float> buf(scratch_floats(D, G));
      std::vector<Running> st(G);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t t = i / Hkv, hkv = i % Hkv, start = c[seq_of[t]];
        auto row_at = [&](int64_t j) { return ((start + j) * Hkv + hkv) * D; };
        attend_group(qp + (t * H + hkv * G) * D, D, G, kp, vp, t - start + 1, D, static_cast<float>(scale), row_at,
                     op + (t * H + hkv * G) * D, D, buf, st);
      }
    });
  });
  return out;
}

void inv_paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                      const torch::Tensor& kv_indptr, const torch::Tensor& kv_indices,
                      const torch::Tensor& kv_last_page_len, double scale, torch::Tensor out) {
  check_qkv("inv_paged_decode", q, k_cache, v_cache);
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.size(3) == q.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "inv_paged_decode: q must be [B, H, D] and k_cache, v_cache contiguous [blocks, P, Hkv, D]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), P = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t blocks = k_cache.size(0);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "inv_paged_decode: H = ", H, " is not a multiple of Hkv = ", Hkv);
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.is_contiguous(),
              "inv_paged_decode: out must be contiguous like q");
  for (const auto* t : {&kv_indptr, &kv_indices, &kv_last_page_len})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous() && t->device().is_cpu(),
                "inv_paged_decode: page tables must be contiguous CPU int32");
  TORCH_CHECK(kv_indptr.size(0) == B + 1 && kv_last_page_len.size(0) == B,
              "inv_paged_decode: kv_indptr must be [B+1] and kv_last_page_len [B]");
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* last = kv_last_page_len.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(indptr[b + 1] > indptr[b] && indptr[b + 1] <= kv_indices.size(0) && last[b] >= 1 && last[b] <= P,
                "inv_paged_decode: bad page table for sequence ", b);
    for (int64_t i = indptr[b]; i < indptr[b + 1]; ++i)
      TORCH_CHECK(indices[i] >= 0 && indices[i] < blocks, "inv_paged_decode: kv_indices[", i, "] = ", indices[i],
                  " is outside the cache (", blocks, " blocks)");
  }
  TORCH_CHECK(q.stride(2) == 1, "inv_paged_decode: q needs a contiguous head dim");
  const int64_t G = H / Hkv, qs0 = q.stride(0), qs1 = q.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "inv_paged_decode", [&] {
    const scalar_t* qp = q.data_ptr<scalar_t>();
    const scalar_t* kp = k_cache.data_ptr<scalar_t>();
    const scalar_t* vp = v_cache.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, B * Hkv, 1, [&](int64_t i0, int64_t i1) {
      std::vector<float> buf(scratch_floats(D, G));
      std::vector<Running> st(G);
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t b = i / Hkv, hkv = i % Hkv;
        const int64_t L = (indptr[b + 1] - indptr[b] - 1) * P + last[b];
        const int32_t* pages = indices + indptr[b];
        auto row_at = [&](int64_t j) { return ((static_cast<int64_t>(pages[j / P]) * P + j % P) * Hkv + hkv) * D; };
        attend_group(qp + b * qs0 + hkv * G * qs1, qs1, G, kp, vp, L, D, static_cast<float>(scale), row_at,
                     op + (b * H + hkv * G) * D, D, buf, st);
      }
    });
  });
}

// ---- log-sum-exp over the vocabulary

__attribute__((noinline)) float row_logsumexp(const float* z, int64_t V) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  alignas(64) float mx[kLanes];
  for (int l = 0; l < kLanes; ++l) mx[l] = kNegInf;
  int64_t i0 = 0;
  for (; i0 + kLanes <= V; i0 += kLanes)  // lane-wise (vectorises); the max is exact in any order
    for (int l = 0; l < kLanes; ++l) mx[l] = std::max(mx[l], z[i0 + l]);
  float m = kNegInf;
  for (int l = 0; l < kLanes; ++l) m = std::max(m, mx[l]);
  for (; i0 < V; ++i0) m = std::max(m, z[i0]);
  if (m == kNegInf) return m;
  alignas(64) float lanes[kLanes] = {0.f};
  alignas(64) float e[kLanes];
  int64_t i = 0;
  for (; i + kLanes <= V; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) e[l] = exp_nonpos(z[i + l] - m);
    for (int l = 0; l < kLanes; ++l) lanes[l] += e[l];
  }
  for (int l = 0; i + l < V; ++l) lanes[l] += exp_nonpos(z[i + l] - m);
  return m + std::log(reduce_lanes(lanes));
}

torch::Tensor inv_logsumexp(const torch::Tensor& z) {
  TORCH_CHECK(z.device().is_cpu() && z.dim() == 2 && z.scalar_type() == at::kFloat,
              "inv_logsumexp: z must be a CPU float32 [N, V], got ", z.scalar_type(), " ", z.sizes());
  auto zc = z.contiguous();
  const int64_t N = z.size(0), V = z.size(1);
  auto out = torch::empty({N}, z.options());
  const float* zp = zc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, V)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) op[r] = row_logsumexp(zp + r * V, V);
  });
  return out;
}

// ---- elementwise exp / log: std::exp / std::log on every element (torch's own loops take a
// vector kernel in the body and the scalar one in the tail, so an element's bits depend on where
// the tensor ends)

__attribute__((noinline)) void log_range(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::log(x[i]);
}

__attribute__((noinline)) void exp_range(const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = std::exp(x[i]);
}

torch::Tensor elementwise(const torch::Tensor& x, void (*fn)(const float*, float*, int64_t), const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, name, ": x must be a CPU float32 tensor");
  auto xc = x.contiguous();
  auto y = torch::empty_like(xc);
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, xc.numel(), 1 << 14, [&](int64_t i0, int64_t i1) { fn(xp + i0, yp + i0, i1 - i0); });
  return y;
}

torch::Tensor inv_log(const torch::Tensor& x) { return elementwise(x, log_range, "inv_log"); }

// ---- SiLU(gate) * up per row: sigmoid from exp_nonpos(-|g|) (no overflow, vectorisable), the
// activation rounded to the dtype before the multiply, as torch's silu(g) * u rounds.

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t F) {
  for (int64_t i = 0; i < F; ++i) {
    const float gv = static_cast<float>(g[i]);
    const float e = exp_nonpos(-std::abs(gv));
    const float sig = (gv >= 0.f ? 1.f : e) / (1.f + e);
    const T act = static_cast<T>(gv * sig);
    o[i] = static_cast<T>(static_cast<float>(act) * static_cast<float>(u[i]));
  }
}

torch::Tensor inv_silu_and_mul(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.size(-1) % 2 == 0,
              "inv_silu_and_mul: x must be a CPU tensor [..., 2F], got ", x.sizes());
  auto xc = x.contiguous();
  const int64_t F2 = x.size(-1), F = F2 / 2, rows = F2 == 0 ? 0 : xc.numel() / F2;
  auto sizes = x.sizes().vec();
  sizes.back() = F;
  auto out = torch::empty(sizes, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "inv_silu_and_mul", [&] {
    const scalar_t* in = xc.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) silu_mul_row(in + r * F2, in + r * F2 + F, o + r * F, F);
    });
  });
  return out;
}
torch::Tensor inv_exp(const torch::Tensor& x) { return elementwise(x, exp_range, "inv_exp"); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def("inv_log(Tensor x) -> Tensor");
  m.def("inv_silu_and_mul(Tensor x) -> Tensor");
  m.def("inv_exp(Tensor x) -> Tensor");
  m.def("inv_linear(Tensor x, Tensor w, Tensor? bias, bool fp32_out) -> Tensor");
  m.def("inv_attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> Tensor");
  m.def(
      "inv_paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kv_last_page_len, float scale, Tensor(a!) out) -> ()");
  m.def("inv_logsumexp(Tensor z) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlengine, CPU, m) {
  m.impl("inv_linear", &inv_linear);
  m.impl("inv_attention_varlen", &inv_attention_varlen);
  m.impl("inv_paged_decode", &inv_paged_decode);
  m.impl("inv_logsumexp", &inv_logsumexp);
  m.impl("inv_log", &inv_log);
  m.impl("inv_silu_and_mul", &inv_silu_and_mul);
  m.impl("inv_exp", &inv_exp);
}

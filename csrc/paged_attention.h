// Shared pieces of the CPU paged-attention ops (paged_decode.cpp, cascade_decode.cpp): widening
// loads of fp16/bf16 rows to fp32, the per-page score and accumulate loops, a vectorisable exp, and
// attend_pages, the online softmax of R query rows of one KV head over a list of pages. Every inner
// loop is a contiguous fp32 loop over D; see paged_decode.cpp for what each piece bought. An AVX-512
// build (D a multiple of 16) scores 16 keys per tile and runs max / exp / sum on 16 lanes; the
// portable loops stay as the fallback for every other build and head dim.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace rlengine_attn {

// ---- widening loads: n contiguous elements to fp32

inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  // bf16 is the top half of an fp32: a shift the compiler vectorises.
  const auto* bits = reinterpret_cast<const uint16_t*>(src);
  auto* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

inline void widen(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  // The scalar c10::Half conversion does not vectorise; F16C converts 8 lanes per instruction.
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void scale(float* y, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] *= a;
}

#if defined(__AVX512F__)
inline __mmask16 lane_mask(int64_t n) {  // the first min(n, 16) lanes
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// Lane n = the sum of the 16 lanes of a[n]: a transpose tree of 15 adds and 30 shuffles for 16 sums,
// where one horizontal reduction per vector costs ~8 dependent shuffles and adds each.
inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3] of the pair
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum of each of 4 vectors
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // 128-bit lanes 0+1 and 2+3 of 4 vectors, then of the next 4
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// s[0, n_tok) = <q, row n of k>, D a multiple of 16: 16 rows per tile, one accumulator vector per
// row, summed across lanes by sum16. Lanes past n_tok re-read the tile's last row and are not stored.
inline void page_scores16(const float* q, const float* k, int64_t ks, int64_t n_tok, int64_t D, float* s) {
  for (int64_t t0 = 0; t0 < n_tok; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, n_tok - t0);
    __m512 a[16];
    for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < D; j += 16) {
      const __m512 qj = _mm512_loadu_ps(q + j);
      for (int i = 0; i < 16; ++i)
        a[i] = _mm512_fmadd_ps(qj, _mm512_loadu_ps(k + (t0 + std::min<int64_t>(i, n - 1)) * ks + j), a[i]);
    }
    _mm512_mask_storeu_ps(s + t0, lane_mask(n), sum16(a));
  }
}
#endif

// s[n] = <q, row n of k> for n_tok rows (row stride ks). Four rows per pass: four independent
// accumulator chains instead of one latency-bound chain, and q is loaded once for all four.
inline void page_scores(const float* q, const float* k, int64_t ks, int64_t n_tok, int64_t D, float* s) {
#if defined(__AVX512F__)
  if (D % 16 == 0) return page_scores16(q, k, ks, n_tok, D, s);
#endif
  int64_t n = 0;
  for (; n + 4 <= n_tok; n += 4) {
    const float *k0 = k + n * ks, *k1 = k0 + ks, *k2 = k1 + ks, *k3 = k2 + ks;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t j = 0; j < D; ++j) {
      s0 += q[j] * k0[j];
      s1 += q[j] * k1[j];
      s2 += q[j] * k2[j];
      s3 += q[j] * k3[j];
    }
    s[n] = s0, s[n + 1] = s1, s[n + 2] = s2, s[n + 3] = s3;
  }
  for (; n < n_tok; ++n) s[n] = dot(q, k + n * ks, D);
}

// acc += sum_n p[n] * (row n of v); four rows per pass so acc is loaded and stored a quarter as often.
inline void page_accumulate(float* acc, const float* p, const float* v, int64_t vs, int64_t n_tok, int64_t D) {
  int64_t n = 0;
  for (; n + 4 <= n_tok; n += 4) {
    const float *v0 = v + n * vs, *v1 = v0 + vs, *v2 = v1 + vs, *v3 = v2 + vs;
    const float p0 = p[n], p1 = p[n + 1], p2 = p[n + 2], p3 = p[n + 3];
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) acc[j] += p0 * v0[j] + p1 * v1[j] + p2 * v2[j] + p3 * v3[j];
  }
  for (; n < n_tok; ++n) {
    const float pn = p[n];
    const float* vn = v + n * vs;
#pragma omp simd
    for (int64_t j = 0; j < D; ++j) acc[j] += pn * vn[j];
  }
}

// exp(t) for t <= 0, ~2 ulp. std::exp does not vectorise without -ffast-math, and with G query heads
// it costs G calls per K row, as much as the dot products; this is the Cody-Waite range reduction plus
// a degree-6 polynomial, which does (inlined into `omp simd` loops).
inline float exp_nonpositive(float t) {
  t = std::max(t, -87.0f);  // below this exp underflows; keeps 2^k normal
  const float k = std::floor(t * 1.44269504f + 0.5f);  // t = k ln2 + r, |r| <= ln2 / 2
  const float r = (t - k * 0.693359375f) + k * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;  // 2^k
  // a bit cast, not memcpy: a memcpy through the stack stops the vectoriser in some inlining contexts
  return y * __builtin_bit_cast(float, bits);
}

#if defined(__AVX512F__)
// exp_nonpositive on 16 lanes, the same range reduction and polynomial. GCC 12 leaves exp_nonpositive
// scalar inside `omp simd` loops ("no vectype"; perf showed scalar vrndscaless / vfmadd132ss there).
inline __m512 exp_nonpositive16(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_fmadd_ps(t, _mm512_set1_ps(1.44269504f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(k, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), t));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, r), r, r), _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(bits));  // y * 2^k
}
#endif

// x[i] = exp(x[i] - shift) for x[i] - shift <= 0, returning the sum.
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
#if defined(__AVX512F__)
  const __m512 sh = _mm512_set1_ps(shift);
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lane_mask(n - i);
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, x + i), sh));
    _mm512_mask_storeu_ps(x + i, m, e);
    acc = _mm512_mask_add_ps(acc, m, acc, e);  // lanes past n stay out of the sum
  }
  return _mm512_reduce_add_ps(acc);
#else
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    x[i] = exp_nonpositive(x[i] - shift);
    sum += x[i];
  }
  return sum;
#endif
}

// max(x[0, n)), n >= 1.
inline float max_of(const float* x, int64_t n) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 k = lane_mask(n - i);
    m = _mm512_mask_max_ps(m, k, m, _mm512_maskz_loadu_ps(k, x + i));
  }
  return _mm512_reduce_max_ps(m);
#else
  return *std::max_element(x, x + n);
#endif
}

template <typename scalar_t>
inline void prefetch_rows(const scalar_t* src, int64_t n_tok, int64_t row_stride, int64_t D) {
  // Rows of one head sit Hkv*D elements apart, so each is its own stream the hardware
  // prefetcher does not follow across 4 KiB pages; fetch the next page while this one computes.
  const int64_t bytes = D * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t n = 0; n < n_tok; ++n) {
    const char* row = reinterpret_cast<const char*>(src + n * row_stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(row + off, 0, 3);
  }
}

// Rows of one page of one KV head as fp32: fp32 caches are read in place (row stride Hkv*D);
// fp16/bf16 rows are widened into `buf` (row stride D).
template <typename scalar_t>
inline const float* page_rows(const scalar_t* src, int64_t n_tok, int64_t row_stride, int64_t D, float* buf,
                              int64_t* out_stride) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    *out_stride = row_stride;
    return src;
  } else {
    for (int64_t n = 0; n < n_tok; ++n) widen(src + n * row_stride, buf + n * D, D);
    *out_stride = D;
    return buf;
  }
}

// Online-softmax state of R query rows: the scaled queries, the unnormalised output, the running max
// and the running sum (both in natural-log units). Sized once per thread for the most rows it serves.
struct RowState {
  std::vector<float> q, acc, scores, k, v, m, l;
  RowState(int64_t R, int64_t D, int64_t P)
      : q(R * D), acc(R * D), scores(R * P), k(P * D), v(P * D), m(R), l(R) {}

  void reset(int64_t R, int64_t D) {
    std::fill(acc.begin(), acc.begin() + R * D, 0.f);
    std::fill(m.begin(), m.begin() + R, -std::numeric_limits<float>::infinity());
    std::fill(l.begin(), l.begin() + R, 0.f);
  }
};

// n contiguous elements as fp32: copied, or widened from fp16 / bf16.
template <typename scalar_t>
inline void to_fp32(const scalar_t* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    widen(src, dst, n);
  }
}

// q row of width D, widened to fp32 and scaled by sm_scale (scores come out ready for the softmax).
template <typename scalar_t>
inline void load_query(const scalar_t* src, float* dst, int64_t D, float sm_scale) {
  to_fp32(src, dst, D);
  scale(dst, sm_scale, D);
}

// Continue the online softmax of the R rows in `s` (s.q already loaded) over n_pages pages of KV head
// hkv: pages[i] are block ids, every page full but the last, which holds last_len tokens. Each K/V page
// is read (and widened) once for all R rows.
template <typename scalar_t>
void attend_pages(const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* pages, int64_t n_pages,
                  int64_t last_len, int64_t hkv, int64_t Hkv, int64_t D, int64_t P, int64_t R, RowState& s) {
  const int64_t row_stride = Hkv * D;  // between consecutive tokens of a page
  const int64_t page_elems = P * Hkv * D;
  for (int64_t i = 0; i < n_pages; ++i) {
    const int64_t n_tok = i + 1 == n_pages ? last_len : P;
    const int64_t base = static_cast<int64_t>(pages[i]) * page_elems + hkv * D;
    if (i + 1 < n_pages) {
      const int64_t next = static_cast<int64_t>(pages[i + 1]) * page_elems + hkv * D;
      const int64_t next_tok = i + 2 == n_pages ? last_len : P;
      prefetch_rows(k_cache + next, next_tok, row_stride, D);
      prefetch_rows(v_cache + next, next_tok, row_stride, D);
    }
    int64_t ks, vs;
    const float* k = page_rows(k_cache + base, n_tok, row_stride, D, s.k.data(), &ks);
    for (int64_t r = 0; r < R; ++r) {
      float* sr = s.scores.data() + r * P;
      page_scores(s.q.data() + r * D, k, ks, n_tok, D, sr);
      // Online softmax: rescale what was accumulated under the old max.
      const float mx = std::max(s.m[r], max_of(sr, n_tok));
      const float alpha = std::exp(s.m[r] - mx);  // exp(-inf) = 0 on the first page
      s.l[r] = s.l[r] * alpha + exp_shifted_sum(sr, n_tok, mx);
      s.m[r] = mx;
      if (alpha != 1.f) scale(s.acc.data() + r * D, alpha, D);
    }
    const float* v = page_rows(v_cache + base, n_tok, row_stride, D, s.v.data(), &vs);
    for (int64_t r = 0; r < R; ++r) page_accumulate(s.acc.data() + r * D, s.scores.data() + r * P, v, vs, n_tok, D);
  }
}

// The G = H / Hkv query rows of (sequence b, KV head hkv) against that sequence's own pages
// (kv_indptr / kv_indices / kv_last_page_len): s holds their unnormalised state (m, l, acc) after.
// Dims: any struct with H, Hkv, G, D, P and the q strides q_sb, q_sh.
template <typename scalar_t, typename Dims>
void attend_own_pages(const Dims& d, int64_t b, int64_t hkv, const scalar_t* q, const scalar_t* k_cache,
                      const scalar_t* v_cache, const int32_t* kv_indptr, const int32_t* kv_indices,
                      const int32_t* kv_last_page_len, float sm_scale, RowState& s) {
  for (int64_t g = 0; g < d.G; ++g)
    load_query(q + b * d.q_sb + (hkv * d.G + g) * d.q_sh, s.q.data() + g * d.D, d.D, sm_scale);
  s.reset(d.G, d.D);
  const int64_t first = kv_indptr[b];
  attend_pages(k_cache, v_cache, kv_indices + first, kv_indptr[b + 1] - first, kv_last_page_len[b], hkv, d.Hkv, d.D,
               d.P, d.G, s);
}

}  // namespace rlengine_attn

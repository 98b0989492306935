// Paged-KV decode attention on the CPU: one query token per sequence against its paged K/V.
// Shapes: q [B, H, D] (contiguous last dim, any other strides); k_cache, v_cache [num_blocks, P, Hkv, D]
// contiguous (FlashInfer NHD); kv_indptr int32 [B+1], kv_indices int32 [kv_indptr[B]], kv_last_page_len
// int32 [B] in 1..P; out [B, H, D] contiguous in q's dtype, written in place. fp32, fp16 and bf16.
// One work item per (sequence b, KV head): the G = H / Hkv query heads of the GQA group share a single
// pass over that head's K/V rows, page by page, with an online softmax in fp32. fp16/bf16 rows are
// widened into a per-thread fp32 page buffer first, so every inner loop is a contiguous fp32 loop over D
// (four K/V rows per pass, a vectorisable exp, the next page software-prefetched: each measured on
// bf16, 16 x 1024 tokens, about 2x in total over the plain one-row loops with std::exp).
// Simplification: no split-KV; parallelism comes from B * Hkv, which on the CPU decode path (many
// sequences, several KV heads) matches or exceeds the core count; with fewer items than threads,
// cores idle.
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

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

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

// s[n] = <q, row n of k> for n_tok rows (row stride ks). Four rows per pass: four independent
// accumulator chains instead of one latency-bound chain, and q is loaded once for all four.
inline void page_scores(const float* q, const float* k, int64_t ks, int64_t n_tok, int64_t D, float* s) {
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

// x[i] = exp(x[i] - shift) for x[i] - shift <= 0, returning the sum. std::exp does not vectorise
// without -ffast-math, and with G query heads it costs G calls per K row, as much as the dot
// products; this is the Cody-Waite range reduction plus a degree-6 polynomial (~2 ulp), which does.
inline float exp_shifted_sum(float* x, int64_t n, float shift) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) {
    const float t = std::max(x[i] - shift, -87.0f);  // below this exp underflows; keeps 2^k normal
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
    float two_k;
    std::memcpy(&two_k, &bits, sizeof(two_k));
    x[i] = y * two_k;
    sum += x[i];
  }
  return sum;
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

struct Dims {
  int64_t B, H, Hkv, G, D, P;
  int64_t q_sb, q_sh;  // q strides (elements) of the B and H dims
};

// Per-thread scratch, allocated once per parallel chunk.
struct Scratch {
  std::vector<float> q, acc, scores, k, v, m, l;
  explicit Scratch(const Dims& d)
      : q(d.G * d.D), acc(d.G * d.D), scores(d.G * d.P), k(d.P * d.D), v(d.P * d.D), m(d.G), l(d.G) {}
};

template <typename scalar_t>
void decode_group(const Dims& d, int64_t b, int64_t hkv, const scalar_t* q, const scalar_t* k_cache,
                  const scalar_t* v_cache, const int32_t* kv_indptr, const int32_t* kv_indices,
                  const int32_t* kv_last_page_len, float sm_scale, scalar_t* out, Scratch& s) {
  const int64_t G = d.G, D = d.D, P = d.P;
  const int64_t row_stride = d.Hkv * D;  // between consecutive tokens of a page
  // Query rows of the group, pre-scaled so scores come out ready for the softmax.
  for (int64_t g = 0; g < G; ++g) {
    const scalar_t* qg = q + b * d.q_sb + (hkv * G + g) * d.q_sh;
    float* dst = s.q.data() + g * D;
    if constexpr (std::is_same_v<scalar_t, float>) {
      std::memcpy(dst, qg, D * sizeof(float));
    } else {
      widen(qg, dst, D);
    }
    scale(dst, sm_scale, D);
  }
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  std::fill(s.m.begin(), s.m.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.l.begin(), s.l.end(), 0.f);

  const int64_t first = kv_indptr[b], last = kv_indptr[b + 1];
  const int64_t page_elems = P * d.Hkv * D;
  for (int64_t i = first; i < last; ++i) {
    const int64_t n_tok = i + 1 == last ? kv_last_page_len[b] : P;
    const int64_t base = static_cast<int64_t>(kv_indices[i]) * page_elems + hkv * D;
    if (i + 1 < last) {
      const int64_t next = static_cast<int64_t>(kv_indices[i + 1]) * page_elems + hkv * D;
      const int64_t next_tok = i + 2 == last ? kv_last_page_len[b] : P;
      prefetch_rows(k_cache + next, next_tok, row_stride, D);
      prefetch_rows(v_cache + next, next_tok, row_stride, D);
    }
    int64_t ks, vs;
    const float* k = page_rows(k_cache + base, n_tok, row_stride, D, s.k.data(), &ks);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = s.scores.data() + g * P;
      page_scores(s.q.data() + g * D, k, ks, n_tok, D, sg);
      // Online softmax: rescale what was accumulated under the old max.
      const float mx = std::max(s.m[g], *std::max_element(sg, sg + n_tok));
      const float alpha = std::exp(s.m[g] - mx);  // exp(-inf) = 0 on the first page
      s.l[g] = s.l[g] * alpha + exp_shifted_sum(sg, n_tok, mx);
      s.m[g] = mx;
      if (alpha != 1.f) scale(s.acc.data() + g * D, alpha, D);
    }
    const float* v = page_rows(v_cache + base, n_tok, row_stride, D, s.v.data(), &vs);
    for (int64_t g = 0; g < G; ++g) page_accumulate(s.acc.data() + g * D, s.scores.data() + g * P, v, vs, n_tok, D);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / s.l[g];  // l >= 1: the max-scoring token contributes exp(0)
    const float* a = s.acc.data() + g * D;
    scalar_t* o = out + (b * d.H + hkv * G + g) * D;
    for (int64_t j = 0; j < D; ++j) o[j] = static_cast<scalar_t>(a[j] * inv);
  }
}

template <typename scalar_t>
void run(const Dims& d, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const torch::Tensor& kv_indptr, const torch::Tensor& kv_indices, const torch::Tensor& kv_last_page_len,
         float sm_scale, torch::Tensor& out) {
  const auto* qp = static_cast<const scalar_t*>(q.data_ptr());
  const auto* kp = static_cast<const scalar_t*>(k_cache.data_ptr());
  const auto* vp = static_cast<const scalar_t*>(v_cache.data_ptr());
  auto* op = static_cast<scalar_t*>(out.data_ptr());
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* last_len = kv_last_page_len.data_ptr<int32_t>();
  // Small steps (e.g. B_act = 1 with a short context) run on one thread: an OpenMP fork/join costs
  // more than the whole item list. work ~ multiply-adds of the QK^T and PV products.
  const int64_t work = static_cast<int64_t>(indptr[d.B] - indptr[0]) * d.P * d.H * d.D * 2;
  const int64_t grain = work < (int64_t{1} << 20) ? std::max<int64_t>(1, d.B * d.Hkv) : 1;
  at::parallel_for(0, d.B * d.Hkv, grain, [&](int64_t begin, int64_t end) {
    Scratch scratch(d);
    for (int64_t item = begin; item < end; ++item) {
      decode_group<scalar_t>(d, item / d.Hkv, item % d.Hkv, qp, kp, vp, indptr, indices, last_len, sm_scale, op,
                             scratch);
    }
  });
}

void check_tables(const torch::Tensor& kv_indptr, const torch::Tensor& kv_indices,
                  const torch::Tensor& kv_last_page_len, int64_t B, int64_t P, int64_t num_blocks) {
  const int32_t* indptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* indices = kv_indices.data_ptr<int32_t>();
  const int32_t* last_len = kv_last_page_len.data_ptr<int32_t>();
  TORCH_CHECK(indptr[0] >= 0 && indptr[B] <= kv_indices.size(0), "paged_decode: kv_indptr spans [", indptr[0], ", ",
              indptr[B], ") but kv_indices has ", kv_indices.size(0), " entries");
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(indptr[b + 1] > indptr[b], "paged_decode: kv_indptr gives sequence ", b, " ",
                indptr[b + 1] - indptr[b], " pages; every sequence needs >= 1");
    TORCH_CHECK(last_len[b] >= 1 && last_len[b] <= P, "paged_decode: kv_last_page_len[", b, "] = ", last_len[b],
                " is outside 1..P = 1..", P);
    for (int64_t i = indptr[b]; i < indptr[b + 1]; ++i) {
      TORCH_CHECK(indices[i] >= 0 && indices[i] < num_blocks, "paged_decode: kv_indices[", i, "] = ", indices[i],
                  " is outside the cache (", num_blocks, " blocks)");
    }
  }
}

void paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                  const torch::Tensor& kv_indptr, const torch::Tensor& kv_indices,
                  const torch::Tensor& kv_last_page_len, double sm_scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3, "paged_decode: q must be [B, H, D], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode: k_cache and v_cache must both be [num_blocks, P, Hkv, D], got ", k_cache.sizes(),
              " and ", v_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), P = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "paged_decode: head dim of q (", D, ") differs from k_cache's (",
              k_cache.size(3), ")");
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "paged_decode: q heads H=", H, " must be a multiple of k_cache heads Hkv=",
              Hkv);
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "paged_decode: q dtype must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "paged_decode: k_cache/v_cache dtype (", k_cache.scalar_type(), "/", v_cache.scalar_type(),
              ") differs from q dtype ", dtype);
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == dtype, "paged_decode: out must be ", dtype, " ",
              q.sizes(), ", got ", out.scalar_type(), " ", out.sizes());
  for (const auto* t : {&q, &k_cache, &v_cache, &kv_indptr, &kv_indices, &kv_last_page_len}) {
    TORCH_CHECK(t->device().is_cpu(), "paged_decode: all inputs must be CPU tensors");
  }
  TORCH_CHECK(out.device().is_cpu(), "paged_decode: out must be a CPU tensor");
  TORCH_CHECK(q.stride(2) == 1, "paged_decode: q needs a contiguous head dim, strides ", q.strides());
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode: k_cache and v_cache must be contiguous");
  TORCH_CHECK(out.is_contiguous(), "paged_decode: out must be contiguous");
  TORCH_CHECK(kv_indptr.scalar_type() == at::kInt && kv_indptr.dim() == 1 && kv_indptr.size(0) == B + 1 &&
                  kv_indptr.is_contiguous(),
              "paged_decode: kv_indptr must be contiguous int32 [B+1] = [", B + 1, "], got ",
              kv_indptr.scalar_type(), " ", kv_indptr.sizes());
  TORCH_CHECK(kv_indices.scalar_type() == at::kInt && kv_indices.dim() == 1 && kv_indices.is_contiguous(),
              "paged_decode: kv_indices must be contiguous int32 [num_pages], got ", kv_indices.scalar_type(), " ",
              kv_indices.sizes());
  TORCH_CHECK(kv_last_page_len.scalar_type() == at::kInt && kv_last_page_len.dim() == 1 &&
                  kv_last_page_len.size(0) == B && kv_last_page_len.is_contiguous(),
              "paged_decode: kv_last_page_len must be contiguous int32 [B] = [", B, "], got ",
              kv_last_page_len.scalar_type(), " ", kv_last_page_len.sizes());
  if (B == 0 || H == 0) return;
  check_tables(kv_indptr, kv_indices, kv_last_page_len, B, P, num_blocks);

  const Dims d{B, H, Hkv, H / Hkv, D, P, q.stride(0), q.stride(1)};
  const auto sc = static_cast<float>(sm_scale);
  switch (dtype) {
    case at::kFloat: run<float>(d, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sc, out); break;
    case at::kHalf: run<c10::Half>(d, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sc, out); break;
    default: run<c10::BFloat16>(d, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sc, out); break;
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor kv_indptr, Tensor kv_indices, "
      "Tensor kv_last_page_len, float sm_scale, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(rlengine, CPU, m) {
  m.impl("paged_decode", &paged_decode);
}

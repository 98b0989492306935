// Causal attention of packed variable-length sequences on the CPU, the engine's prefill (no autograd):
//   prefill_attention(q[T, H, D], k[T, Hkv, D], v[T, Hkv, D], cu_seqlens[B+1] int64, scale) -> o[T, H, D]
// fp32 or bf16 (o in q's dtype, contiguous; fp32 inside, one rounding per output), D a multiple of 16
// up to 256, H a multiple of Hkv, the last dim contiguous (any row and head strides: v may be a slice
// of the fused qkv projection). Registered in AVX-512 builds only; the caller keeps torch's SDPA where
// the op is missing, and model/attention.py runs it only where it was measured faster (kernel choice).
//
// Why: torch's CPU SDPA (its flash kernel) ran qwen3-0.6b's causal attention (16 x 8 heads of 128) at
// ~40 GFLOP/s at 512 tokens on one core of a 2-core EPYC, fp32 and bf16 alike, while the projections
// around it ran near the core's ~95. Here one work item is (sequence, KV head, block of query positions),
// the G query heads of the group stacked as the block's rows (token-major), so every K / V row loaded
// serves G * Bq query rows:
//   - K once per (key block of kBk, KV head), transposed: fp32 [D, keys], or for bf16 with AVX512-BF16
//     [D / 2, keys] of bf16 pairs;
//   - scores by a register-blocked kernel (8 rows x 32 keys, the query element broadcast into the FMA,
//     or the query pair into vdpbf16ps: 32 exact products per instruction), only up to the block's last
//     causal key;
//   - the online softmax per row (running max and sum, exp_nonpositive16), the causal cut per row;
//   - P V by a second register-blocked kernel (4 rows x 64 dims, fp32: bf16 V widened once), up to each
//     row group's last key.
// Items run on at::parallel_for in an order that pairs early (short) and late (long) query blocks.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "paged_attention.h"  // to_fp32, load_query, exp_shifted_sum, max_of, exp_nonpositive

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define RLENGINE_PREFILL_AVX512 1
#if defined(__AVX512BF16__)
#define RLENGINE_PREFILL_DPBF16 1
#endif
#endif

#if defined(RLENGINE_PREFILL_AVX512)
namespace {

constexpr int64_t kBk = 256;       // keys per block (the transposed K tile and the score rows)
constexpr int64_t kMaxD = 256;
constexpr int64_t kRowsS = 8;      // score kernel: rows per tile
constexpr int64_t kKeysS = 32;     // score kernel: keys per tile (two vectors)
constexpr int64_t kRowsPV = 4;     // P V kernel: rows per tile
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
#if defined(RLENGINE_PREFILL_DPBF16)
constexpr bool kDpbf16 = true;
#else
constexpr bool kDpbf16 = false;
#endif

// Query positions per item and head: G * Bq rows share each K / V row; 64-128 rows keep the buffers
// (rows x kBk scores, rows x D queries and outputs) within a core's L2.
int64_t query_block(int64_t G) { return std::max<int64_t>(16, 64 / G); }

struct Buffers {
  std::vector<float> q, o, s, m, l;
  std::vector<int64_t> nk_rows;
  Buffers(int64_t R, int64_t D) : q(R * D), o(R * D), s(R * kBk), m(R), l(R), nk_rows(R) {}
};

// s[r, 0..nk_pad) = q[r] . kt[:, n] for r < R. fp32: kt is [D, kBk] and q comes scaled. bf16 pairs
// (AVX512-BF16 builds): kt is [D / 2, kBk] of bf16 pairs (k[n][2j], k[n][2j + 1]), q is the bf16 row as W = D / 2
// pairs, and vdpbf16ps takes 32 products per instruction (exact in fp32: 8-bit significands), summed in
// fp32; the scale multiplies the sums. kt is zero past the block's keys; nk_pad is a multiple of kKeysS.
template <int NR, typename kt_t>
inline void score_tile(const kt_t* q, int64_t W, const kt_t* kt, float* s, int64_t n0, float scale) {
  __m512 a0[NR], a1[NR];
  for (int r = 0; r < NR; ++r) a0[r] = a1[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < W; ++d) {
    if constexpr (std::is_same_v<kt_t, float>) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * kBk + n0), k1 = _mm512_loadu_ps(kt + d * kBk + n0 + 16);
      for (int r = 0; r < NR; ++r) {
        const __m512 qr = _mm512_set1_ps(q[r * W + d]);
        a0[r] = _mm512_fmadd_ps(qr, k0, a0[r]);
        a1[r] = _mm512_fmadd_ps(qr, k1, a1[r]);
      }
    } else {
#if defined(RLENGINE_PREFILL_DPBF16)
      const auto k0 = (__m512bh)_mm512_loadu_si512(kt + d * kBk + n0);
      const auto k1 = (__m512bh)_mm512_loadu_si512(kt + d * kBk + n0 + 16);
      for (int r = 0; r < NR; ++r) {
        const auto qr = (__m512bh)_mm512_set1_epi32(static_cast<int>(q[r * W + d]));
        a0[r] = _mm512_dpbf16_ps(a0[r], qr, k0);
        a1[r] = _mm512_dpbf16_ps(a1[r], qr, k1);
      }
#endif
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int r = 0; r < NR; ++r) {
    _mm512_storeu_ps(s + r * kBk + n0, std::is_same_v<kt_t, float> ? a0[r] : _mm512_mul_ps(a0[r], sc));
    _mm512_storeu_ps(s + r * kBk + n0 + 16, std::is_same_v<kt_t, float> ? a1[r] : _mm512_mul_ps(a1[r], sc));
  }
}

template <typename kt_t>
void scores(const kt_t* q, int64_t R, int64_t W, const kt_t* kt, int64_t nk_pad, float* s, float scale) {
  for (int64_t n0 = 0; n0 < nk_pad; n0 += kKeysS) {
    int64_t r = 0;
    for (; r + kRowsS <= R; r += kRowsS) score_tile<kRowsS>(q + r * W, W, kt, s + r * kBk, n0, scale);
    switch (R - r) {
      case 7: score_tile<7>(q + r * W, W, kt, s + r * kBk, n0, scale); break;
      case 6: score_tile<6>(q + r * W, W, kt, s + r * kBk, n0, scale); break;
      case 5: score_tile<5>(q + r * W, W, kt, s + r * kBk, n0, scale); break;
      case 4: score_tile<4>(q + r * W, W, kt, s + r * kBk, n0, scale); break;
      case 3: score_tile<3>(q + r * W, W, kt, s + r * kBk, n0, scale); break;
      case 2: score_tile<2>(q + r * W, W, kt, s + r * kBk, n0, scale); break;
      case 1: score_tile<1>(q + r * W, W, kt, s + r * kBk, n0, scale); break;
      default: break;
    }
  }
}

// o[r, :] += sum_{n < nk} p[r, n] * v[n, :] for NR rows; p's rows are zero past each row's causal cut.
template <int NR>
inline void pv_tile(const float* p, const float* v, int64_t vs, int64_t nk, int64_t D, float* o) {
  for (int64_t d0 = 0; d0 < D; d0 += 64) {
    const int nv = static_cast<int>(std::min<int64_t>(4, (D - d0) / 16));
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < nv; ++j) acc[r][j] = _mm512_loadu_ps(o + r * D + d0 + 16 * j);
    for (int64_t n = 0; n < nk; ++n) {
      const float* vn = v + n * vs + d0;
      if (nv == 4) {
        const __m512 v0 = _mm512_loadu_ps(vn), v1 = _mm512_loadu_ps(vn + 16), v2 = _mm512_loadu_ps(vn + 32),
                     v3 = _mm512_loadu_ps(vn + 48);
        for (int r = 0; r < NR; ++r) {
          const __m512 pr = _mm512_set1_ps(p[r * kBk + n]);
          acc[r][0] = _mm512_fmadd_ps(pr, v0, acc[r][0]);
          acc[r][1] = _mm512_fmadd_ps(pr, v1, acc[r][1]);
          acc[r][2] = _mm512_fmadd_ps(pr, v2, acc[r][2]);
          acc[r][3] = _mm512_fmadd_ps(pr, v3, acc[r][3]);
        }
      } else {
        for (int j = 0; j < nv; ++j) {
          const __m512 vj = _mm512_loadu_ps(vn + 16 * j);
          for (int r = 0; r < NR; ++r) acc[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(p[r * kBk + n]), vj, acc[r][j]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int j = 0; j < nv; ++j) _mm512_storeu_ps(o + r * D + d0 + 16 * j, acc[r][j]);
  }
}

// nk_rows[r]: keys row r attends to in this block (its causal cut).
void accumulate(const float* p, const float* v, int64_t vs, const int64_t* nk_rows, int64_t R, int64_t D, float* o) {
  int64_t r = 0;
  for (; r + kRowsPV <= R; r += kRowsPV) {
    const int64_t nk = *std::max_element(nk_rows + r, nk_rows + r + kRowsPV);
    if (nk > 0) pv_tile<kRowsPV>(p + r * kBk, v, vs, nk, D, o + r * D);
  }
  for (; r < R; ++r)
    if (nk_rows[r] > 0) pv_tile<1>(p + r * kBk, v, vs, nk_rows[r], D, o + r * D);
}

using rlengine_attn::to_fp32;

struct Dims {
  int64_t H, Hkv, G, D, Bq;
  int64_t qs0, qs1, ks0, ks1, vs0, vs1;  // row and head strides (elements)
};

// The packed K element: bf16 pairs where the build has vdpbf16ps, else fp32.
template <typename scalar_t>
using kt_t = std::conditional_t<std::is_same_v<scalar_t, c10::BFloat16> && kDpbf16, uint32_t, float>;

struct Item {
  int64_t start, len, head, q0;  // sequence rows [start, start + len), KV head, first query position
  const void* kt;                 // the sequence's K of this head as [key blocks][W, kBk] (kt_t, transposed)
};

// One item: query positions [q0, q1) of one sequence, the G heads of KV head `head`.
template <typename scalar_t>
void run_item(const Dims& d, const Item& it, const scalar_t* q, const float* v, int64_t vs0, int64_t vs1, float scale,
              scalar_t* out, Buffers& b) {
  using K = kt_t<scalar_t>;
  constexpr bool pairs = std::is_same_v<K, uint32_t>;
  const int64_t G = d.G, D = d.D, W = pairs ? D / 2 : D, q1 = std::min(it.len, it.q0 + d.Bq), R = G * (q1 - it.q0);
  int64_t* nk_rows = b.nk_rows.data();
  K* qb = reinterpret_cast<K*>(b.q.data());
  for (int64_t t = it.q0; t < q1; ++t)
    for (int64_t g = 0; g < G; ++g) {  // row (t - q0) * G + g: token-major, the group's heads adjacent
      const scalar_t* src = q + (it.start + t) * d.qs0 + (it.head * G + g) * d.qs1;
      K* dst = qb + ((t - it.q0) * G + g) * W;
      if constexpr (pairs) {
        std::memcpy(dst, src, D * sizeof(scalar_t));  // the bf16 row as D / 2 pairs; scaled after the dot products
      } else {
        rlengine_attn::load_query(src, dst, D, scale);
      }
    }
  std::fill(b.o.begin(), b.o.begin() + R * D, 0.f);
  std::fill(b.m.begin(), b.m.begin() + R, kNegInf);
  std::fill(b.l.begin(), b.l.begin() + R, 0.f);
  for (int64_t c = 0; c < q1; c += kBk) {  // key blocks up to the last query's position
    const int64_t nk = std::min(kBk, q1 - c), nk_pad = (nk + kKeysS - 1) / kKeysS * kKeysS;
    scores<K>(qb, R, W, static_cast<const K*>(it.kt) + (c / kBk) * d.Hkv * W * kBk, nk_pad, b.s.data(), scale);
    for (int64_t r = 0; r < R; ++r) {
      const int64_t t = it.q0 + r / G;
      const int64_t n_valid = std::clamp<int64_t>(t - c + 1, 0, nk);
      nk_rows[r] = n_valid;
      float* sr = b.s.data() + r * kBk;
      if (n_valid == 0) {  // no key of this block is causal for the row: it adds nothing
        std::fill(sr, sr + nk, 0.f);
        continue;
      }
      const float m_new = std::max(b.m[r], rlengine_attn::max_of(sr, n_valid));
      const float alpha = b.m[r] == kNegInf ? 0.f : rlengine_attn::exp_nonpositive(b.m[r] - m_new);
      const float sum = rlengine_attn::exp_shifted_sum(sr, n_valid, m_new);
      std::fill(sr + n_valid, sr + nk, 0.f);
      if (alpha != 1.f)
        for (int64_t j = 0; j < D; ++j) b.o[r * D + j] *= alpha;
      b.l[r] = b.l[r] * alpha + sum;
      b.m[r] = m_new;
    }
    accumulate(b.s.data(), v + (it.start + c) * vs0 + it.head * vs1, vs0, nk_rows, R, D, b.o.data());
  }
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = it.q0 + r / G, h = it.head * G + r % G;
    const float inv = 1.f / b.l[r];
    scalar_t* dst = out + ((it.start + t) * d.H + h) * D;
    for (int64_t j = 0; j < D; ++j) dst[j] = static_cast<scalar_t>(b.o[r * D + j] * inv);
  }
}

// Every (sequence, KV head, query block), the query blocks of a sequence in the order first, last,
// second, second to last, ...: contiguous shares of the list then hold a similar number of keys.
template <typename K>
std::vector<Item> items(const std::vector<int64_t>& cu, const std::vector<int64_t>& blk0, int64_t Hkv, int64_t W,
                        int64_t Bq, const K* kt) {
  std::vector<Item> out;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    const int64_t len = cu[s + 1] - cu[s], nb = (len + Bq - 1) / Bq;
    for (int64_t i = 0; i < nb; ++i) {
      const int64_t blk = i % 2 == 0 ? i / 2 : nb - 1 - i / 2;
      for (int64_t h = 0; h < Hkv; ++h) out.push_back({cu[s], len, h, blk * Bq, kt + (blk0[s] * Hkv + h) * W * kBk});
    }
  }
  return out;
}

template <typename scalar_t>
void run(const Dims& d, const std::vector<int64_t>& cu, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
         float scale, at::Tensor& out) {
  const int64_t D = d.D, Hkv = d.Hkv, T = q.size(0);
  // K once per (key block, KV head) as fp32 [D, kBk], zero past the sequence: every query block reads it
  std::vector<int64_t> blk0(cu.size()), blk_start, blk_len;
  for (size_t s = 0; s + 1 < cu.size(); ++s) {
    blk0[s] = static_cast<int64_t>(blk_start.size());
    for (int64_t c = cu[s]; c < cu[s + 1]; c += kBk) blk_start.push_back(c), blk_len.push_back(std::min(kBk, cu[s + 1] - c));
  }
  const int64_t nblk = static_cast<int64_t>(blk_start.size());
  using K = kt_t<scalar_t>;
  constexpr bool pairs = std::is_same_v<K, uint32_t>;
  const int64_t W = pairs ? D / 2 : D;
  auto kt_all = at::empty({nblk * Hkv * W * kBk}, q.options().dtype(pairs ? at::kInt : at::kFloat));
  K* ktp = reinterpret_cast<K*>(kt_all.data_ptr());
  const scalar_t* kp = k.data_ptr<scalar_t>();
  at::parallel_for(0, nblk * Hkv, 1, [&](int64_t u0, int64_t u1) {
    K row[kMaxD];
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t blk = u / Hkv, h = u % Hkv;
      K* dst = ktp + u * W * kBk;
      const int64_t n_pad = (blk_len[blk] + kKeysS - 1) / kKeysS * kKeysS;  // what the score tiles read
      for (int64_t n = 0; n < n_pad; ++n) {
        const scalar_t* src = kp + (blk_start[blk] + n) * d.ks0 + h * d.ks1;
        if (n >= blk_len[blk]) {
          std::fill(row, row + W, K(0));
        } else if constexpr (pairs) {
          std::memcpy(row, src, D * sizeof(scalar_t));
        } else {
          to_fp32(src, row, D);
        }
        for (int64_t j = 0; j < W; ++j) dst[j * kBk + n] = row[j];
      }
    }
  });
  // V as fp32 rows: fp32 read in place, bf16 widened once
  at::Tensor v32;
  const float* vp;
  int64_t vs0, vs1;
  if constexpr (std::is_same_v<scalar_t, float>) {
    vp = v.data_ptr<float>(), vs0 = d.vs0, vs1 = d.vs1;
  } else {
    v32 = at::empty({T, Hkv, D}, q.options().dtype(at::kFloat));
    float* v32p = v32.data_ptr<float>();
    const scalar_t* vsrc = v.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < Hkv; ++h) to_fp32(vsrc + t * d.vs0 + h * d.vs1, v32p + (t * Hkv + h) * D, D);
    });
    vp = v32p, vs0 = Hkv * D, vs1 = D;
  }
  const auto list = items<K>(cu, blk0, Hkv, W, d.Bq, ktp);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, static_cast<int64_t>(list.size()), 1, [&](int64_t i0, int64_t i1) {
    Buffers b(d.G * d.Bq, D);
    for (int64_t i = i0; i < i1; ++i) run_item<scalar_t>(d, list[i], qp, vp, vs0, vs1, scale, op, b);
  });
}

at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                             double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: q, k, v must be [T, heads, D], got ",
              q.sizes(), " ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu() && cu_seqlens.device().is_cpu(),
              "prefill_attention: CPU tensors only");
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k.scalar_type() == dtype && v.scalar_type() == dtype,
              "prefill_attention: q, k, v must all be float32 or all bfloat16");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1);
  TORCH_CHECK(k.size(0) == T && v.size(0) == T && v.size(1) == Hkv && k.size(2) == D && v.size(2) == D,
              "prefill_attention: k and v must be [T, Hkv, D] with q's T and D, got ", k.sizes(), " ", v.sizes());
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, "prefill_attention: H (", H, ") must be a multiple of Hkv (", Hkv, ")");
  TORCH_CHECK(D % 16 == 0 && D > 0 && D <= kMaxD, "prefill_attention: D must be a multiple of 16 up to ", kMaxD,
              ", got ", D);
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: the last dim must be contiguous");
  TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.scalar_type() == at::kLong && cu_seqlens.size(0) >= 1,
              "prefill_attention: cu_seqlens must be a 1-D int64 tensor");
  const auto cu_c = cu_seqlens.contiguous();
  const int64_t* cp = cu_c.data_ptr<int64_t>();
  std::vector<int64_t> cu(cp, cp + cu_c.size(0));
  TORCH_CHECK(cu.front() == 0 && cu.back() == T, "prefill_attention: cu_seqlens must run from 0 to T (", T, ")");
  for (size_t i = 0; i + 1 < cu.size(); ++i)
    TORCH_CHECK(cu[i] <= cu[i + 1], "prefill_attention: cu_seqlens must be non-decreasing");
  auto out = at::empty({T, H, D}, q.options().memory_format(at::MemoryFormat::Contiguous));
  if (T == 0 || H == 0) return out;
  const int64_t G = H / Hkv;
  const Dims d{H, Hkv, G, D, query_block(G), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1)};
  const auto sc = static_cast<float>(scale);
  if (dtype == at::kFloat) {
    run<float>(d, cu, q, k, v, sc, out);
  } else {
    run<c10::BFloat16>(d, cu, q, k, v, sc, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlengine, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
#endif  // RLENGINE_PREFILL_AVX512

// Cascade (shared-prefix) decode attention on the CPU: the G samples of a GRPO group share their
// prompt's KV pages, so attention is split in two passes merged by log-sum-exp.
//   1. prefix: one work item per (chunk, KV head). A chunk is a run of consecutive batch rows whose
//      block tables start with the same full pages; its rows * (H / Hkv) query rows are scored
//      together against each shared K/V page, read (and widened) once instead of once per row, as
//      register-blocked products over tiles of 64 prefix tokens (prefix_pass_tiles, below).
//      Each row's normalised output and natural-log LSE go to prefix_out [B, H, D] / prefix_lse [B, H].
//   2. suffix: one work item per (sequence, KV head) over the sequence's own pages (kv_indptr /
//      kv_indices / kv_last_page_len, FlashInfer CSR), then merged with its prefix part:
//      o = (w1 o1 + w2 o2) / (w1 + w2), w_i = exp(lse_i - max(lse1, lse2)) (max-subtracted: scores
//      that reach the exp range would overflow otherwise).
// Shapes: q [B, H, D] (contiguous last dim); k_cache, v_cache [num_blocks, P, Hkv, D] contiguous;
// chunk_indptr int32 [C+1] (batch rows of chunk c: chunk_indptr[c]..chunk_indptr[c+1], covering 0..B);
// prefix_indptr int32 [C+1] into prefix_indices int32 (full pages; a chunk with none reads no prefix);
// out [B, H, D] contiguous, written in place; prefix_out / prefix_lse fp32 scratch the caller owns.
// Rows of chunks without a prefix are plain paged decode (no merge).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "paged_attention.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using namespace rlengine_attn;

struct CascadeDims {
  int64_t B, H, Hkv, G, D, P, C, max_rows;  // max_rows: most batch rows in one chunk
  int64_t q_sb, q_sh;
};

// ---- pass 1 as small matrix products
// A chunk's R = rows * G query rows all read the same prefix pages, so per tile of T prefix tokens the
// scores are S^T [T, R] = K [T, D] Q^T [D, R] and the output update acc [R, D] += P [R, T] V [T, D].
// Scoring one row against one key at a time (attend_pages) ends every dot product in a horizontal sum
// and reloads K per row (~20 GFLOP/s on two cores). Here Q is transposed once per chunk (Qt [D, Rpad],
// query rows along the vector lanes, zero-padded to a multiple of kLanes) and K / V rows are read in
// place, each element broadcast against a block of query rows: register-blocked FMAs with no
// horizontal sums, and the online softmax runs across lanes too (one update per tile, not per page).
// Register blocks, accumulators only: kKeyBlock keys x kLanes rows for the scores, kPvRows rows x
// kPvLanes output columns for P V.
constexpr int64_t kLanes = 16;
constexpr int64_t kTileTokens = 64;  // prefix tokens per online-softmax update (whole pages, >= one)

#if defined(__AVX512F__)
// AVX-512 register blocks, written out: GCC's auto-vectoriser picks 256-bit vectors on these CPUs.
// Scores: 8 keys x 2 zmm of query lanes; P V: 4 rows x 4 zmm of output columns (16 accumulators each,
// of the 32 zmm registers; 8-accumulator blocks took ~15% longer on a Xeon with AVX-512).
constexpr int kKeyBlock = 8, kPvRows = 4, kPvLanes = 64;

template <int KB, int NL>
inline void tile_scores_block(const float* const* krows, const float* qt, int64_t D, int64_t Rpad, int64_t r0,
                              float* st) {
  __m512 acc[KB][NL];
  for (int k = 0; k < KB; ++k)
    for (int l = 0; l < NL; ++l) acc[k][l] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 qv[NL];
    for (int l = 0; l < NL; ++l) qv[l] = _mm512_loadu_ps(qt + d * Rpad + r0 + l * 16);
    for (int k = 0; k < KB; ++k) {
      const __m512 kv = _mm512_set1_ps(krows[k][d]);
      for (int l = 0; l < NL; ++l) acc[k][l] = _mm512_fmadd_ps(kv, qv[l], acc[k][l]);
    }
  }
  for (int k = 0; k < KB; ++k)
    for (int l = 0; l < NL; ++l) _mm512_storeu_ps(st + k * Rpad + r0 + l * 16, acc[k][l]);
}

// st [KB, Rpad] (row stride Rpad) = krows[0..KB) [D] . qt [D, Rpad]
template <int KB>
inline void tile_scores(const float* const* krows, const float* qt, int64_t D, int64_t Rpad, float* st) {
  int64_t r0 = 0;
  for (; r0 + 32 <= Rpad; r0 += 32) tile_scores_block<KB, 2>(krows, qt, D, Rpad, r0, st);
  for (; r0 < Rpad; r0 += 16) tile_scores_block<KB, 1>(krows, qt, D, Rpad, r0, st);
}

// acc [RB rows, L columns from d0] (row stride D) += pt [T, RB rows] (row stride Rpad) . vrows [T][d0..d0+L)
template <int RB, int L>
inline void tile_pv(const float* pt, int64_t Rpad, const float* const* vrows, int64_t T, int64_t d0, float* acc,
                    int64_t D) {
  constexpr int NL = L / 16;
  __m512 a[RB][NL];
  for (int r = 0; r < RB; ++r)
    for (int l = 0; l < NL; ++l) a[r][l] = _mm512_loadu_ps(acc + r * D + d0 + l * 16);
  for (int64_t n = 0; n < T; ++n) {
    __m512 vv[NL];
    for (int l = 0; l < NL; ++l) vv[l] = _mm512_loadu_ps(vrows[n] + d0 + l * 16);
    for (int r = 0; r < RB; ++r) {
      const __m512 p = _mm512_set1_ps(pt[n * Rpad + r]);
      for (int l = 0; l < NL; ++l) a[r][l] = _mm512_fmadd_ps(p, vv[l], a[r][l]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int l = 0; l < NL; ++l) _mm512_storeu_ps(acc + r * D + d0 + l * 16, a[r][l]);
}
#else
// Portable register blocks (auto-vectorised): KB keys x kLanes query lanes, RB rows x L output columns.
constexpr int kKeyBlock = 4, kPvRows = 4, kPvLanes = 16;

template <int KB>
inline void tile_scores(const float* const* krows, const float* qt, int64_t D, int64_t Rpad, float* st) {
  for (int64_t r0 = 0; r0 < Rpad; r0 += kLanes) {
    float acc[KB][kLanes] = {};
    for (int64_t d = 0; d < D; ++d) {
      const float* qd = qt + d * Rpad + r0;
      for (int k = 0; k < KB; ++k) {
        const float kv = krows[k][d];
#pragma omp simd
        for (int64_t j = 0; j < kLanes; ++j) acc[k][j] += kv * qd[j];
      }
    }
    for (int k = 0; k < KB; ++k) std::memcpy(st + k * Rpad + r0, acc[k], sizeof(acc[k]));
  }
}

template <int RB, int L>
inline void tile_pv(const float* pt, int64_t Rpad, const float* const* vrows, int64_t T, int64_t d0, float* acc,
                    int64_t D) {
  float a[RB][L];
  for (int r = 0; r < RB; ++r) std::memcpy(a[r], acc + r * D + d0, sizeof(a[r]));
  for (int64_t n = 0; n < T; ++n) {
    const float* vn = vrows[n] + d0;
    for (int r = 0; r < RB; ++r) {
      const float p = pt[n * Rpad + r];
#pragma omp simd
      for (int j = 0; j < L; ++j) a[r][j] += p * vn[j];
    }
  }
  for (int r = 0; r < RB; ++r) std::memcpy(acc + r * D + d0, a[r], sizeof(a[r]));
}
#endif

template <int RB>
inline void tile_pv_rows(const float* pt, int64_t Rpad, const float* const* vrows, int64_t T, float* acc, int64_t D) {
  int64_t d0 = 0;
  for (; d0 + kPvLanes <= D; d0 += kPvLanes) tile_pv<RB, kPvLanes>(pt, Rpad, vrows, T, d0, acc, D);
  for (; d0 < D; d0 += kLanes) tile_pv<RB, kLanes>(pt, Rpad, vrows, T, d0, acc, D);  // D % kLanes == 0
}

// Per-thread state of the prefix pass: Qt, the tile's scores / probabilities, the unnormalised output,
// the running max and sum per query row, and fp32 copies of the tile's K / V rows for fp16 / bf16.
struct PrefixState {
  int64_t Rpad, T;
  std::vector<float> qt, st, acc, m, l, tile_max, tile_sum, kbuf, vbuf;
  std::vector<const float*> krows, vrows;
  PrefixState(int64_t R, int64_t D, int64_t T_)
      : Rpad((R + kLanes - 1) / kLanes * kLanes), T(T_), qt(D * Rpad), st(T * Rpad), acc(R * D), m(Rpad), l(Rpad),
        tile_max(Rpad), tile_sum(Rpad), kbuf(T * D), vbuf(T * D), krows(T), vrows(T) {}
};

// Pointers to the tile's n_tok K and V rows of KV head hkv as fp32 (in place, or widened into kbuf / vbuf).
template <typename scalar_t>
void tile_rows(const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* pages, int64_t n_pages, int64_t P,
               int64_t hkv, int64_t Hkv, int64_t D, PrefixState& s) {
  const int64_t row_stride = Hkv * D, page_elems = P * Hkv * D;
  for (int64_t i = 0; i < n_pages; ++i) {
    const int64_t base = static_cast<int64_t>(pages[i]) * page_elems + hkv * D;
    for (int64_t t = 0; t < P; ++t) {
      const int64_t n = i * P + t, off = base + t * row_stride;
      if constexpr (std::is_same_v<scalar_t, float>) {
        s.krows[n] = k_cache + off;
        s.vrows[n] = v_cache + off;
      } else {
        widen(k_cache + off, s.kbuf.data() + n * D, D);
        widen(v_cache + off, s.vbuf.data() + n * D, D);
        s.krows[n] = s.kbuf.data() + n * D;
        s.vrows[n] = s.vbuf.data() + n * D;
      }
    }
  }
}

// p[j] = exp(p[j] - mx[j]) (scores to probabilities), sum[j] += p[j]: one key's scores across query
// lanes, n a multiple of kLanes (AVX-512: exp_nonpositive16 of paged_attention.h).
inline void exp_lanes(float* __restrict p, const float* __restrict mx, float* __restrict sum, int64_t n) {
#if defined(__AVX512F__)
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(p + j), _mm512_loadu_ps(mx + j)));
    _mm512_storeu_ps(p + j, e);
    _mm512_storeu_ps(sum + j, _mm512_add_ps(_mm512_loadu_ps(sum + j), e));
  }
#else
  for (int64_t j = 0; j < n; ++j) {
    const float e = exp_nonpositive(p[j] - mx[j]);
    p[j] = e;
    sum[j] += e;
  }
#endif
}

inline void max_lanes(float* __restrict mx, const float* __restrict x, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) mx[j] = std::max(mx[j], x[j]);
}

// The online softmax over one tile, across query lanes: st [T, Rpad] scores in, probabilities out;
// l and the acc rows rescaled to the new running max m.
inline void tile_softmax(PrefixState& s, int64_t T, int64_t R, int64_t D) {
  const int64_t Rpad = s.Rpad;
  float* mx = s.tile_max.data();
  float* sum = s.tile_sum.data();
  std::copy(s.m.begin(), s.m.begin() + Rpad, mx);
  for (int64_t n = 0; n < T; ++n) max_lanes(mx, s.st.data() + n * Rpad, Rpad);
  for (int64_t j = 0; j < Rpad; ++j) {
    const float alpha = exp_nonpositive(s.m[j] - mx[j]);  // ~0 on the first tile (m = -inf)
    s.l[j] *= alpha;
    if (j < R && alpha != 1.f) scale(s.acc.data() + j * D, alpha, D);
    sum[j] = 0.f;
  }
  for (int64_t n = 0; n < T; ++n) exp_lanes(s.st.data() + n * Rpad, mx, sum, Rpad);
  for (int64_t j = 0; j < Rpad; ++j) s.l[j] += sum[j];
  std::copy(mx, mx + Rpad, s.m.begin());
}

// Pass 1's result for the R query rows of (chunk starting at batch row row0, KV head hkv): each row's
// normalised output and natural-log LSE from its unnormalised state (acc [R, D], running max m, sum l).
inline void write_prefix_rows(const CascadeDims& d, int64_t row0, int64_t hkv, int64_t R, const float* acc,
                              const float* m, const float* l, float* prefix_out, float* prefix_lse) {
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = row0 + r / d.G, h = hkv * d.G + r % d.G;
    const float inv = 1.f / l[r];
    const float* a = acc + r * d.D;
    float* o = prefix_out + (b * d.H + h) * d.D;
    for (int64_t j = 0; j < d.D; ++j) o[j] = a[j] * inv;
    prefix_lse[b * d.H + h] = m[r] + std::log(l[r]);
  }
}

// Pass 1 for chunk c, KV head hkv: every query row of the chunk against the shared pages.
// Requires D % kLanes == 0 (prefix_pass_rows covers the rest).
template <typename scalar_t>
void prefix_pass_tiles(const CascadeDims& d, int64_t c, int64_t hkv, const scalar_t* q, const scalar_t* k_cache,
                       const scalar_t* v_cache, const int32_t* chunk_indptr, const int32_t* prefix_indptr,
                       const int32_t* prefix_indices, float sm_scale, float* prefix_out, float* prefix_lse,
                       PrefixState& s) {
  const int64_t G = d.G, D = d.D, P = d.P;
  const int64_t row0 = chunk_indptr[c], R = (chunk_indptr[c + 1] - row0) * G;
  const int64_t first = prefix_indptr[c], n_pages = prefix_indptr[c + 1] - first;
  if (n_pages == 0) return;
  const int64_t Rpad = (R + kLanes - 1) / kLanes * kLanes;
  s.Rpad = Rpad;
  std::vector<float> qrow(D);
  std::fill(s.qt.begin(), s.qt.begin() + D * Rpad, 0.f);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = row0 + r / G, h = hkv * G + r % G;
    load_query(q + b * d.q_sb + h * d.q_sh, qrow.data(), D, sm_scale);
    for (int64_t j = 0; j < D; ++j) s.qt[j * Rpad + r] = qrow[j];
  }
  s.m.assign(Rpad, -std::numeric_limits<float>::infinity());
  s.l.assign(Rpad, 0.f);
  std::fill(s.acc.begin(), s.acc.begin() + R * D, 0.f);
  const int64_t pages_per_tile = std::max<int64_t>(1, kTileTokens / P);
  for (int64_t p0 = 0; p0 < n_pages; p0 += pages_per_tile) {
    const int64_t np = std::min(pages_per_tile, n_pages - p0), T = np * P;
    tile_rows(k_cache, v_cache, prefix_indices + first + p0, np, P, hkv, d.Hkv, D, s);
    int64_t n = 0;
    for (; n + kKeyBlock <= T; n += kKeyBlock) tile_scores<kKeyBlock>(s.krows.data() + n, s.qt.data(), D, Rpad, s.st.data() + n * Rpad);
    for (; n < T; ++n) tile_scores<1>(s.krows.data() + n, s.qt.data(), D, Rpad, s.st.data() + n * Rpad);
    tile_softmax(s, T, R, D);
    int64_t r = 0;
    for (; r + kPvRows <= R; r += kPvRows) tile_pv_rows<kPvRows>(s.st.data() + r, Rpad, s.vrows.data(), T, s.acc.data() + r * D, D);
    for (; r < R; ++r) tile_pv_rows<1>(s.st.data() + r, Rpad, s.vrows.data(), T, s.acc.data() + r * D, D);
  }
  write_prefix_rows(d, row0, hkv, R, s.acc.data(), s.m.data(), s.l.data(), prefix_out, prefix_lse);
}

// Pass 1 one row at a time through attend_pages: head dims that are not a multiple of kLanes.
template <typename scalar_t>
void prefix_pass_rows(const CascadeDims& d, int64_t c, int64_t hkv, const scalar_t* q, const scalar_t* k_cache,
                      const scalar_t* v_cache, const int32_t* chunk_indptr, const int32_t* prefix_indptr,
                      const int32_t* prefix_indices, float sm_scale, float* prefix_out, float* prefix_lse, RowState& s) {
  const int64_t G = d.G, D = d.D;
  const int64_t row0 = chunk_indptr[c], rows = chunk_indptr[c + 1] - row0;
  const int64_t first = prefix_indptr[c], n_pages = prefix_indptr[c + 1] - first;
  if (n_pages == 0) return;
  const int64_t R = rows * G;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = row0 + r / G, h = hkv * G + r % G;
    load_query(q + b * d.q_sb + h * d.q_sh, s.q.data() + r * D, D, sm_scale);
  }
  s.reset(R, D);
  attend_pages(k_cache, v_cache, prefix_indices + first, n_pages, d.P, hkv, d.Hkv, D, d.P, R, s);
  write_prefix_rows(d, row0, hkv, R, s.acc.data(), s.m.data(), s.l.data(), prefix_out, prefix_lse);
}

// Pass 2 for sequence b, KV head hkv: its own pages, then the merge with its prefix part.
template <typename scalar_t>
void suffix_pass(const CascadeDims& d, int64_t b, int64_t hkv, bool has_prefix, const scalar_t* q,
                 const scalar_t* k_cache, const scalar_t* v_cache, const int32_t* kv_indptr,
                 const int32_t* kv_indices, const int32_t* kv_last_page_len, float sm_scale,
                 const float* prefix_out, const float* prefix_lse, scalar_t* out, RowState& s) {
  const int64_t G = d.G, D = d.D;
  attend_own_pages(d, b, hkv, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, s);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t h = hkv * G + g;
    const float* a = s.acc.data() + g * D;
    scalar_t* o = out + (b * d.H + h) * D;
    if (!has_prefix) {
      const float inv = 1.f / s.l[g];
      for (int64_t j = 0; j < D; ++j) o[j] = static_cast<scalar_t>(a[j] * inv);
      continue;
    }
    // suffix part: lse2 = m + log l, output a / l; weights relative to the larger LSE
    const float lse1 = prefix_lse[b * d.H + h], lse2 = s.m[g] + std::log(s.l[g]);
    const float mx = std::max(lse1, lse2);
    const float w1 = std::exp(lse1 - mx), w2 = std::exp(lse2 - mx);
    const float c1 = w1 / (w1 + w2), c2 = w2 / ((w1 + w2) * s.l[g]);
    const float* o1 = prefix_out + (b * d.H + h) * D;
    for (int64_t j = 0; j < D; ++j) o[j] = static_cast<scalar_t>(c1 * o1[j] + c2 * a[j]);
  }
}

template <typename scalar_t>
void run(const CascadeDims& d, const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
         const int32_t* chunk_indptr, const int32_t* prefix_indptr, const int32_t* prefix_indices,
         const int32_t* kv_indptr, const int32_t* kv_indices, const int32_t* last_len, float sm_scale,
         torch::Tensor& prefix_out, torch::Tensor& prefix_lse, torch::Tensor& out) {
  const auto* qp = static_cast<const scalar_t*>(q.data_ptr());
  const auto* kp = static_cast<const scalar_t*>(k_cache.data_ptr());
  const auto* vp = static_cast<const scalar_t*>(v_cache.data_ptr());
  auto* op = static_cast<scalar_t*>(out.data_ptr());
  float* po = prefix_out.data_ptr<float>();
  float* pl = prefix_lse.data_ptr<float>();
  std::vector<char> has_prefix(d.B, 0);
  for (int64_t c = 0; c < d.C; ++c) {
    if (prefix_indptr[c + 1] > prefix_indptr[c]) {
      for (int64_t b = chunk_indptr[c]; b < chunk_indptr[c + 1]; ++b) has_prefix[b] = 1;
    }
  }
  at::parallel_for(0, d.C * d.Hkv, 1, [&](int64_t begin, int64_t end) {
    if (d.D % kLanes == 0) {
      PrefixState s(d.max_rows * d.G, d.D, std::max<int64_t>(1, kTileTokens / d.P) * d.P);
      for (int64_t item = begin; item < end; ++item) {
        prefix_pass_tiles<scalar_t>(d, item / d.Hkv, item % d.Hkv, qp, kp, vp, chunk_indptr, prefix_indptr,
                                    prefix_indices, sm_scale, po, pl, s);
      }
    } else {
      RowState s(d.max_rows * d.G, d.D, d.P);
      for (int64_t item = begin; item < end; ++item) {
        prefix_pass_rows<scalar_t>(d, item / d.Hkv, item % d.Hkv, qp, kp, vp, chunk_indptr, prefix_indptr,
                                   prefix_indices, sm_scale, po, pl, s);
      }
    }
  });
  at::parallel_for(0, d.B * d.Hkv, 1, [&](int64_t begin, int64_t end) {
    RowState s(d.G, d.D, d.P);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / d.Hkv;
      suffix_pass<scalar_t>(d, b, item % d.Hkv, has_prefix[b], qp, kp, vp, kv_indptr, kv_indices, last_len, sm_scale,
                            po, pl, op, s);
    }
  });
}

void check_int32(const torch::Tensor& t, const char* name, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kInt && t.dim() == 1 && t.is_contiguous() &&
                  (n < 0 || t.size(0) == n),
              "cascade_decode: ", name, " must be a contiguous CPU int32 vector", n < 0 ? "" : " of length ",
              n < 0 ? "" : std::to_string(n), ", got ", t.scalar_type(), " ", t.sizes());
}

// Chunks cover rows 0..B in order; every page id is inside the cache; every sequence has >= 1 own page.
int64_t check_tables(const int32_t* chunk, const int32_t* pre_ptr, const torch::Tensor& pre_idx, const int32_t* ptr,
                     const torch::Tensor& idx, const int32_t* last_len, int64_t B, int64_t C, int64_t P,
                     int64_t num_blocks) {
  TORCH_CHECK(chunk[0] == 0 && chunk[C] == B, "cascade_decode: chunk_indptr must run from 0 to B=", B, ", got ",
              chunk[0], "..", chunk[C]);
  TORCH_CHECK(pre_ptr[0] >= 0 && pre_ptr[C] <= pre_idx.size(0), "cascade_decode: prefix_indptr spans [", pre_ptr[0],
              ", ", pre_ptr[C], ") but prefix_indices has ", pre_idx.size(0), " entries");
  TORCH_CHECK(ptr[0] >= 0 && ptr[B] <= idx.size(0), "cascade_decode: kv_indptr spans [", ptr[0], ", ", ptr[B],
              ") but kv_indices has ", idx.size(0), " entries");
  int64_t max_rows = 1;
  for (int64_t c = 0; c < C; ++c) {
    TORCH_CHECK(chunk[c + 1] > chunk[c] && pre_ptr[c + 1] >= pre_ptr[c], "cascade_decode: chunk ", c,
                " has no rows or a negative page count");
    max_rows = std::max<int64_t>(max_rows, chunk[c + 1] - chunk[c]);
  }
  const int32_t* pi = pre_idx.data_ptr<int32_t>();
  for (int64_t i = pre_ptr[0]; i < pre_ptr[C]; ++i) {
    TORCH_CHECK(pi[i] >= 0 && pi[i] < num_blocks, "cascade_decode: prefix_indices[", i, "] = ", pi[i],
                " is outside the cache (", num_blocks, " blocks)");
  }
  const int32_t* si = idx.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(ptr[b + 1] > ptr[b], "cascade_decode: kv_indptr gives sequence ", b, " no own page; every sequence "
                "keeps >= 1 (its last, partial page)");
    TORCH_CHECK(last_len[b] >= 1 && last_len[b] <= P, "cascade_decode: kv_last_page_len[", b, "] = ", last_len[b],
                " is outside 1..P = 1..", P);
    for (int64_t i = ptr[b]; i < ptr[b + 1]; ++i) {
      TORCH_CHECK(si[i] >= 0 && si[i] < num_blocks, "cascade_decode: kv_indices[", i, "] = ", si[i],
                  " is outside the cache (", num_blocks, " blocks)");
    }
  }
  return max_rows;
}

void cascade_decode(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    const torch::Tensor& chunk_indptr, const torch::Tensor& prefix_indptr,
                    const torch::Tensor& prefix_indices, const torch::Tensor& kv_indptr,
                    const torch::Tensor& kv_indices, const torch::Tensor& kv_last_page_len, double sm_scale,
                    torch::Tensor prefix_out, torch::Tensor prefix_lse, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.device().is_cpu(),
              "cascade_decode: q must be a CPU [B, H, D] tensor with a contiguous head dim, got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "cascade_decode: k_cache and v_cache must be contiguous CPU [num_blocks, P, Hkv, D], got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t num_blocks = k_cache.size(0), P = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hkv > 0 && H % Hkv == 0, "cascade_decode: q [B, H, D] = ", q.sizes(),
              " does not fit k_cache ", k_cache.sizes(), " (same D, H a multiple of Hkv)");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "cascade_decode: q dtype must be float32, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "cascade_decode: k_cache/v_cache dtype differs from q dtype ", dtype);
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == dtype && out.is_contiguous() && out.device().is_cpu(),
              "cascade_decode: out must be contiguous CPU ", dtype, " ", q.sizes(), ", got ", out.scalar_type(), " ",
              out.sizes());
  TORCH_CHECK(prefix_out.scalar_type() == at::kFloat && prefix_out.is_contiguous() && prefix_out.numel() >= B * H * D &&
                  prefix_lse.scalar_type() == at::kFloat && prefix_lse.is_contiguous() && prefix_lse.numel() >= B * H,
              "cascade_decode: prefix_out / prefix_lse must be contiguous fp32 with >= B*H*D / B*H elements");
  check_int32(chunk_indptr, "chunk_indptr", -1);
  TORCH_CHECK(chunk_indptr.size(0) >= 1, "cascade_decode: chunk_indptr needs C+1 >= 1 entries");
  const int64_t C = chunk_indptr.size(0) - 1;
  check_int32(prefix_indptr, "prefix_indptr", C + 1);
  check_int32(prefix_indices, "prefix_indices", -1);
  check_int32(kv_indptr, "kv_indptr", B + 1);
  check_int32(kv_indices, "kv_indices", -1);
  check_int32(kv_last_page_len, "kv_last_page_len", B);
  if (B == 0 || H == 0) return;
  const int32_t* chunk = chunk_indptr.data_ptr<int32_t>();
  const int32_t* pre_ptr = prefix_indptr.data_ptr<int32_t>();
  const int32_t* ptr = kv_indptr.data_ptr<int32_t>();
  const int32_t* last_len = kv_last_page_len.data_ptr<int32_t>();
  const int64_t max_rows =
      check_tables(chunk, pre_ptr, prefix_indices, ptr, kv_indices, last_len, B, C, P, num_blocks);
  const CascadeDims d{B, H, Hkv, H / Hkv, D, P, C, max_rows, q.stride(0), q.stride(1)};
  const auto sc = static_cast<float>(sm_scale);
  const int32_t* pre_idx = prefix_indices.data_ptr<int32_t>();
  const int32_t* idx = kv_indices.data_ptr<int32_t>();
#define RLENGINE_CASCADE_RUN(T) \
  run<T>(d, q, k_cache, v_cache, chunk, pre_ptr, pre_idx, ptr, idx, last_len, sc, prefix_out, prefix_lse, out)
  switch (dtype) {
    case at::kFloat: RLENGINE_CASCADE_RUN(float); break;
    case at::kHalf: RLENGINE_CASCADE_RUN(c10::Half); break;
    default: RLENGINE_CASCADE_RUN(c10::BFloat16); break;
  }
#undef RLENGINE_CASCADE_RUN
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def(
      "cascade_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor chunk_indptr, Tensor prefix_indptr, "
      "Tensor prefix_indices, Tensor kv_indptr, Tensor kv_indices, Tensor kv_last_page_len, float sm_scale, "
      "Tensor(a!) prefix_out, Tensor(b!) prefix_lse, Tensor(c!) out) -> ()");
}

TORCH_LIBRARY_IMPL(rlengine, CPU, m) {
  m.impl("cascade_decode", &cascade_decode);
}

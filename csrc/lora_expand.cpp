// LoRA's second GEMM on the CPU decode path: out = y + scale * (t @ B^T), block by block.
//
// An rlengine projection with adapters computes t = x A^T [M, n*r] (n targeted slices of rank r)
// beside y = x W^T [M, N]; B [N, n*r] is block-diagonal: output rows [row0, row0 + rows) of a
// targeted slice read only t's columns [col0, col0 + r) (the rest of B is zero). torch's linear
// runs this as a dense GEMM with K = n*r (8-64): half or more of its products are zeros, and at a
// few rows oneDNN's bf16 path for such a small K is slower than fp32 (on a 2-core EPYC 26 us for
// [4, 16] x [16, 3072], most of LoRA's cost in a decode step). Here each task takes 16 output rows
// of one block, transposes their r weights into 16-wide fp32 columns once (in registers, two bf16
// weights per 32-bit unit), then for each token row sums r broadcast FMAs and adds y with the scale:
// one rounding to y's dtype (torch rounds the product, then the sum). Rows in no block copy y. With t = None, y is
// the output of one GEMM on [W; A] (model/lora.py colocate): its first N columns are y, the rest t.
// Per output row the arithmetic does not depend on M or on the other rows: batch-invariant.
// This op only says what it can run: other dtypes, odd r, no AVX-512 at build time, autograd, or a
// strided B go to the composite y + scale * linear(t, B). rlengine/model/ops.py times both.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <optional>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define RLENGINE_LORA_AVX512 1
#endif

namespace {

constexpr int64_t kMaxRank = 256;  // the transposed columns of one tile live on the stack: r * 64 bytes

#ifdef RLENGINE_LORA_AVX512

inline __m512 load_row(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }

inline __m512 load_row(const c10::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

inline void store_row(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

// fp32 -> bf16 rounding to nearest even, NaN -> 0x7FC0 (c10::BFloat16's rule), 16 lanes.
inline void store_row(c10::BFloat16* p, __m512 v, __mmask16 m) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
}

// Transposes 16 rows x 4 32-bit units (16 bytes at base + j * ld bytes, row j < rows; `units` of the
// 4 in range) into P[u] (lane j = row j's unit u): two rounds of two-source permutes, no gathers
// (a 16-lane gather costs ~25 cycles on Zen 4; this is ~2 per unit).
inline void transpose16x4(const char* base, int64_t ld, int64_t rows, int units, __m512i P[4]) {
  const __mmask8 um = static_cast<__mmask8>((1u << units) - 1);
  __m128i row[16];
  for (int j = 0; j < 16; ++j)
    row[j] = j < rows ? _mm_maskz_loadu_epi32(um, base + j * ld) : _mm_setzero_si128();
  __m512i Z[4];
  for (int a = 0; a < 4; ++a) {
    __m512i z = _mm512_castsi128_si512(row[4 * a]);
    z = _mm512_inserti32x4(z, row[4 * a + 1], 1);
    z = _mm512_inserti32x4(z, row[4 * a + 2], 2);
    Z[a] = _mm512_inserti32x4(z, row[4 * a + 3], 3);
  }
  // round 1: lane u * 8 + i (i < 8: row i of the pair of Z's) <- unit u (lo) or u + 2 (hi)
  const __m512i lo = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 1, 5, 9, 13, 17, 21, 25, 29);
  const __m512i hi = _mm512_setr_epi32(2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31);
  const __m512i A01l = _mm512_permutex2var_epi32(Z[0], lo, Z[1]), A01h = _mm512_permutex2var_epi32(Z[0], hi, Z[1]);
  const __m512i A23l = _mm512_permutex2var_epi32(Z[2], lo, Z[3]), A23h = _mm512_permutex2var_epi32(Z[2], hi, Z[3]);
  // round 2: rows 0-7 from the first source, 8-15 from the second
  const __m512i e = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i o = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  P[0] = _mm512_permutex2var_epi32(A01l, e, A23l);
  P[1] = _mm512_permutex2var_epi32(A01l, o, A23l);
  P[2] = _mm512_permutex2var_epi32(A01h, e, A23h);
  P[3] = _mm512_permutex2var_epi32(A01h, o, A23h);
}

// cols[k * 16 + j] = B[n0 + j, col0 + k] as fp32, for j < rows (other lanes 0) and k < r.
inline void gather_cols(const float* B, int64_t ldb, int64_t n0, int64_t col0, int64_t r, int64_t rows, float* cols) {
  const char* base = reinterpret_cast<const char*>(B + n0 * ldb + col0);
  __m512i P[4];
  for (int64_t k = 0; k < r; k += 4) {
    const int units = static_cast<int>(std::min<int64_t>(4, r - k));
    transpose16x4(base + k * 4, ldb * 4, rows, units, P);
    for (int u = 0; u < units; ++u) _mm512_storeu_si512(cols + (k + u) * 16, P[u]);
  }
}

// bf16: a 32-bit unit is weights k and k + 1 (r even); its low half is k, its high half k + 1.
inline void gather_cols(const c10::BFloat16* B, int64_t ldb, int64_t n0, int64_t col0, int64_t r, int64_t rows,
                        float* cols) {
  const char* base = reinterpret_cast<const char*>(B + n0 * ldb + col0);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512i P[4];
  for (int64_t k = 0; k < r; k += 8) {
    const int units = static_cast<int>(std::min<int64_t>(4, (r - k) / 2));
    transpose16x4(base + k * 2, ldb * 2, rows, units, P);
    for (int u = 0; u < units; ++u) {
      _mm512_storeu_si512(cols + (k + 2 * u) * 16, _mm512_slli_epi32(P[u], 16));
      _mm512_storeu_si512(cols + (k + 2 * u + 1) * 16, _mm512_and_si512(P[u], high));
    }
  }
}

// MB token rows [m0, m0 + MB) of one tile: MB independent FMA chains over the r columns.
template <int MB, typename T>
inline void tile_rows(const float* cols, int64_t r, const float* t, int64_t ldt, const T* y, int64_t ldy, T* out,
                      int64_t N, int64_t m0, int64_t n0, __mmask16 m, float scale) {
  __m512 acc[MB];
  for (int b = 0; b < MB; ++b) acc[b] = _mm512_setzero_ps();
  const float* t0 = t + m0 * ldt;
  for (int64_t k = 0; k < r; ++k) {
    const __m512 c = _mm512_loadu_ps(cols + k * 16);
    for (int b = 0; b < MB; ++b) acc[b] = _mm512_fmadd_ps(_mm512_set1_ps(t0[b * ldt + k]), c, acc[b]);
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int b = 0; b < MB; ++b) {
    const __m512 yv = load_row(y + (m0 + b) * ldy + n0, m);
    store_row(out + (m0 + b) * N + n0, _mm512_fmadd_ps(acc[b], s, yv), m);
  }
}

#endif  // RLENGINE_LORA_AVX512

constexpr int kMaxBlocks = 16;

// The targeted slices, sorted by row, and where each one's 16-row tiles start in the flat tile index.
struct Plan {
  int n = 0;
  int64_t row0[kMaxBlocks], col0[kMaxBlocks], rows[kMaxBlocks], first_tile[kMaxBlocks + 1];
  bool covers = false;  // the blocks cover every output row (no row copies y)
};

// blocks: (row0, col0, rows) per targeted slice, flattened; false unless they lie inside B [N, J] and
// do not overlap.
bool make_plan(const std::vector<int64_t>& blocks, int64_t N, int64_t J, int64_t r, Plan& p) {
  if (blocks.size() % 3 != 0 || blocks.size() / 3 > static_cast<size_t>(kMaxBlocks)) return false;
  for (size_t i = 0; i < blocks.size(); i += 3) {
    int64_t row0 = blocks[i], col0 = blocks[i + 1], rows = blocks[i + 2];
    if (row0 < 0 || rows < 0 || row0 + rows > N || col0 < 0 || col0 + r > J) return false;
    int j = p.n++;  // insertion by row0
    for (; j > 0 && p.row0[j - 1] > row0; --j) p.row0[j] = p.row0[j - 1], p.col0[j] = p.col0[j - 1], p.rows[j] = p.rows[j - 1];
    p.row0[j] = row0, p.col0[j] = col0, p.rows[j] = rows;
  }
  int64_t covered = 0;
  p.first_tile[0] = 0;
  for (int j = 0; j < p.n; ++j) {
    if (j > 0 && p.row0[j] < p.row0[j - 1] + p.rows[j - 1]) return false;
    covered += p.rows[j];
    p.first_tile[j + 1] = p.first_tile[j] + (p.rows[j] + 15) / 16;
  }
  p.covers = covered == N;
  return true;
}

#ifdef RLENGINE_LORA_AVX512

template <typename T>
void run(const T* y, int64_t ldy, const float* t, int64_t ldt, const T* B, int64_t ldb, T* out, int64_t M, int64_t N,
         int64_t r, const Plan& p, float scale) {
  // ~ 8K FMAs per task: small products stay on one thread, big ones split over tiles
  const int64_t grain = std::max<int64_t>(1, 8192 / std::max<int64_t>(1, M * r));
  at::parallel_for(0, p.first_tile[p.n], grain, [&](int64_t i0, int64_t i1) {
    alignas(64) float cols[kMaxRank * 16];
    int j = 0;
    for (int64_t i = i0; i < i1; ++i) {
      while (i >= p.first_tile[j + 1]) ++j;
      const int64_t n0 = p.row0[j] + 16 * (i - p.first_tile[j]), col0 = p.col0[j];
      const int64_t rows = std::min<int64_t>(16, p.row0[j] + p.rows[j] - n0);
      const __mmask16 m = rows >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << rows) - 1);
      gather_cols(B, ldb, n0, col0, r, rows, cols);
      const float* tc = t + col0;
      int64_t m0 = 0;
      for (; m0 + 8 <= M; m0 += 8) tile_rows<8>(cols, r, tc, ldt, y, ldy, out, N, m0, n0, m, scale);
      if (M - m0 >= 4) { tile_rows<4>(cols, r, tc, ldt, y, ldy, out, N, m0, n0, m, scale); m0 += 4; }
      if (M - m0 >= 2) { tile_rows<2>(cols, r, tc, ldt, y, ldy, out, N, m0, n0, m, scale); m0 += 2; }
      if (M - m0 >= 1) tile_rows<1>(cols, r, tc, ldt, y, ldy, out, N, m0, n0, m, scale);
    }
  });
}

#endif  // RLENGINE_LORA_AVX512

// y [M, N] and t [M, J] as the kernel reads them: row pointers with a row stride, columns contiguous.
struct Operands {
  const char *y, *t;
  int64_t ldy, ldt, M, J;
};

// The operands, or false where the kernel cannot run them. t None: yt is [M, N + J], y its first N columns.
bool operands(const torch::Tensor& yt, const std::optional<torch::Tensor>& t, const torch::Tensor& B, int64_t r,
              Operands& o) {
#ifdef RLENGINE_LORA_AVX512
  const auto dt = yt.scalar_type();
  const int64_t N = B.dim() == 2 ? B.size(0) : -1;
  if (!(yt.device().is_cpu() && B.device().is_cpu() && yt.dim() == 2 && B.dim() == 2 &&
        (dt == torch::kFloat || dt == torch::kBFloat16) && B.scalar_type() == dt && B.is_contiguous() &&
        yt.stride(1) == 1 && r >= 1 && r <= kMaxRank && r % 2 == 0 && B.numel() < (int64_t{1} << 31)))
    return false;
  if (at::GradMode::is_enabled() && (yt.requires_grad() || B.requires_grad() || (t && t->requires_grad())))
    return false;
  const int64_t es = yt.element_size();
  o.y = static_cast<const char*>(yt.data_ptr());
  o.ldy = yt.stride(0), o.M = yt.size(0);
  if (t) {
    if (!(t->device().is_cpu() && t->dim() == 2 && t->scalar_type() == dt && t->stride(1) == 1 &&
          t->size(0) == o.M && yt.size(1) == N))
      return false;
    o.t = static_cast<const char*>(t->data_ptr()), o.ldt = t->stride(0), o.J = t->size(1);
  } else {
    if (yt.size(1) <= N) return false;
    o.t = o.y + N * es, o.ldt = o.ldy, o.J = yt.size(1) - N;
  }
  return o.J == B.size(1);
#else
  (void)yt, (void)t, (void)B, (void)r, (void)o;
  return false;
#endif
}

// t None: yt is the [M, N + J] output of the GEMM on [W; A] (x W^T, then t = x A^T), N = B's rows.
torch::Tensor lora_expand(const torch::Tensor& yt, const std::optional<torch::Tensor>& t, const torch::Tensor& B,
                          double scale, int64_t r, std::vector<int64_t> blocks) {
  Operands o;
  Plan p;
  if (!operands(yt, t, B, r, o) || !make_plan(blocks, B.size(0), B.size(1), r, p)) {
    if (t) return at::add(yt, at::linear(*t, B), scale);
    const int64_t N = B.size(0);
    return at::add(yt.narrow(1, 0, N), at::linear(yt.narrow(1, N, yt.size(1) - N), B), scale);
  }
#ifdef RLENGINE_LORA_AVX512
  const int64_t M = o.M, N = B.size(0), J = o.J;
  auto out = torch::empty({M, N}, yt.options().memory_format(at::MemoryFormat::Contiguous));
  if (M == 0 || N == 0) return out;
  if (!p.covers) {  // rows of untargeted slices: out = y
    const torch::Tensor y = yt.narrow(1, 0, N);
    int64_t n = 0;
    for (int j = 0; j <= p.n; ++j) {
      const int64_t e = j < p.n ? p.row0[j] : N;
      if (e > n) out.narrow(1, n, e - n).copy_(y.narrow(1, n, e - n));
      if (j < p.n) n = p.row0[j] + p.rows[j];
    }
  }
  const float s = static_cast<float>(scale);
  if (yt.scalar_type() == torch::kFloat) {
    run(reinterpret_cast<const float*>(o.y), o.ldy, reinterpret_cast<const float*>(o.t), o.ldt, B.data_ptr<float>(),
        J, out.data_ptr<float>(), M, N, r, p, s);
  } else {  // t's M * J values widened once, not once per tile
    using bf = c10::BFloat16;
    std::vector<float> tf(static_cast<size_t>(M * J));
    const bf* tp = reinterpret_cast<const bf*>(o.t);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t k = 0; k < J; ++k) tf[i * J + k] = static_cast<float>(tp[i * o.ldt + k]);
    run(reinterpret_cast<const bf*>(o.y), o.ldy, tf.data(), J, B.data_ptr<bf>(), J, out.data_ptr<bf>(), M, N, r, p, s);
  }
  return out;
#else
  return {};  // unreachable: operands() is false without AVX-512
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def("lora_expand(Tensor y, Tensor? t, Tensor B, float scale, int r, int[] blocks) -> Tensor");
}

// CompositeImplicitAutograd: with gradients required the op is y + scale * linear(t, B), which autograd
// records as usual; the raw kernel runs only where no gradient can flow.
TORCH_LIBRARY_IMPL(rlengine, CompositeImplicitAutograd, m) {
  m.impl("lora_expand", &lora_expand);
}

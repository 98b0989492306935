// Cascade (shared-prefix) decode attention on the CPU: the G samples of a GRPO group share their
// prompt's KV pages, so attention is split in two passes merged by log-sum-exp.
//   1. prefix: one work item per (chunk, KV head). A chunk is a run of consecutive batch rows whose
//      block tables start with the same full pages; its rows * (H / Hkv) query rows are scored
//      together against each shared K/V page, read (and widened) once instead of once per row.
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

namespace {

using namespace rlengine_attn;

struct CascadeDims {
  int64_t B, H, Hkv, G, D, P, C, max_rows;  // max_rows: most batch rows in one chunk
  int64_t q_sb, q_sh;
};

// Pass 1 for chunk c, KV head hkv: every query row of the chunk against the shared pages.
template <typename scalar_t>
void prefix_pass(const CascadeDims& d, int64_t c, int64_t hkv, const scalar_t* q, const scalar_t* k_cache,
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
  for (int64_t r = 0; r < R; ++r) {
    const int64_t b = row0 + r / G, h = hkv * G + r % G;
    const float inv = 1.f / s.l[r];
    const float* a = s.acc.data() + r * D;
    float* o = prefix_out + (b * d.H + h) * D;
    for (int64_t j = 0; j < D; ++j) o[j] = a[j] * inv;
    prefix_lse[b * d.H + h] = s.m[r] + std::log(s.l[r]);
  }
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
    RowState s(d.max_rows * d.G, d.D, d.P);
    for (int64_t item = begin; item < end; ++item) {
      prefix_pass<scalar_t>(d, item / d.Hkv, item % d.Hkv, qp, kp, vp, chunk_indptr, prefix_indptr, prefix_indices,
                            sm_scale, po, pl, s);
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

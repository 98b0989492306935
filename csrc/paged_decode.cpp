// Paged-KV decode attention on the CPU: one query token per sequence against its paged K/V.
// Shapes: q [B, H, D] (contiguous last dim, any other strides); k_cache, v_cache [num_blocks, P, Hkv, D]
// contiguous (FlashInfer NHD); kv_indptr int32 [B+1], kv_indices int32 [kv_indptr[B]], kv_last_page_len
// int32 [B] in 1..P; out [B, H, D] contiguous in q's dtype, written in place. fp32, fp16 and bf16.
// One work item per sequence when there are at least four per thread (or the step runs on one thread):
// each page's K and V rows are read whole, once, for every KV head (decode_sequence: 10-12% faster at
// bf16 B_act 64 from a cold cache, fp32 even). Otherwise one per (sequence b, KV head), so that few
// sequences still spread over the threads. Either way the G = H / Hkv query heads of a GQA group share
// a single pass over their head's K/V rows, page by page, with an online softmax in fp32, and every
// output row is computed in the same order (the two layouts agree bit for bit). fp16/bf16 rows are
// widened into a per-thread fp32 page buffer first, so every inner loop is a contiguous fp32 loop over D
// (four K/V rows per pass, a vectorisable exp, the next page software-prefetched: each measured on
// bf16, 16 x 1024 tokens, about 2x in total over the plain one-row loops with std::exp).
// Simplification: no split-KV; parallelism comes from B * Hkv, which on the CPU decode path (many
// sequences, several KV heads) matches or exceeds the core count; with fewer items than threads,
// cores idle.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "paged_attention.h"

namespace {

using namespace rlengine_attn;

struct Dims {
  int64_t B, H, Hkv, G, D, P;
  int64_t q_sb, q_sh;  // q strides (elements) of the B and H dims
};

// out[r, 0, D) = the normalised output of s's rows 0..R-1.
template <typename scalar_t>
void store_rows(const RowState& s, int64_t R, int64_t D, scalar_t* out) {
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.f / s.l[r];  // l >= 1: the max-scoring token contributes exp(0)
    const float* a = s.acc.data() + r * D;
    for (int64_t j = 0; j < D; ++j) out[r * D + j] = static_cast<scalar_t>(a[j] * inv);
  }
}

template <typename scalar_t>
void decode_group(const Dims& d, int64_t b, int64_t hkv, const scalar_t* q, const scalar_t* k_cache,
                  const scalar_t* v_cache, const int32_t* kv_indptr, const int32_t* kv_indices,
                  const int32_t* kv_last_page_len, float sm_scale, scalar_t* out, RowState& s) {
  const int64_t G = d.G, D = d.D;
  attend_own_pages(d, b, hkv, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, s);
  store_rows(s, G, D, out + (b * d.H + hkv * G) * D);  // the group's heads are adjacent rows of out
}

// Software prefetch of work item `item`'s K/V rows, issued one item ahead: in a decode step the cache
// comes from memory (the weights streamed in between evict it), and the loads that widen K and V took
// ~60% of the kernel's perf samples (qwen3-30m bf16, B_act 64), waiting on misses. Up to kAheadBytes per
// item, a small part of any L2, so the lines arrive without evicting the current item's; attend_pages
// keeps prefetching one page ahead within an item for longer contexts.
constexpr int64_t kAheadBytes = 32 << 10;
constexpr int64_t kSeqAheadBytes = 128 << 10;  // per-sequence items: the next sequence's pages, into L2

template <typename scalar_t>
void prefetch_item(const Dims& d, int64_t item, const scalar_t* k_cache, const scalar_t* v_cache,
                   const int32_t* kv_indptr, const int32_t* kv_indices, const int32_t* kv_last_page_len) {
  const int64_t b = item / d.Hkv, hkv = item % d.Hkv, first = kv_indptr[b], n_pages = kv_indptr[b + 1] - first;
  const int64_t page_bytes = 2 * d.P * d.D * static_cast<int64_t>(sizeof(scalar_t));  // K and V of one head
  const int64_t pages = std::min(n_pages, std::max<int64_t>(1, kAheadBytes / page_bytes));
  for (int64_t i = 0; i < pages; ++i) {
    const int64_t n_tok = i + 1 == n_pages ? kv_last_page_len[b] : d.P;
    const int64_t base = static_cast<int64_t>(kv_indices[first + i]) * d.P * d.Hkv * d.D + hkv * d.D;
    prefetch_rows(k_cache + base, n_tok, d.Hkv * d.D, d.D);
    prefetch_rows(v_cache + base, n_tok, d.Hkv * d.D, d.D);
  }
}

// One work item per sequence: every KV head's G query rows (H rows in s, row r = hkv * G + g) against the
// sequence's pages, each page's K and V rows read whole ([n_tok, Hkv, D], contiguous) once. Pages are
// scattered blocks of the pool, cold in a decode step (the weights streamed in between evict them); a
// (sequence, KV head) item reads every page as n_tok strided D-row pieces, which the hardware
// prefetchers do not follow and one-item-ahead software prefetch only partly covers: at qwen3-30m bf16,
// B_act 64, 48-token contexts, 58% of the kernel's samples were the widening loads of those pieces.
// Software prefetch into L2 of sequence b's K/V pages (up to kAheadBytes), issued one sequence ahead.
template <typename scalar_t>
void prefetch_sequence(const Dims& d, int64_t b, const scalar_t* k_cache, const scalar_t* v_cache,
                       const int32_t* kv_indptr, const int32_t* kv_indices, const int32_t* kv_last_page_len) {
  const int64_t W = d.Hkv * d.D, first = kv_indptr[b], n_pages = kv_indptr[b + 1] - first;
  int64_t budget = kSeqAheadBytes;
  for (int64_t i = 0; i < n_pages && budget > 0; ++i) {
    const int64_t n_tok = i + 1 == n_pages ? kv_last_page_len[b] : d.P;
    const int64_t base = static_cast<int64_t>(kv_indices[first + i]) * d.P * W;
    const int64_t bytes = n_tok * W * static_cast<int64_t>(sizeof(scalar_t));
    for (const scalar_t* src : {k_cache + base, v_cache + base}) {
      const char* p = reinterpret_cast<const char*>(src);
      for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 2);
    }
    budget -= 2 * bytes;
  }
}

template <typename scalar_t>
void decode_sequence(const Dims& d, int64_t b, const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache,
                     const int32_t* kv_indptr, const int32_t* kv_indices, const int32_t* kv_last_page_len,
                     float sm_scale, scalar_t* out, RowState& s) {
  const int64_t H = d.H, G = d.G, D = d.D, P = d.P, W = d.Hkv * D;  // W: a token row of the page
  for (int64_t r = 0; r < H; ++r) load_query(q + b * d.q_sb + r * d.q_sh, s.q.data() + r * D, D, sm_scale);
  s.reset(H, D);
  const int64_t first = kv_indptr[b], n_pages = kv_indptr[b + 1] - first;
  for (int64_t i = 0; i < n_pages; ++i) {
    const int64_t n_tok = i + 1 == n_pages ? kv_last_page_len[b] : P;
    const int64_t base = static_cast<int64_t>(kv_indices[first + i]) * P * W;
    if (i + 1 < n_pages) {  // the next page, whole: contiguous lines
      const int64_t next = static_cast<int64_t>(kv_indices[first + i + 1]) * P * W;
      const int64_t next_tok = i + 2 == n_pages ? kv_last_page_len[b] : P;
      prefetch_rows(k_cache + next, 1, 0, next_tok * W);
      prefetch_rows(v_cache + next, 1, 0, next_tok * W);
    }
    int64_t ks, vs;
    const float* k = page_rows(k_cache + base, 1, 0, n_tok * W, s.k.data(), &ks);  // one run of n_tok * W
    for (int64_t r = 0; r < H; ++r) {
      float* sr = s.scores.data() + r * P;
      page_scores(s.q.data() + r * D, k + (r / G) * D, W, n_tok, D, sr);
      const float mx = std::max(s.m[r], max_of(sr, n_tok));
      const float alpha = std::exp(s.m[r] - mx);  // exp(-inf) = 0 on the first page
      s.l[r] = s.l[r] * alpha + exp_shifted_sum(sr, n_tok, mx);
      s.m[r] = mx;
      if (alpha != 1.f) scale(s.acc.data() + r * D, alpha, D);
    }
    const float* v = page_rows(v_cache + base, 1, 0, n_tok * W, s.v.data(), &vs);
    for (int64_t r = 0; r < H; ++r)
      page_accumulate(s.acc.data() + r * D, s.scores.data() + r * P, v + (r / G) * D, W, n_tok, D);
  }
  store_rows(s, H, D, out + b * H * D);
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
  const bool one_thread = work < (int64_t{1} << 20);
  if (d.Hkv > 1 && (one_thread || d.B >= 4 * at::get_num_threads())) {  // items enough for every thread
    at::parallel_for(0, d.B, one_thread ? d.B : 1, [&](int64_t begin, int64_t end) {
      RowState scratch(d.H, d.D, d.P * d.Hkv);  // k / v: a whole page; scores: H rows of P (<= P * Hkv each)
      for (int64_t b = begin; b < end; ++b) {
        if (b + 1 < end) prefetch_sequence(d, b + 1, kp, vp, indptr, indices, last_len);
        decode_sequence<scalar_t>(d, b, qp, kp, vp, indptr, indices, last_len, sm_scale, op, scratch);
      }
    });
    return;
  }
  const int64_t grain = one_thread ? std::max<int64_t>(1, d.B * d.Hkv) : 1;
  at::parallel_for(0, d.B * d.Hkv, grain, [&](int64_t begin, int64_t end) {
    RowState scratch(d.G, d.D, d.P);
    for (int64_t item = begin; item < end; ++item) {
      if (item + 1 < end) prefetch_item(d, item + 1, kp, vp, indptr, indices, last_len);
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

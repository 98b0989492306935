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

#include "paged_attention.h"

namespace {

using namespace rlengine_attn;

struct Dims {
  int64_t B, H, Hkv, G, D, P;
  int64_t q_sb, q_sh;  // q strides (elements) of the B and H dims
};

template <typename scalar_t>
void decode_group(const Dims& d, int64_t b, int64_t hkv, const scalar_t* q, const scalar_t* k_cache,
                  const scalar_t* v_cache, const int32_t* kv_indptr, const int32_t* kv_indices,
                  const int32_t* kv_last_page_len, float sm_scale, scalar_t* out, RowState& s) {
  const int64_t G = d.G, D = d.D;
  attend_own_pages(d, b, hkv, q, k_cache, v_cache, kv_indptr, kv_indices, kv_last_page_len, sm_scale, s);
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / s.l[g];  // l >= 1: the max-scoring token contributes exp(0)
    const float* a = s.acc.data() + g * D;
    scalar_t* o = out + (b * d.H + hkv * G + g) * D;
    for (int64_t j = 0; j < D; ++j) o[j] = static_cast<scalar_t>(a[j] * inv);
  }
}

// Software prefetch of work item `item`'s K/V rows, issued one item ahead: in a decode step the cache
// comes from memory (the weights streamed in between evict it), and the loads that widen K and V took
// ~60% of the kernel's perf samples (qwen3-30m bf16, B_act 64), waiting on misses. Up to kAheadBytes per
// item, a small part of any L2, so the lines arrive without evicting the current item's; attend_pages
// keeps prefetching one page ahead within an item for longer contexts.
constexpr int64_t kAheadBytes = 32 << 10;

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

// Top-p nucleus of full rows on the CPU, without a sort: the mass-weighted radix select of
// rlengine/engine/filtering.py (nucleus_keep), one row per task, the row kept in cache between passes.
//
// z [W, V] fp32 temperature-scaled logits; p [W, V] fp32 their probabilities exp(z - logsumexp(z))
// (computed by the caller, so the masses are the ones the torch path sums); top_p [W] fp32.
// Returns z with every token outside its row's nucleus at -inf. Per row:
//   key = the order-preserving unsigned 32-bit key of z (-0.0 as +0.0);
//   three histogram passes (11, 11, 10 key bits, most significant first) of the fp64 masses find the
//   boundary key: the bucket where the mass of the tokens above it plus the bucket reaches top_p;
//   each pass reads only the tokens of the previous pass's boundary bucket;
//   tokens with a larger key are kept; the tokens tied at the boundary key are kept in id order
//   while the mass before them stays < top_p; a row whose total mass is below top_p keeps all.
// Masses are summed in fp64, bucket cumulative sums from the largest key down, as the torch path
// does; the first pass sums each bucket in four interleaved partial sums (one chain per bucket would
// serialise a flat row's adds), so a kept set can differ from the torch path's only where the mass
// before a token lies within fp64 rounding of top_p.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

inline uint32_t order_key(float x) {
  x += 0.0f;  // -0.0 -> +0.0
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  // signed order key (b ^ (b >> 31 & 0x7fffffff)) moved to unsigned order (^ 0x80000000)
  const uint32_t neg = static_cast<uint32_t>(static_cast<int32_t>(b) >> 31) & 0x7fffffffu;
  return (b ^ neg) ^ 0x80000000u;
}

struct Pick {
  uint32_t digit;  // the boundary bucket
  double above;    // mass of the tokens above it
  double total;    // mass of this pass's tokens and those above them
};

// hist over nb buckets: the first bucket from the top whose cumulative mass (plus `above`) reaches
// target, with the torch path's arithmetic: inclusive cumulative sums, excl = above + (incl - h)
Pick select(const std::vector<double>& hist, int nb, double above, double target) {
  double incl = 0.0, excl_at_j = 0.0;
  int j = -1;  // the first bucket, from the top, reaching the target
  for (int i = 0; i < nb; ++i) {
    const double h = hist[nb - 1 - i];
    incl += h;
    const double excl = above + (incl - h);  // mass of every bucket above this one
    if (j < 0 && !(excl + h < target)) {
      j = i;
      excl_at_j = excl;
    }
  }
  if (j < 0) {  // the whole pass's mass is below the target: the last bucket (clamped, as the torch path)
    j = nb - 1;
    excl_at_j = above + (incl - hist[0]);
  }
  return {static_cast<uint32_t>(nb - 1 - j), excl_at_j, above + incl};
}

torch::Tensor nucleus_filter(const torch::Tensor& z, const torch::Tensor& p, const torch::Tensor& top_p) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == torch::kFloat32 && z.device().is_cpu(),
              "nucleus_filter: z must be a [W, V] fp32 CPU tensor, got ", z.sizes(), " ", z.scalar_type());
  TORCH_CHECK(p.sizes() == z.sizes() && p.scalar_type() == torch::kFloat32,
              "nucleus_filter: p must be fp32 of z's shape ", z.sizes(), ", got ", p.sizes(), " ", p.scalar_type());
  TORCH_CHECK(top_p.dim() == 1 && top_p.size(0) == z.size(0) && top_p.scalar_type() == torch::kFloat32,
              "nucleus_filter: top_p must be [W] fp32, got ", top_p.sizes(), " ", top_p.scalar_type());
  auto zc = z.contiguous();
  auto pc = p.contiguous();
  auto tp = top_p.contiguous();
  const int64_t W = zc.size(0), V = zc.size(1);
  auto out = torch::empty_like(zc);
  const float* zp = zc.data_ptr<float>();
  const float* pp = pc.data_ptr<float>();
  const float* tpp = tp.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float ninf = -std::numeric_limits<float>::infinity();
  at::parallel_for(0, W, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> hist(2048), hist4(4 * 2048);
    std::vector<uint32_t> keys(V);
    std::vector<int32_t> ids, next;
    ids.reserve(V);
    next.reserve(V);
    for (int64_t w = begin; w < end; ++w) {
      const float* __restrict zr = zp + w * V;
      const float* __restrict pr = pp + w * V;
      float* __restrict orow = op + w * V;
      uint32_t* __restrict kr = keys.data();
      double* __restrict h4 = hist4.data();
      const double target = static_cast<double>(tpp[w]);
      // pass 1: the top 11 key bits over the whole row
      // four interleaved histograms (a flat row puts most tokens in a few buckets: one histogram
      // would chain every add on the previous one), summed bucket by bucket
      std::fill(hist4.begin(), hist4.end(), 0.0);
      for (int64_t t = 0; t < V; ++t) kr[t] = order_key(zr[t]);  // vectorised
      int64_t i = 0;
      for (; i + 4 <= V; i += 4) {
        for (int u = 0; u < 4; ++u) h4[u * 2048 + (kr[i + u] >> 21)] += static_cast<double>(pr[i + u]);
      }
      for (; i < V; ++i) h4[kr[i] >> 21] += static_cast<double>(pr[i]);
      for (int b = 0; b < 2048; ++b) hist[b] = (h4[b] + h4[2048 + b]) + (h4[4096 + b] + h4[6144 + b]);
      Pick pick = select(hist, 2048, 0.0, target);
      const double total = pick.total;
      uint32_t prefix = pick.digit;
      double above = pick.above;
      // the boundary bucket's tokens, in id order (branch-free: the bucket may hold a good part of the row)
      ids.resize(V);
      int64_t n = 0;
      int32_t* __restrict idp = ids.data();
      for (int64_t t = 0; t < V; ++t) {
        idp[n] = static_cast<int32_t>(t);
        n += (kr[t] >> 21) == prefix;
      }
      ids.resize(n);
      // passes 2 and 3 over the boundary bucket's tokens
      const int shifts[2] = {10, 0};
      const int bits[2] = {11, 10};
      for (int pass = 0; pass < 2; ++pass) {
        const int nb = 1 << bits[pass];
        const uint32_t mask = static_cast<uint32_t>(nb - 1);
        std::fill(hist.begin(), hist.begin() + nb, 0.0);
        for (int32_t i : ids) hist[(keys[i] >> shifts[pass]) & mask] += static_cast<double>(pr[i]);
        pick = select(hist, nb, above, target);
        above = pick.above;
        prefix = (prefix << bits[pass]) | pick.digit;
        next.resize(ids.size());
        size_t m = 0;
        for (int32_t i : ids) {
          next[m] = i;
          m += ((keys[i] >> shifts[pass]) & mask) == pick.digit;
        }
        next.resize(m);
        ids.swap(next);
      }
      if (total < target) {  // the whole row's mass below top_p: keep all
        std::memcpy(orow, zr, V * sizeof(float));
        continue;
      }
      for (int64_t t = 0; t < V; ++t) orow[t] = kr[t] > prefix ? zr[t] : ninf;  // vectorised select
      // the tokens tied at the boundary key, in id order
      int64_t j = 0;
      for (int32_t i : ids) {
        if (above + static_cast<double>(j) * static_cast<double>(pr[i]) < target) orow[i] = zr[i];
        ++j;
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rlengine, m) {
  m.def("nucleus_filter(Tensor z, Tensor p, Tensor top_p) -> Tensor");
}

TORCH_LIBRARY_IMPL(rlengine, CPU, m) {
  m.impl("nucleus_filter", &nucleus_filter);
}

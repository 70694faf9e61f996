"""C++ source of the CPU paged decode kernel (services/engine/attention_paged_cpu.py).

Kept apart from its Python wrapper so each stays a readable size; the wrapper builds it
with kernels/cpu_build.py. How it works and why: that module's docstring.
"""

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <algorithm>
#include <limits>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

constexpr int64_t L = 16;  // floats per vector
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();
constexpr int64_t AHEAD = 2;  // blocks between the one read and the one prefetched

struct Args {
  const float* q; int64_t q_row;  // q[i, h, d] at q + i * q_row + h * D + d
  const float* k; const float* v; const int64_t* tables; const int64_t* lens;
  float* out; int64_t out_row;
  int64_t H, D, BS, CAP, KV, R, W; float scale;  // CAP: a head's row of scores
};

// a . b over D floats (D a multiple of 16), in 16 lanes then summed (vectorizable
// without reassociating a single running sum).
static inline float dot(const float* a, const float* b, int64_t D) {
  float s[L] = {0.f};
  for (int64_t j = 0; j < D; j += L)
    for (int64_t l = 0; l < L; ++l) s[l] += a[j + l] * b[j + l];
  float t = 0.f;
  for (int64_t l = 0; l < L; ++l) t += s[l];
  return t;
}

// Portable path: one sequence, every head, a token at a time (scalar exp).
static void seq_scalar(const Args& a, int64_t i, float* acc, float* sb, float* mx, float* sum) {
  const int64_t H = a.H, D = a.D, BS = a.BS, R = a.R, row = a.KV * D, len = a.lens[i];
  const float* qi = a.q + i * a.q_row;
  std::fill(mx, mx + H, NEG_INF);
  std::fill(sum, sum + H, 0.f);
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t b = 0; b * BS < len; ++b) {
    const int64_t blk = a.tables[i * a.W + b], nt = std::min(BS, len - b * BS);
    const float* kb = a.k + blk * BS * row;
    const float* vb = a.v + blk * BS * row;
    for (int64_t t = 0; t < nt; ++t)
      for (int64_t hq = 0; hq < H; ++hq) {
        sb[hq * BS + t] = dot(qi + hq * D, kb + t * row + (hq / R) * D, D) * a.scale;
      }
    for (int64_t hq = 0; hq < H; ++hq) {
      float* s = sb + hq * BS;
      float m = mx[hq];
      for (int64_t t = 0; t < nt; ++t) m = std::max(m, s[t]);
      const float corr = std::exp(mx[hq] - m);  // exp(-inf) = 0 on the first block
      float total = sum[hq] * corr;
      for (int64_t t = 0; t < nt; ++t) total += (s[t] = std::exp(s[t] - m));
      sum[hq] = total;
      mx[hq] = m;
      float* o = acc + hq * D;
      for (int64_t d = 0; d < D; ++d) o[d] *= corr;
      for (int64_t t = 0; t < nt; ++t)
        for (int64_t d = 0; d < D; ++d) o[d] += s[t] * vb[t * row + (hq / R) * D + d];
    }
  }
  float* oi = a.out + i * a.out_row;
  for (int64_t hq = 0; hq < H; ++hq)
    for (int64_t d = 0; d < D; ++d) oi[hq * D + d] = acc[hq * D + d] / sum[hq];
}

#if defined(__AVX512F__)
// exp(x) for x <= 0 (a score minus its running maximum): 2^n exp(r), |r| <= ln2/2, exp(r)
// by its degree-7 Taylor polynomial (relative error ~1e-8 there); -inf and anything
// below -87 (under float's smallest normal) give 0, as std::exp would to within 1e-38.
static inline __m512 exp_neg(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GT_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

// Lane t of the result is the sum of v[t]'s 16 lanes: 16 dot products' horizontal sums
// in a tree of 15 shuffle-adds and one permute, not 16 separate reductions.
static inline __m512 sum16(const __m512* v) {
  __m512 w[8], z[4], u[2];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  for (int k = 0; k < 4; ++k)
    z[k] = _mm512_add_ps(_mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(w[2 * k], w[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    u[k] = _mm512_add_ps(_mm512_unpacklo_ps(z[2 * k], z[2 * k + 1]),
                         _mm512_unpackhi_ps(z[2 * k], z[2 * k + 1]));
  const __m512 s = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(u[0]), _mm512_castps_pd(u[1]))));
  // Lane 4a + b now holds v[4b + a]'s sum.
  const __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(idx, s);
}

// Scores of one query head (its queries, pre-scaled, in qv) over m <= 16 tokens whose K
// rows (this KV head's part) start at kr, row floats apart: lane t is token t's score.
// pf: the same rows of a block read later, whose rows t % R == phase are prefetched.
template <int ND, bool FULL>
static inline __m512 tile_scores(const __m512* qv, const float* kr, int64_t row, int64_t m,
                                 const float* pf, int64_t R, int64_t phase) {
  __m512 part[L];
  for (int64_t t = 0; t < L; ++t) {
    if (!FULL && t >= m) {
      part[t] = _mm512_setzero_ps();
      continue;
    }
    if (pf && t % R == phase)
      for (int d = 0; d < ND; ++d) __builtin_prefetch(pf + t * row + d * L, 0, 1);
    __m512 s = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr + t * row));
    for (int d = 1; d < ND; ++d)
      s = _mm512_fmadd_ps(qv[d], _mm512_loadu_ps(kr + t * row + d * L), s);
    part[t] = s;
  }
  return sum16(part);
}

// acc[g] (+)= sum_t p[g][t] V[t] for G query heads on one KV head over one block's nt
// tokens: the V rows read once for the G heads, their accumulators in registers.
template <int ND, int G>
static inline void block_values(const float* vr, int64_t row, int64_t nt, const float* p,
                                int64_t cap, float* acc, int64_t D, bool first,
                                const float* pf) {
  __m512 av[G][ND];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d)
      av[g][d] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + g * D + d * L);
  for (int64_t t = 0; t < nt; ++t) {
    if (pf)
      for (int d = 0; d < ND; ++d) __builtin_prefetch(pf + t * row + d * L, 0, 1);
    __m512 vv[ND];
    for (int d = 0; d < ND; ++d) vv[d] = _mm512_loadu_ps(vr + t * row + d * L);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * cap + t]);
      for (int d = 0; d < ND; ++d) av[g][d] = _mm512_fmadd_ps(pg, vv[d], av[g][d]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(acc + g * D + d * L, av[g][d]);
}

// One sequence in two passes over its blocks. Pass 1: every query head's scores (a
// block's K rows read once from memory; the query heads after a KV head's first find them
// in L1) into that head's row of sb (cap floats: the batch's longest context); then per
// head one max, one exp and one sum over the whole context, so no running rescale and no
// per-block reductions; pass 2: V rows read once per block and KV head for all its query
// heads. ahead[j]: the block to prefetch while this sequence reads its j-th (K blocks
// first, then V), or null. qs: the queries pre-scaled; inv: each head's 1 / sum.
template <int ND>
static void seq_avx512(const Args& a, int64_t i, const float* const* ahead, float* acc,
                       float* sb, float* qs, float* inv) {
  const int64_t H = a.H, D = a.D, BS = a.BS, R = a.R, KV = a.KV, row = KV * D;
  const int64_t len = a.lens[i], cap = a.CAP, nblk = (len + BS - 1) / BS;
  const int64_t block = BS * row;
  const int64_t* tab = a.tables + i * a.W;
  const float* qi = a.q + i * a.q_row;
  for (int64_t j = 0; j < H * D; ++j) qs[j] = qi[j] * a.scale;
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t nt = std::min(BS, len - b * BS);
    const float* kb = a.k + tab[b] * block;
    const float* pfb = ahead[b];
    for (int64_t kh = 0; kh < KV; ++kh)
      for (int64_t hq = kh * R; hq < (kh + 1) * R; ++hq) {
        // The later block's rows of this KV head, each asked for by one of its query
        // heads in turn (R times fewer per head than one head asking for all of them).
        const float* pfk = pfb ? pfb + kh * D : nullptr;
        const int64_t phase = hq - kh * R;
        __m512 qv[ND];
        for (int d = 0; d < ND; ++d) qv[d] = _mm512_loadu_ps(qs + hq * D + d * L);
        float* s = sb + hq * cap + b * BS;
        for (int64_t t0 = 0; t0 < nt; t0 += L) {
          const float* kr = kb + t0 * row + kh * D;
          const float* pf = pfk ? pfk + t0 * row : nullptr;
          if (nt - t0 >= L) {
            _mm512_storeu_ps(s + t0, tile_scores<ND, true>(qv, kr, row, L, pf, R, phase));
          } else {
            const int64_t m = nt - t0;
            _mm512_mask_storeu_ps(s + t0, static_cast<__mmask16>((1u << m) - 1),
                                  tile_scores<ND, false>(qv, kr, row, m, pf, R, phase));
          }
        }
      }
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % L ? len % L : L)) - 1);
  const int64_t last = (len - 1) / L * L;
  for (int64_t hq = 0; hq < H; ++hq) {
    float* s = sb + hq * cap;
    __m512 mv = _mm512_set1_ps(NEG_INF);
    for (int64_t t0 = 0; t0 < last; t0 += L) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t0));
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(NEG_INF), tail, s + last));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 tot = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < last; t0 += L) {
      const __m512 p = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + t0), m));
      _mm512_storeu_ps(s + t0, p);
      tot = _mm512_add_ps(tot, p);
    }
    const __m512 p = _mm512_maskz_mov_ps(
        tail, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + last), m)));
    _mm512_mask_storeu_ps(s + last, tail, p);
    inv[hq] = 1.f / _mm512_reduce_add_ps(_mm512_add_ps(tot, p));
  }
  for (int64_t b = 0; b < nblk; ++b) {  // pass 2
    const int64_t nt = std::min(BS, len - b * BS);
    const float* vb = a.v + tab[b] * block;
    const float* pfb = ahead[nblk + b];
    for (int64_t kh = 0; kh < KV; ++kh)
      for (int64_t h0 = kh * R; h0 < (kh + 1) * R; h0 += 4) {
        const float* vr = vb + kh * D;
        const float* p = sb + h0 * cap + b * BS;
        float* ac = acc + h0 * D;
        const float* pf = pfb && h0 == kh * R ? pfb + kh * D : nullptr;
        switch (std::min<int64_t>(4, (kh + 1) * R - h0)) {
          case 1: block_values<ND, 1>(vr, row, nt, p, cap, ac, D, b == 0, pf); break;
          case 2: block_values<ND, 2>(vr, row, nt, p, cap, ac, D, b == 0, pf); break;
          case 3: block_values<ND, 3>(vr, row, nt, p, cap, ac, D, b == 0, pf); break;
          default: block_values<ND, 4>(vr, row, nt, p, cap, ac, D, b == 0, pf);
        }
      }
  }
  float* oi = a.out + i * a.out_row;
  for (int64_t hq = 0; hq < H; ++hq) {
    const __m512 iv = _mm512_set1_ps(inv[hq]);
    for (int64_t d = 0; d < D; d += L)
      _mm512_storeu_ps(oi + hq * D + d, _mm512_mul_ps(_mm512_loadu_ps(acc + hq * D + d), iv));
  }
}
#endif

// out[i, h*R + r, :] = softmax(q_r . K^T * scale) V over sequence i's first lens[i]
// cached tokens, for every KV head h; K/V rows read from the cache through the table.
void paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& tables,
                  const torch::Tensor& lens, const torch::Tensor& out, double scale) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && k_cache.dtype() == torch::kFloat32 &&
              v_cache.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32,
              "paged_decode: float32 only");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64,
              "paged_decode: block tables and lengths must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() &&
              tables.is_contiguous() && lens.is_contiguous(),
              "paged_decode: contiguous cache, tables and lengths only");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.dim() == 4 && q.dim() == 3,
              "paged_decode: cache or query shape");
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2);
  // Queries and output may be rows of a wider tensor (q is a view of the fused QKV
  // projection): each row's heads must be packed, the rows may be apart.
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && out.stride(2) == 1 &&
              out.stride(1) == D, "paged_decode: each row's heads must be contiguous");
  const int64_t NB = k_cache.size(0), BS = k_cache.size(1), KV = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % L == 0,
              "paged_decode: head_dim must be a multiple of 16");
  TORCH_CHECK(H % KV == 0, "paged_decode: heads must be a multiple of KV heads");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == n && lens.size(0) == n &&
              out.sizes() == q.sizes(), "paged_decode: batch shapes");
  const int64_t W = tables.size(1);
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  // Bad tables are refused before any read: no read leaves the cache.
  std::vector<int64_t> cost(n + 1, 0);  // prefix sums of each sequence's work
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= W * BS, "paged_decode: context length out of range");
    for (int64_t b = 0; b < (lp[i] + BS - 1) / BS; ++b)
      TORCH_CHECK(tp[i * W + b] >= 0 && tp[i * W + b] < NB, "paged_decode: block id out of range");
    cost[i + 1] = cost[i] + lp[i] + 2 * BS;  // a fixed share per sequence for its setup
  }
  int64_t longest = BS;
  for (int64_t i = 0; i < n; ++i) longest = std::max(longest, lp[i]);
  const int64_t CAP = (longest + L - 1) / L * L + L;
  const Args a{q.data_ptr<float>(), q.stride(0), k_cache.data_ptr<float>(),
               v_cache.data_ptr<float>(), tp, lp, out.data_ptr<float>(), out.stride(0),
               H, D, BS, CAP, KV, H / KV, W, static_cast<float>(scale)};
  // Threads split the batch by work (context lengths), not by count: a static split of
  // mixed contexts left one thread idle while the other finished the long ones.
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> bounds(parts + 1, n);
  bounds[0] = 0;
  for (int64_t p = 1, i = 0; p < parts; ++p) {
    while (i < n && cost[i] * parts < cost[n] * p) ++i;
    bounds[p] = i;
  }
  at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(H * D), sb(H * CAP), mx(H), sum(H), qs(H * D);
    // The blocks in the order this thread reads them (a sequence's K blocks, then its V
    // blocks, then the next sequence's): while one is read, the one AHEAD places later
    // is asked for into L2, a token row at a time (a burst of a whole block's lines at
    // the block's start stalled on the core's few miss buffers).
    std::vector<const float*> order;
    std::vector<int64_t> start;
    for (int64_t i = bounds[p0]; i < bounds[p1]; ++i) {
      start.push_back(order.size());
      const int64_t nb = (lp[i] + BS - 1) / BS;
      for (int64_t b = 0; b < nb; ++b) order.push_back(a.k + tp[i * W + b] * BS * KV * D);
      for (int64_t b = 0; b < nb; ++b) order.push_back(a.v + tp[i * W + b] * BS * KV * D);
    }
    order.resize(order.size() + AHEAD, nullptr);
    for (int64_t i = bounds[p0]; i < bounds[p1]; ++i) {
#if defined(__AVX512F__)
      const float* const* ahead = order.data() + start[i - bounds[p0]] + AHEAD;
      switch (D / L) {
        case 1: seq_avx512<1>(a, i, ahead, acc.data(), sb.data(), qs.data(), sum.data()); continue;
        case 2: seq_avx512<2>(a, i, ahead, acc.data(), sb.data(), qs.data(), sum.data()); continue;
        case 4: seq_avx512<4>(a, i, ahead, acc.data(), sb.data(), qs.data(), sum.data()); continue;
        case 8: seq_avx512<8>(a, i, ahead, acc.data(), sb.data(), qs.data(), sum.data()); continue;
        default: break;
      }
#endif
      seq_scalar(a, i, acc.data(), sb.data(), mx.data(), sum.data());
    }
  });
}

// A decode-only step's layer in one call: k/v rows (views of the fused q/k/v projection)
// copied into the cache at slots[t] as index_copy_ would, every slot checked first, then
// paged_decode into a new output: the two-call path's bytes, without its Python.
torch::Tensor write_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& slots, const torch::Tensor& tables,
                           const torch::Tensor& lens) {
  const int64_t T = slots.size(0), KV = k_cache.size(2), D = k_cache.size(3), row = KV * D;
  TORCH_CHECK(k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
              k_cache.sizes() == v_cache.sizes() && slots.dtype() == torch::kInt64 &&
              slots.is_contiguous() && slots.dim() == 1 && q.dim() == 3 && q.size(0) == T &&
              k.dim() == 3 && k.size(0) == T && k.size(1) == KV && k.size(2) == D &&
              k.sizes() == v.sizes() && k.stride(2) == 1 && k.stride(1) == D &&
              v.stride(2) == 1 && v.stride(1) == D, "write_decode: k/v, slots or cache shape");
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < k_cache.size(0) * k_cache.size(1),
                "write_decode: slot out of range");
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) {
    std::copy_n(k.data_ptr<float>() + t * k.stride(0), row, kc + sp[t] * row);
    std::copy_n(v.data_ptr<float>() + t * v.stride(0), row, vc + sp[t] * row);
  }
  torch::Tensor out = torch::empty(q.sizes(), q.options());  // scale: as Python's D ** -0.5
  paged_decode(q, k_cache, v_cache, tables, lens, out, std::pow(static_cast<double>(D), -0.5));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, py::call_guard<py::gil_scoped_release>());
  m.def("write_decode", &write_decode, py::call_guard<py::gil_scoped_release>());
}
"""

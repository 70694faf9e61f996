"""C++ source of the bfloat16 dot-product path (v9) of the CPU paged decode kernel.

A fragment, spliced into kernels/cpu_paged_decode.py's source after the AVX-512 helpers.
Where the compiler targets AVX512_BF16 (``__AVX512BF16__``) it defines ``seq_dot``: one
sequence over a bfloat16 cache with ``vdpbf16ps`` (32 bf16 multiply-adds into 16 float
lanes in one instruction) instead of widening each K/V element to float and multiplying
in float (v8), whose converts were the bound once K/V sat in L1. The query is rounded to
bfloat16 once per sequence and head, the probabilities once after the softmax; sums
stay float. Why each layout: services/engine/attention_paged_cpu.py.
"""

BF16_DOT = r"""
#if defined(__AVX512BF16__)
#define PDSERVE_BF16_DOT 1
static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Chunk c (32 bf16) of a row of ND * 16 bf16; the half chunk of an odd ND is read as
// 16 elements (a masked load reads nothing past the row) and zeros.
template <int ND>
static inline __m512i row_chunk(const void* r, int c) {
  const uint16_t* p = static_cast<const uint16_t*>(r) + 32 * c;
  if (2 * c + 1 < ND) return _mm512_loadu_si512(p);
  return _mm512_maskz_loadu_epi16(0xFFFF, p);
}

// Unscaled scores of one query head (its bf16 pairs in qv) over m <= 16 tokens whose K
// rows start at kr: one dot-product accumulator per token, summed across lanes by sum16.
// Prefetch as tile_scores (rows t % R == phase of the block read later).
template <int ND, bool FULL>
static inline __m512 tile_dots(const __m512i* qv, const bf16* kr, int64_t row, int64_t m,
                               const bf16* pf, int64_t R, int64_t phase) {
  constexpr int NC = (ND + 1) / 2;
  if (pf)  // a loop of its own: a t % R test in the one below cost a division per token
    for (int64_t t = phase; t < m; t += R)
      for (int d = 0; d < ND; d += PF<bf16>) __builtin_prefetch(pf + t * row + d * L, 0, 1);
  __m512 part[L];
  for (int64_t t = 0; t < L; ++t) {
    if (!FULL && t >= m) {
      part[t] = _mm512_setzero_ps();
      continue;
    }
    __m512 s = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(qv[0]), as_bh(row_chunk<ND>(kr, 0)));
    for (int c = 1; c < NC; ++c)
      s = _mm512_dpbf16_ps(s, as_bh(qv[c]), as_bh(row_chunk<ND>(kr, c)));
    part[t] = s;
    kr += row;
    // One pointer stepped a row at a time: left to itself the compiler kept 16 tokens'
    // row addresses per tile, more than the registers, and spilled them.
    asm("" : "+r"(kr));
  }
  return sum16(part);
}

// acc[g] (+)= sum_t p[g][t] V[t] for G query heads over one block's nt tokens, two tokens
// per instruction: V rows t and t+1 interleaved 16 bits at a time (unpacklo/hi, once for
// the G heads) against the broadcast pair (p_t, p_t+1). Lane order within a chunk's two
// accumulators is unpack's (d 0-3, 8-11, ... then 4-7, 12-15, ...); seq_dot restores it
// once at the end. An odd last token pairs with a zero row. acc: 32 * NC floats a head.
template <int ND, int G>
static inline void block_dots(const bf16* vr, int64_t row, int64_t nt, const uint16_t* p,
                              int64_t cap, float* acc, int64_t as, bool first, const bf16* pf) {
  constexpr int NC = (ND + 1) / 2;
  __m512 av[G][2 * NC];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 2 * NC; ++j)
      av[g][j] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + g * as + j * L);
  // Tokens t, t+1 (TWO) or t alone, paired with a zero row and a zero probability.
  auto step = [&](int64_t t, auto two) {
    constexpr bool TWO = decltype(two)::value;
    if (pf)
      for (int64_t u = t; u < t + 1 + TWO; ++u)
        for (int d = 0; d < ND; d += PF<bf16>) __builtin_prefetch(pf + u * row + d * L, 0, 1);
    __m512i vv[2 * NC];
    for (int c = 0; c < NC; ++c) {
      const __m512i x = row_chunk<ND>(vr + t * row, c);
      const __m512i y = TWO ? row_chunk<ND>(vr + (t + 1) * row, c) : _mm512_setzero_si512();
      vv[2 * c] = _mm512_unpacklo_epi16(x, y);
      vv[2 * c + 1] = _mm512_unpackhi_epi16(x, y);
    }
    for (int g = 0; g < G; ++g) {
      int32_t pair;  // p_t in the low half, p_t+1 in the high
      std::memcpy(&pair, p + g * cap + t, sizeof pair);
      const __m512i pp = _mm512_set1_epi32(TWO ? pair : pair & 0xFFFF);
      for (int j = 0; j < 2 * NC; ++j)
        av[g][j] = _mm512_dpbf16_ps(av[g][j], as_bh(pp), as_bh(vv[j]));
    }
  };
  int64_t t = 0;
  for (; t + 1 < nt; t += 2) step(t, std::true_type{});
  if (t < nt) step(t, std::false_type{});
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 2 * NC; ++j) _mm512_storeu_ps(acc + g * as + j * L, av[g][j]);
}

// seq_avx512's two passes over a bfloat16 cache with dot products. qb: the query rounded
// (H * D bf16); pb: each head's probabilities rounded (H rows of cap bf16), the softmax's
// sum taken over the rounded values so the weights applied sum to one; acc: H heads of
// 32 * NC floats.
template <int ND>
static void seq_dot(const Args<bf16>& a, int64_t i, const bf16* const* ahead, float* acc,
                    float* sb, uint16_t* pb, uint16_t* qb, float* inv) {
  constexpr int NC = (ND + 1) / 2;
  const int64_t H = a.H, D = a.D, BS = a.BS, R = a.R, KV = a.KV, row = KV * D, as = 32 * NC;
  const int64_t len = a.lens[i], cap = a.CAP, nblk = (len + BS - 1) / BS, block = BS * row;
  const int64_t* tab = a.tables + i * a.W;
  const float* qi = a.q + i * a.q_row;
  for (int64_t j = 0; j < H * D; j += L)  // nearest, ties to even: as Tensor.to(bfloat16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + j),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(qi + j)));
  const __m512 scale = _mm512_set1_ps(a.scale);
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t nt = std::min(BS, len - b * BS);
    const bf16* kb = a.k + tab[b] * block;
    const bf16* pfb = ahead[b];
    for (int64_t kh = 0; kh < KV; ++kh)
      for (int64_t hq = kh * R; hq < (kh + 1) * R; ++hq) {
        const bf16* pfk = pfb ? pfb + kh * D : nullptr;
        const int64_t phase = hq - kh * R;
        __m512i qv[NC];
        for (int c = 0; c < NC; ++c) qv[c] = row_chunk<ND>(qb + hq * D, c);
        float* s = sb + hq * cap + b * BS;
        for (int64_t t0 = 0; t0 < nt; t0 += L) {
          const bf16* kr = kb + t0 * row + kh * D;
          const bf16* pf = pfk ? pfk + t0 * row : nullptr;
          if (nt - t0 >= L) {
            _mm512_storeu_ps(s + t0, _mm512_mul_ps(
                scale, tile_dots<ND, true>(qv, kr, row, L, pf, R, phase)));
          } else {
            const int64_t m = nt - t0;
            _mm512_mask_storeu_ps(s + t0, static_cast<__mmask16>((1u << m) - 1), _mm512_mul_ps(
                scale, tile_dots<ND, false>(qv, kr, row, m, pf, R, phase)));
          }
        }
      }
  }
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % L ? len % L : L)) - 1);
  const int64_t last = (len - 1) / L * L;
  for (int64_t hq = 0; hq < H; ++hq) {
    const float* s = sb + hq * cap;
    uint16_t* p = pb + hq * cap;
    __m512 mv = _mm512_set1_ps(NEG_INF);
    for (int64_t t0 = 0; t0 < last; t0 += L) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t0));
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(_mm512_set1_ps(NEG_INF), tail, s + last));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 tot = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 <= last; t0 += L) {  // the last 16 with zeros past the end
      const __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + t0), m));
      const __m256bh r = _mm512_cvtneps_pbh(t0 < last ? e : _mm512_maskz_mov_ps(tail, e));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t0), (__m256i)r);
      tot = _mm512_add_ps(tot, _mm512_cvtpbh_ps(r));
    }
    inv[hq] = 1.f / _mm512_reduce_add_ps(tot);
  }
  for (int64_t b = 0; b < nblk; ++b) {  // pass 2
    const int64_t nt = std::min(BS, len - b * BS);
    const bf16* vb = a.v + tab[b] * block;
    const bf16* pfb = ahead[nblk + b];
    const int64_t gmax = ND >= 8 ? 2 : 4;  // accumulators in registers: G * 2 * NC <= 16
    for (int64_t kh = 0; kh < KV; ++kh)
      for (int64_t h0 = kh * R; h0 < (kh + 1) * R; h0 += gmax) {
        const bf16* vr = vb + kh * D;
        const uint16_t* p = pb + h0 * cap + b * BS;
        float* ac = acc + h0 * as;
        const bf16* pf = pfb && h0 == kh * R ? pfb + kh * D : nullptr;
        switch (std::min<int64_t>(gmax, (kh + 1) * R - h0)) {
          case 1: block_dots<ND, 1>(vr, row, nt, p, cap, ac, as, b == 0, pf); break;
          case 2: block_dots<ND, 2>(vr, row, nt, p, cap, ac, as, b == 0, pf); break;
          case 3: block_dots<ND, 3>(vr, row, nt, p, cap, ac, as, b == 0, pf); break;
          default: block_dots<ND, 4>(vr, row, nt, p, cap, ac, as, b == 0, pf);
        }
      }
  }
  // Back to d order: lo lanes 4k..4k+3 hold d 8k..8k+3, hi lanes d 8k+4..8k+7.
  const __m512i lo_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29,
                                            30, 31);
  float* oi = a.out + i * a.out_row;
  for (int64_t hq = 0; hq < H; ++hq) {
    const __m512 iv = _mm512_set1_ps(inv[hq]);
    for (int c = 0; c < NC; ++c) {
      const __m512 lo = _mm512_loadu_ps(acc + hq * as + 2 * c * L);
      const __m512 hi = _mm512_loadu_ps(acc + hq * as + (2 * c + 1) * L);
      float* o = oi + hq * D + 32 * c;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_permutex2var_ps(lo, lo_half, hi), iv));
      if (2 * c + 1 < ND)
        _mm512_storeu_ps(o + L, _mm512_mul_ps(_mm512_permutex2var_ps(lo, hi_half, hi), iv));
    }
  }
}

// seq_dot for this head size, or false where it has none (the caller widens instead).
static bool seq_dots(const Args<bf16>& a, int64_t i, const bf16* const* ahead, float* acc,
                     float* sb, uint16_t* pb, uint16_t* qb, float* inv) {
  switch (a.D / L) {
    case 1: seq_dot<1>(a, i, ahead, acc, sb, pb, qb, inv); return true;
    case 2: seq_dot<2>(a, i, ahead, acc, sb, pb, qb, inv); return true;
    case 4: seq_dot<4>(a, i, ahead, acc, sb, pb, qb, inv); return true;
    case 8: seq_dot<8>(a, i, ahead, acc, sb, pb, qb, inv); return true;
    default: return false;
  }
}
#endif
"""

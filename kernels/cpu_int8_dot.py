"""C++ source of the int8-cache paths (v10) of the CPU paged decode kernel.

A fragment, spliced into kernels/cpu_paged_decode.py's source after the AVX-512 helpers
and before the batch loop. An int8 cache's rows are ``D`` int8 values then the row's
float32 scale (kernels/kv_int8.py). It defines:

- ``quantize_row``: a float row to that format, as kernels/kv_int8.py's torch
  reference does (the same division and rounding, so the same bytes);
- ``seq_i8_scalar``: the portable path, each row dequantized as it is read;
- where the compiler targets AVX512_VNNI and AVX512BW, ``seq_i8``: scores as integer
  dot products (``vpdpbusd``: 64 u8 x s8 products into 16 int32 lanes in one
  instruction), the query quantized per (sequence, head) the same symmetric way. The
  unsigned operand is the K row with its sign bit flipped (k + 128), so each dot product
  carries 128 * sum(q), subtracted once per head. Values: each V row widened to float
  (its int8 values, exact) against the probability times the row's scale, shared by the
  KV head's query heads. Why: services/engine/attention_paged_cpu.py.
"""

INT8_DOT = r"""
static inline float row_scale(const int8_t* r, int64_t D) {  // the float32 after D values
  float s;
  std::memcpy(&s, r + D, sizeof s);
  return s;
}

// x's D floats as int8 in out: scale = max|x| / 127, round(x / scale), ties to even (the
// default rounding mode, as torch.round); returns the scale (0 for a row of zeros).
// Vectorized where D is whole vectors (the same IEEE division and rounding: the same
// bytes); a step's queries and new K/V rows are quantized here, ~60k values a layer.
static inline float quantize_values(const float* x, int8_t* out, int64_t D) {
#if defined(__AVX512F__)
  if (D % 16 == 0) {
    __m512 mv = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16)
      mv = _mm512_max_ps(mv, _mm512_abs_ps(_mm512_loadu_ps(x + d)));
    const float scale = _mm512_reduce_max_ps(mv) / 127.f;
    const __m512 div = _mm512_set1_ps(scale > 0.f ? scale : 1.f);
    const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
    for (int64_t d = 0; d < D; d += 16) {
      __m512 r = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + d), div),
                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      r = _mm512_min_ps(hi, _mm512_max_ps(lo, r));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + d),
                       _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(r)));
    }
    return scale;
  }
#endif
  float amax = 0.f;
  for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(x[d]));
  const float scale = amax / 127.f, div = scale > 0.f ? scale : 1.f;
  for (int64_t d = 0; d < D; ++d)
    out[d] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[d] / div))));
  return scale;
}

static inline void quantize_row(const float* x, int8_t* out, int64_t D) {
  const float scale = quantize_values(x, out, D);
  std::memcpy(out + D, &scale, sizeof scale);
}

// Portable path: one sequence over an int8 cache, every row dequantized as it is read;
// the scores of the whole context first (sb), then the softmax, then the values.
static void seq_i8_scalar(const Args<int8_t>& a, int64_t i, float* acc, float* sb, float* inv) {
  const int64_t H = a.H, D = a.D, BS = a.BS, R = a.R, RS = a.RS, row = a.KV * RS;
  const int64_t len = a.lens[i], cap = a.CAP;
  const float* qi = a.q + i * a.q_row;
  for (int64_t t = 0; t < len; ++t) {
    const int8_t* kt = a.k + (a.tables[i * a.W + t / BS] * BS + t % BS) * row;
    for (int64_t hq = 0; hq < H; ++hq) {
      const int8_t* kr = kt + (hq / R) * RS;
      float s = 0.f;
      for (int64_t d = 0; d < D; ++d) s += qi[hq * D + d] * static_cast<float>(kr[d]);
      sb[hq * cap + t] = s * row_scale(kr, D) * a.scale;
    }
  }
  for (int64_t hq = 0; hq < H; ++hq) {
    float* s = sb + hq * cap;
    const float m = *std::max_element(s, s + len);
    float total = 0.f;
    for (int64_t t = 0; t < len; ++t) total += (s[t] = std::exp(s[t] - m));
    inv[hq] = 1.f / total;
  }
  std::fill(acc, acc + H * D, 0.f);
  for (int64_t t = 0; t < len; ++t) {
    const int8_t* vt = a.v + (a.tables[i * a.W + t / BS] * BS + t % BS) * row;
    for (int64_t hq = 0; hq < H; ++hq) {
      const int8_t* vr = vt + (hq / R) * RS;
      const float w = sb[hq * cap + t] * row_scale(vr, D);
      for (int64_t d = 0; d < D; ++d) acc[hq * D + d] += w * static_cast<float>(vr[d]);
    }
  }
  float* oi = a.out + i * a.out_row;
  for (int64_t hq = 0; hq < H; ++hq)
    for (int64_t d = 0; d < D; ++d) oi[hq * D + d] = acc[hq * D + d] * inv[hq];
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PDSERVE_I8_DOT 1
// Chunk c (64 bytes) of an int8 row of ND * 16 values; a shorter last chunk masked to
// zeros (nothing read past the values: the scale follows them).
template <int ND>
static inline __m512i i8_chunk(const int8_t* r, int c) {
  constexpr int64_t D = 16 * ND;
  if (64 * (c + 1) <= D) return _mm512_loadu_si512(r + 64 * c);
  return _mm512_maskz_loadu_epi8((__mmask64)((1ull << (D - 64 * c)) - 1), r + 64 * c);
}

// Lane t: sum_d (k_t[d] + 128) * q[d] over m <= 16 tokens whose K rows start at kr, row
// bytes apart (exact in float: at most 16 * 4 * 4 * 255 * 127 < 2^24).
template <int ND, bool FULL>
static inline __m512 tile_i8(const __m512i* qv, const int8_t* kr, int64_t row, int64_t m) {
  constexpr int NC = (ND + 3) / 4;
  const __m512i flip = _mm512_set1_epi8(-128);
  __m512 part[L];
  for (int64_t t = 0; t < L; ++t) {
    if (!FULL && t >= m) {
      part[t] = _mm512_setzero_ps();
      continue;
    }
    __m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(),
                                    _mm512_xor_si512(i8_chunk<ND>(kr, 0), flip), qv[0]);
    for (int c = 1; c < NC; ++c)
      s = _mm512_dpbusd_epi32(s, _mm512_xor_si512(i8_chunk<ND>(kr, c), flip), qv[c]);
    part[t] = _mm512_cvtepi32_ps(s);
    kr += row;
    asm("" : "+r"(kr));  // one pointer stepped, not 16 kept (as tile_dots)
  }
  return sum16(part);
}

// Part j of a block read later, into L2: its lines [j step, (j + 1) step) >> 16, where
// step = ceil(lines * 65536 / parts) (part_step), so a block's parts asked for one by one
// through the work on this one cover it, each line once. Prefetching each row's lines
// asked for most lines twice (rows are D + 4 bytes) and stalled on the core's miss
// buffers; fixed point, because a division a token cost as much as the token's work.
static inline int64_t part_step(int64_t lines, int64_t parts) {
  return ((lines << 16) + parts - 1) / parts;
}

static inline void prefetch_part(const int8_t* p, int64_t step, int64_t j) {
  for (int64_t l = (j * step) >> 16; l < ((j + 1) * step) >> 16; ++l)
    __builtin_prefetch(p + 64 * l, 0, 1);
}

// acc[g] (+)= sum_t p[g][t] * scale_t * V_t for G query heads over one block's nt tokens:
// each V row widened to float once for the G heads, their accumulators in registers.
template <int ND, int G>
static inline void block_values_i8(const int8_t* vr, int64_t row, int64_t nt,
                                   const float* p, int64_t cap, float* acc, bool first,
                                   const int8_t* pf, int64_t step, int64_t j0) {
  constexpr int64_t D = 16 * ND;
  __m512 av[G][ND];
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d)
      av[g][d] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + g * D + d * L);
  for (int64_t t = 0; t < nt; ++t) {
    const int8_t* r = vr + t * row;
    if (pf) prefetch_part(pf, step, j0 + t);
    __m512 vv[ND];
    for (int d = 0; d < ND; ++d)
      vv[d] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + d * L))));
    const float vs = row_scale(r, D);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * cap + t] * vs);
      for (int d = 0; d < ND; ++d) av[g][d] = _mm512_fmadd_ps(pg, vv[d], av[g][d]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int d = 0; d < ND; ++d) _mm512_storeu_ps(acc + g * D + d * L, av[g][d]);
}

// seq_avx512's two passes over an int8 cache. q8: each head's query quantized (64 * NC
// bytes a head, zero past D); qf: each head's q scale times the softmax scale, then
// 128 * sum(q8) (the flipped sign bit's share of each dot product).
template <int ND>
static void seq_i8(const Args<int8_t>& a, int64_t i, const int8_t* const* ahead, float* acc,
                   float* sb, int8_t* q8, float* qf, float* inv) {
  constexpr int NC = (ND + 3) / 4;
  constexpr int64_t D = 16 * ND, QS = 64 * NC;
  const int64_t H = a.H, BS = a.BS, R = a.R, KV = a.KV, RS = a.RS, row = KV * RS;
  const int64_t len = a.lens[i], cap = a.CAP, nblk = (len + BS - 1) / BS, block = BS * row;
  const int64_t* tab = a.tables + i * a.W;
  const float* qi = a.q + i * a.q_row;
  const int64_t lines = (block + 127) / 64;  // a block's lines, wherever it starts
  const int64_t kstep = part_step(lines, H);
  float* corr = qf + H;
  for (int64_t hq = 0; hq < H; ++hq) {
    int8_t* qh = q8 + hq * QS;
    std::fill(qh + D, qh + QS, int8_t{0});
    qf[hq] = quantize_values(qi + hq * D, qh, D) * a.scale;
    int32_t total = 0;
    for (int64_t d = 0; d < D; ++d) total += qh[d];
    corr[hq] = 128.f * static_cast<float>(total);
  }
  for (int64_t b = 0; b < nblk; ++b) {
    const int64_t nt = std::min(BS, len - b * BS);
    const int8_t* kb = a.k + tab[b] * block;
    const int8_t* pfb = ahead[b];
    for (int64_t kh = 0; kh < KV; ++kh)
      for (int64_t t0 = 0; t0 < nt; t0 += L) {
        const int64_t m = std::min(L, nt - t0);
        const int8_t* kr = kb + t0 * row + kh * RS;
        float ks[L] = {0.f};  // the tile's K row scales, shared by the KV head's heads
        for (int64_t t = 0; t < m; ++t) ks[t] = row_scale(kr + t * row, D);
        const __m512 ksv = _mm512_loadu_ps(ks);
        const __mmask16 keep = static_cast<__mmask16>((1u << m) - 1);
        for (int64_t hq = kh * R; hq < (kh + 1) * R; ++hq) {
          __m512i qv[NC];
          for (int c = 0; c < NC; ++c) qv[c] = _mm512_loadu_si512(q8 + hq * QS + 64 * c);
          if (pfb && t0 == 0) prefetch_part(pfb, kstep, hq);  // the block, once
          const __m512 dots = m == L ? tile_i8<ND, true>(qv, kr, row, L)
                                     : tile_i8<ND, false>(qv, kr, row, m);
          const __m512 s = _mm512_mul_ps(
              _mm512_mul_ps(_mm512_sub_ps(dots, _mm512_set1_ps(corr[hq])),
                            _mm512_set1_ps(qf[hq])), ksv);
          _mm512_mask_storeu_ps(sb + hq * cap + b * BS + t0, keep, s);
        }
      }
  }
  softmax_rows(sb, H, cap, len, inv);
  constexpr int64_t gmax = ND >= 8 ? 2 : 4;  // accumulators in registers
  for (int64_t b = 0; b < nblk; ++b) {  // pass 2
    const int64_t nt = std::min(BS, len - b * BS);
    const int8_t* vb = a.v + tab[b] * block;
    const int8_t* pfb = ahead[nblk + b];
    const int64_t vstep = part_step(lines, KV * nt);
    for (int64_t kh = 0; kh < KV; ++kh)
      for (int64_t h0 = kh * R; h0 < (kh + 1) * R; h0 += gmax) {
        const int8_t* vr = vb + kh * RS;
        const float* p = sb + h0 * cap + b * BS;
        float* ac = acc + h0 * D;
        const int8_t* pf = h0 == kh * R ? pfb : nullptr;
        const int64_t j = kh * nt;  // token t's share of the V block: part j + t
        auto go = [&](auto g) {
          block_values_i8<ND, decltype(g)::value>(vr, row, nt, p, cap, ac, b == 0, pf, vstep, j);
        };
        switch (std::min<int64_t>(gmax, (kh + 1) * R - h0)) {
          case 1: go(std::integral_constant<int, 1>{}); break;
          case 2: go(std::integral_constant<int, 2>{}); break;
          case 3: go(std::integral_constant<int, 3>{}); break;
          default: go(std::integral_constant<int, 4>{});
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

// seq_i8 for this head size, or false where it has none (the caller dequantizes instead).
static bool seq_i8s(const Args<int8_t>& a, int64_t i, const int8_t* const* ahead, float* acc,
                    float* sb, float* q8, float* qf, float* inv) {
#if defined(PDSERVE_I8_DOT)
  int8_t* qb = reinterpret_cast<int8_t*>(q8);
  switch (a.D / L) {
    case 1: seq_i8<1>(a, i, ahead, acc, sb, qb, qf, inv); return true;
    case 2: seq_i8<2>(a, i, ahead, acc, sb, qb, qf, inv); return true;
    case 4: seq_i8<4>(a, i, ahead, acc, sb, qb, qf, inv); return true;
    case 8: seq_i8<8>(a, i, ahead, acc, sb, qb, qf, inv); return true;
    default: return false;
  }
#else
  return false;
#endif
}
"""

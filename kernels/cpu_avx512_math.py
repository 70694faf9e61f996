"""C++ source of AVX-512 float helpers for kernels/cpu_paged_decode.py: a vectorized
``exp`` of non-positive arguments, 16 horizontal sums at once, and the softmax of a
sequence's rows of scores. A fragment, spliced
into that kernel's source inside its ``#if defined(__AVX512F__)`` block.
"""

AVX512_MATH = r"""
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

// Each of H rows of scores (row hq at sb + hq * cap, len valid) to exp(s - max) in place,
// and inv[hq] = 1 / their sum: one maximum, one exp and one sum over the whole context.
static inline void softmax_rows(float* sb, int64_t H, int64_t cap, int64_t len, float* inv) {
  const __mmask16 tail = static_cast<__mmask16>((1u << (len % 16 ? len % 16 : 16)) - 1);
  const int64_t last = (len - 1) / 16 * 16;
  for (int64_t hq = 0; hq < H; ++hq) {
    float* s = sb + hq * cap;
    __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t0 = 0; t0 < last; t0 += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(s + t0));
    mv = _mm512_max_ps(mv, _mm512_mask_loadu_ps(mv, tail, s + last));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
    __m512 tot = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < last; t0 += 16) {
      const __m512 p = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + t0), m));
      _mm512_storeu_ps(s + t0, p);
      tot = _mm512_add_ps(tot, p);
    }
    const __m512 p = _mm512_maskz_mov_ps(
        tail, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + last), m)));
    _mm512_mask_storeu_ps(s + last, tail, p);
    inv[hq] = 1.f / _mm512_reduce_add_ps(_mm512_add_ps(tot, p));
  }
}
"""

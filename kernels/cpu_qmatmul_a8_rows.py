"""Many activation rows times a packed weight of kernels/cpu_qmatmul_a8.py, in float32.

Steps of more than 8 rows (prefill chunks, decode batches with a chunk in them) are
compute-bound: each weight is used by every row, so they keep the activations unrounded
and multiply in float, as the torch expansion path (``cpu_qmatmul_a8._expanded``) does.
What that path pays for is the expansion: six torch passes over a float copy of every
weight slice per call, which at 16-128 rows costs as much as the product itself.

Here each pair of 16-row blocks (32 output columns) is decoded once per call, in one
pass, into a float buffer laid out ``[K, 32]`` that stays in the core's L2 (72 KiB at
K = 576, 192 KiB at K = 1536), and a register-tiled micro-kernel runs every activation
row over it: up to 12 rows at a time, 24 accumulators of 16 columns, one broadcast of
an activation per two fused multiply-adds. The buffer's 32 columns line up with the
layout's per-block scales (16 lanes of one register), so decoding a group is one byte
permutation (``vpermb``: row-major quads to input-major), four widenings and a multiply
and add per 16 weights. Blocks are shared out over torch's intra-op threads.

A weight is ``code * scale + offset`` rounded once per operation, as the torch
expansion computes it, so the product differs from ``x @ W.T`` on the expanded weight
only by summation order. Without AVX-512 VBMI the same loops are plain C++.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import CppKernel

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <vector>
#if defined(__AVX512F__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#define PD_VBMI 1
#endif

// Block b's 16 columns into buf[k * 32 + col0 + j] for every input k.
static void decode_block(const uint8_t* packed, const float* scale, const float* offset,
                         int64_t bits, int64_t G, int64_t b, float* buf, int col0) {
  const int64_t GB = 16 * 32 * bits / 8;
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* w = packed + (b * G + g) * GB;
    const float* s = scale + (b * G + g) * 16;
    const float* o = offset + (b * G + g) * 16;
#if defined(PD_VBMI)
    // byte j * 4 + t (row j, input t of the quad) -> position t * 16 + j
    alignas(64) static const uint8_t order[64] = {
        0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
        1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61,
        2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62,
        3, 7, 11, 15, 19, 23, 27, 31, 35, 39, 43, 47, 51, 55, 59, 63};
    const __m512i idx = _mm512_load_si512((const void*)order);
    const __m512i low = _mm512_set1_epi8(15);
    const __m512 sv = _mm512_loadu_ps(s), ov = _mm512_loadu_ps(o);
    for (int i = 0; i < 8; ++i) {
      __m512i v;
      if (bits == 8) {
        v = _mm512_loadu_si512((const void*)(w + i * 64));
      } else {
        v = _mm512_loadu_si512((const void*)(w + (i >> 1) * 64));
        if (i & 1) v = _mm512_srli_epi16(v, 4);
        v = _mm512_and_si512(v, low);
      }
      v = _mm512_permutexvar_epi8(idx, v);
      for (int t = 0; t < 4; ++t) {
        const __m128i c8 = _mm512_extracti32x4_epi32(v, t);
        const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(c8));
        _mm512_storeu_ps(buf + (g * 32 + i * 4 + t) * 32 + col0,
                         _mm512_add_ps(_mm512_mul_ps(c, sv), ov));
      }
    }
#else
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < 16; ++j)
        for (int t = 0; t < 4; ++t) {
          int32_t c;
          if (bits == 8) {
            c = w[(i * 16 + j) * 4 + t];
          } else {
            const uint8_t byte = w[((i >> 1) * 16 + j) * 4 + t];
            c = (i & 1) ? (byte >> 4) : (byte & 15);
          }
          const float p = float(c) * s[j];
          buf[(g * 32 + i * 4 + t) * 32 + col0 + j] = p + o[j];
        }
#endif
  }
}

// R rows of x (row stride K) times buf [K, 32] into y (row stride ldy), `cols` columns.
template <int R>
static void tile(const float* x, int64_t K, const float* buf, float* y, int64_t ldy,
                 int cols) {
#if defined(PD_VBMI)
  __m512 a0[R], a1[R];
  for (int r = 0; r < R; ++r) { a0[r] = _mm512_setzero_ps(); a1[r] = _mm512_setzero_ps(); }
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(buf + k * 32), w1 = _mm512_loadu_ps(buf + k * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      a0[r] = _mm512_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm512_fmadd_ps(xb, w1, a1[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, a0[r]);
    if (cols == 32) _mm512_storeu_ps(y + r * ldy + 16, a1[r]);
  }
#else
  for (int r = 0; r < R; ++r) {
    float acc[32] = {0.f};
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < 32; ++j) acc[j] += x[r * K + k] * buf[k * 32 + j];
    for (int j = 0; j < cols; ++j) y[r * ldy + j] = acc[j];
  }
#endif
}

typedef void (*TileFn)(const float*, int64_t, const float*, float*, int64_t, int);
static const TileFn TILES[13] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>,
                                 tile<6>, tile<7>, tile<8>, tile<9>, tile<10>, tile<11>,
                                 tile<12>};

// x float32 [M, K] -> y float32 [M, NB * 16].
torch::Tensor qmatmul_rows(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                           torch::Tensor offset, int64_t bits) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: 2-d float32");
  TORCH_CHECK(bits == 8 || bits == 4, "bits: 8 or 4");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.dim() == 3 && scale.size(2) == 16 &&
              offset.sizes() == scale.sizes() && offset.dtype() == torch::kFloat32,
              "scale/offset: float32 [N / 16, K / 32, 16]");
  const int64_t M = x.size(0), K = x.size(1), NB = scale.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && scale.size(1) == G, "x: K a multiple of 32 matching the scales");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.numel() == NB * G * 16 * 32 * bits / 8,
              "packed: uint8, 16 * 32 * bits / 8 bytes per block and group");
  x = x.contiguous(); packed = packed.contiguous();
  scale = scale.contiguous(); offset = offset.contiguous();
  const int64_t Np = NB * 16;
  torch::Tensor y = torch::empty({M, Np}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Rows split into the fewest tiles of at most 12, as even as they go.
  const int64_t tiles = (M + 11) / 12;
  at::parallel_for(0, (NB + 1) / 2, 1, [&](int64_t u0, int64_t u1) {
    std::vector<float> buf(K * 32 + 16, 0.f);
    float* bp = buf.data();
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t b = 2 * u;
      const int cols = b + 1 < NB ? 32 : 16;
      decode_block(wp, sp, op, bits, G, b, bp, 0);
      if (cols == 32) decode_block(wp, sp, op, bits, G, b + 1, bp, 16);
      int64_t m0 = 0;
      for (int64_t t = 0; t < tiles; ++t) {
        const int R = int(M / tiles + (t < M % tiles ? 1 : 0));
        TILES[R](xp + m0 * K, K, bp, yp + m0 * Np + b * 16, Np, cols);
        m0 += R;
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("qmatmul_rows", &qmatmul_rows); }
"""

_KERNEL = CppKernel("pdserve_cpu_qmatmul_a8_rows_v1", _SOURCE,
                    "w8a16/w4a16 steps of more than 8 rows expand weight slices in torch")


def available() -> bool:
    """Whether the compiled kernel is built (builds it on first call)."""
    return _KERNEL.available()


def qmatmul_rows(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                 offset: torch.Tensor, bits: int) -> torch.Tensor | None:
    """``x`` float32 ``[M, K]`` times the packed weight, unrounded: ``[M, N_padded]``
    float32, or None where the kernel cannot be built (the caller expands in torch)."""
    mod = _KERNEL.module()
    if mod is None:
        return None
    return mod.qmatmul_rows(x, packed, scale, offset, bits)

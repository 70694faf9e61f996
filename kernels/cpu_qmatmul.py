"""Weight-only 8-bit matmul for the CPU: float32 activations, codes in groups of 32.

``y = x @ W.T`` where ``W[n, k] = codes[n, k] * scale[n, k // 32] + offset[n, k // 32]``,
``codes`` uint8 ``[N, K]``, ``scale``/``offset`` float32 ``[N, K // 32]``, ``x`` and ``y``
float32. The activations are never rounded, so the product is the float32 product of
``x`` with the dequantized weight, summed in a different order; for a weight that came
from a GGUF Q4_1 file the dequantized weight is the file's own (see
services/engine/weights/quantize.py), so the result is the float32 model's.

Why a kernel of our own: torch's weight-only CPU kernels are fast only with bfloat16
activations, and with float32 ones they fall to a path slower than the float32 GEMM
(docs/benchmarks.md). This one is a small C++ loop (AVX-512 where the compiler targets
it, plain loops otherwise), built with torch's extension loader on first use. Up to 8
rows it reads the codes once per 4 activation rows; past that it expands 256 output
rows of the weight at a time into a buffer that stays in cache and runs the float GEMM
on it, which beats both the loop and a whole dequantized copy at prefill sizes. Where no
compiler is at hand, :func:`qmatmul` falls back to :func:`qmatmul_reference` (the
dequantized weight times ``x``), with one log line.

``qmatmul_reference`` is the definition the kernel must equal (tests/test_kernels_cpu.py).
"""

from __future__ import annotations

import torch

from kernels.cpu_build import CppKernel

GROUP = 32

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// y[m, n] = sum_g scale[n, g] * dot(codes[n, g, :], x[m, g, :]) + offset[n, g] * xsum[m, g]
static void rows(const float* x, const float* xsum, const uint8_t* codes, const float* scale,
                 const float* offset, float* y, int64_t M, int64_t N, int64_t K,
                 int64_t n0, int64_t n1) {
  const int64_t G = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = codes + n * K;
    const float* s = scale + n * G;
    const float* o = offset + n * G;
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int64_t mr = M - m0 < 4 ? M - m0 : 4;
#if defined(__AVX512F__)
      __m512 acc[4];
      for (int r = 0; r < 4; ++r) acc[r] = _mm512_setzero_ps();
      float off[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t g = 0; g < G; ++g) {
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i*)(q + g * 32))));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
            _mm_loadu_si128((const __m128i*)(q + g * 32 + 16))));
        const __m512 sg = _mm512_set1_ps(s[g]);
        for (int64_t r = 0; r < mr; ++r) {
          const float* xr = x + (m0 + r) * K + g * 32;
          __m512 d = _mm512_mul_ps(w0, _mm512_loadu_ps(xr));
          d = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), d);
          acc[r] = _mm512_fmadd_ps(sg, d, acc[r]);
          off[r] += o[g] * xsum[(m0 + r) * G + g];
        }
      }
      for (int64_t r = 0; r < mr; ++r) y[(m0 + r) * N + n] = _mm512_reduce_add_ps(acc[r]) + off[r];
#else
      for (int64_t r = 0; r < mr; ++r) {
        const float* xr = x + (m0 + r) * K;
        float total = 0.f;
        for (int64_t g = 0; g < G; ++g) {
          float d = 0.f;
          for (int k = 0; k < 32; ++k) d += float(q[g * 32 + k]) * xr[g * 32 + k];
          total += s[g] * d + o[g] * xsum[(m0 + r) * G + g];
        }
        y[(m0 + r) * N + n] = total;
      }
#endif
    }
  }
}

// Up to this many rows the codes are read once per 4 rows in the loop above; past it
// a GEMM over expanded slices of SLICE output rows is faster.
static const int64_t GEMV_ROWS = 8, SLICE = 256;

torch::Tensor qmatmul(torch::Tensor x, torch::Tensor codes, torch::Tensor scale,
                      torch::Tensor offset) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: 2-d float32");
  TORCH_CHECK(codes.dtype() == torch::kUInt8 && codes.dim() == 2, "codes: 2-d uint8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.size(1) == K && K % 32 == 0, "codes: [N, K], K a multiple of 32");
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && offset.dtype() == torch::kFloat32 &&
              scale.size(0) == N && scale.size(1) == K / 32 && offset.sizes() == scale.sizes(),
              "scale/offset: float32 [N, K / 32]");
  x = x.contiguous();
  codes = codes.contiguous(); scale = scale.contiguous(); offset = offset.contiguous();
  torch::Tensor y = torch::empty({M, N}, x.options());
  if (M > GEMV_ROWS) {
    // Many rows: expand a slice of the weight at a time into a buffer that stays in
    // cache and hand it to the float GEMM, which reuses it across the rows.
    const int64_t G = K / 32;
    for (int64_t n0 = 0; n0 < N; n0 += SLICE) {
      const int64_t nc = N - n0 < SLICE ? N - n0 : SLICE;
      torch::Tensor w = codes.narrow(0, n0, nc).view({nc, G, 32}).to(torch::kFloat32)
          .mul_(scale.narrow(0, n0, nc).unsqueeze(-1))
          .add_(offset.narrow(0, n0, nc).unsqueeze(-1)).view({nc, K});
      y.narrow(1, n0, nc).copy_(torch::mm(x, w.t()));
    }
    return y;
  }
  torch::Tensor xsum = x.view({M, K / 32, 32}).sum(-1).contiguous();
  const float* xp = x.data_ptr<float>();
  const float* xs = xsum.data_ptr<float>();
  const uint8_t* qp = codes.data_ptr<uint8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* op = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    rows(xp, xs, qp, sp, op, yp, M, N, K, n0, n1);
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("qmatmul", &qmatmul,
        py::call_guard<py::gil_scoped_release>()); }
"""

_KERNEL = CppKernel("pdserve_cpu_qmatmul_v3", _SOURCE,
                    "int8 weights run the slow dequantizing path")


def available() -> bool:
    """Whether the compiled kernel is built (builds it on first call)."""
    return _KERNEL.available()


def qmatmul_reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
                      offset: torch.Tensor) -> torch.Tensor:
    """``x @ dequantize(codes, scale, offset).T`` in plain torch."""
    return x @ dequantize(codes, scale, offset).t()


def dequantize(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The float32 ``[N, K]`` weight the codes stand for."""
    n, k = codes.shape
    w = codes.view(n, k // GROUP, GROUP).float() * scale[..., None] + offset[..., None]
    return w.view(n, k)


def qmatmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor,
            offset: torch.Tensor) -> torch.Tensor:
    """``x`` float32 ``[M, K]`` times the 8-bit weight: ``[M, N]`` float32."""
    mod = _KERNEL.module()
    if mod is None:
        return qmatmul_reference(x, codes, scale, offset)
    return mod.qmatmul(x, codes, scale, offset)

"""Weight-quantized matmul with integer activations for the CPU: integer dot products.

``y = x @ W.T`` where ``W[n, k] = codes[n, k] * scale[n, g] + offset[n, g]`` (``g = k // 32``,
codes of 8 or 4 bits), as in kernels/cpu_qmatmul.py, but each activation group of 32 is
first rounded to integers, ``xq = round(x * L / max|x|)``, ``dx = max|x| / L``, so that a
group's product is integer dot products::

    y[m, n] = sum_g scale[n, g] * dx[m, g] * dot(codes[n, g], xq[m, g]) + offset[n, g] * xsum[m, g]

with ``xsum`` the exact float sum of the group's activations (the offset term loses
nothing). ``L`` is ``NARROW`` (127: one int8, llama.cpp's q8 scheme) or ``WIDE``
(16256 = 128 * 127: ``xq = 128 * hi + lo`` with both parts int8, two dot products). The
engine uses ``WIDE`` (services/engine/weights/quantize.py): 128x finer, and at batch 1
no slower, since the codes are what costs.

Why: the float kernel spends ~8 instructions per 32 weights widening bytes to floats and
is compute-bound at ~7 GB/s on one core, where memory gives ~25 GB/s
(docs/benchmarks.md). With AVX-512 VNNI one ``vpdpbusd`` multiplies 64 unsigned code
bytes by 64 signed activation bytes. The codes are packed so that a register holds 16
output rows x 4 inputs: broadcasting 4 activation bytes then gives 16 rows' partial
dot products at once, a group's 16 scales and offsets are one load each, and nothing is
reduced horizontally. 4-bit codes hold two inputs per byte (low nibble: inputs
``8i..8i+3`` of the group, high nibble: ``8i+4..8i+7``), half the bytes to stream.

Layout (:func:`pack`): rows padded to a multiple of 16; ``packed`` uint8, per (block of
16 rows, group) ``16 * 32 * bits / 8`` bytes; ``scale``/``offset`` float32
``[N/16, G, 16]``.

Every step runs the integer kernel, however many rows it has. More than 8 rows (prefill
chunks, large batches) go 8 at a time over tiles of 8 blocks (``TILE_BLOCKS``), so a tile's
codes are decoded from cache by each chunk; a row's output is bit for bit the same in
any batch. That beat float32 on the expanded weight at every size measured, 16 to
1,024 rows (per 16 outputs and 32 inputs a row costs two 64-byte dot products where
float needs 32 fused multiply-adds; docs/benchmarks.md), and rounds prefill's
activations as decode's (the bound below holds for every row).
Where no compiler is at hand, :func:`qmatmul_reference` (same rounding, plain torch) is
used up to 8 rows and the float GEMM on slices expanded in torch above that (the
reference's float64 products would be far too slow there), with one log line; without
VNNI the kernel is a plain loop.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import CppKernel

GROUP, ROWS, GEMV_ROWS, SLICE_BLOCKS = 32, 16, 8, 16
# Activation levels either side of zero: one int8, or two int8 parts (128 * hi + lo).
NARROW, WIDE = 127, 16256

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// Blocks of 16 output rows a weight tile: 8 blocks' codes (36 KiB at K = 576, 4-bit)
// stay in cache while every 8-row chunk of activations passes over them.
static constexpr int64_t TILE_BLOCKS = 8;

// One (block of 16 rows, group of 32 inputs): the 16 integer dot products with xq's group.
template <int BITS>
static inline void group_dots(const uint8_t* w, const int8_t* xq, int32_t* out) {
  for (int j = 0; j < 16; ++j) {
    int32_t s = 0;
    for (int i = 0; i < 8; ++i) {
      for (int t = 0; t < 4; ++t) {
        if (BITS == 8) {
          s += int32_t(w[(i * 16 + j) * 4 + t]) * xq[i * 4 + t];
        } else {
          const uint8_t b = w[((i >> 1) * 16 + j) * 4 + t];
          s += int32_t((i & 1) ? (b >> 4) : (b & 15)) * xq[i * 4 + t];
        }
      }
    }
    out[j] = s;
  }
}

// WIDE: activations are 128 * xq + xl (xl in -64..63), two integer dot products a group.
template <int BITS, bool WIDE>
static void blocks(const uint8_t* packed, const float* scale, const float* offset,
                   const int8_t* xq, const int8_t* xl, const float* dx, const float* xs,
                   float* y, int64_t M, int64_t Np, int64_t K, int64_t b0, int64_t b1) {
  const int64_t G = K / 32, GB = 16 * 32 * BITS / 8;
  for (int64_t b = b0; b < b1; ++b) {
#if defined(__AVX512VNNI__)
    __m512 acc[8];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* w = packed + (b * G + g) * GB;
      __m512i wv[8];
      if (BITS == 8) {
        for (int i = 0; i < 8; ++i) wv[i] = _mm512_loadu_si512((const void*)(w + i * 64));
      } else {
        for (int i = 0; i < 4; ++i) {
          const __m512i v = _mm512_loadu_si512((const void*)(w + i * 64));
          wv[2 * i] = _mm512_and_si512(v, low);
          wv[2 * i + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        }
      }
      const __m512 s = _mm512_loadu_ps(scale + (b * G + g) * 16);
      const __m512 o = _mm512_loadu_ps(offset + (b * G + g) * 16);
      for (int m = 0; m < M; ++m) {
        const int32_t* xk = (const int32_t*)(xq + m * K + g * 32);
        __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
        for (int i = 0; i < 8; i += 2) {
          d0 = _mm512_dpbusd_epi32(d0, wv[i], _mm512_set1_epi32(xk[i]));
          d1 = _mm512_dpbusd_epi32(d1, wv[i + 1], _mm512_set1_epi32(xk[i + 1]));
        }
        __m512i dsum = _mm512_add_epi32(d0, d1);
        if (WIDE) {
          const int32_t* lk = (const int32_t*)(xl + m * K + g * 32);
          __m512i e0 = _mm512_setzero_si512(), e1 = _mm512_setzero_si512();
          for (int i = 0; i < 8; i += 2) {
            e0 = _mm512_dpbusd_epi32(e0, wv[i], _mm512_set1_epi32(lk[i]));
            e1 = _mm512_dpbusd_epi32(e1, wv[i + 1], _mm512_set1_epi32(lk[i + 1]));
          }
          dsum = _mm512_add_epi32(_mm512_slli_epi32(dsum, 7), _mm512_add_epi32(e0, e1));
        }
        const __m512 d = _mm512_cvtepi32_ps(dsum);
        acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(s, _mm512_set1_ps(dx[m * G + g])), d, acc[m]);
        acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xs[m * G + g]), acc[m]);
      }
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * Np + b * 16, acc[m]);
#else
    for (int m = 0; m < M; ++m) {
      float acc[16] = {0.f};
      int32_t d[16], e[16];
      for (int64_t g = 0; g < G; ++g) {
        group_dots<BITS>(packed + (b * G + g) * GB, xq + m * K + g * 32, d);
        if (WIDE) {
          group_dots<BITS>(packed + (b * G + g) * GB, xl + m * K + g * 32, e);
          for (int j = 0; j < 16; ++j) d[j] = d[j] * 128 + e[j];
        }
        const float* s = scale + (b * G + g) * 16;
        const float* o = offset + (b * G + g) * 16;
        for (int j = 0; j < 16; ++j)
          acc[j] += s[j] * dx[m * G + g] * float(d[j]) + o[j] * xs[m * G + g];
      }
      for (int j = 0; j < 16; ++j) y[m * Np + b * 16 + j] = acc[j];
    }
#endif
  }
}

// x float32 [M, K] -> y float32 [M, Np]; rounds each group of 32 activations to
// integers of `levels` steps either side of zero: 127 (int8) or 16256 (128 * 127, split
// into two int8 parts for two dot products). More than 8 rows: 8 at a time over each
// tile of blocks, so a tile's codes are read from cache by every row.
torch::Tensor qmatmul_a8(torch::Tensor x, torch::Tensor packed, torch::Tensor scale,
                         torch::Tensor offset, int64_t bits, int64_t levels) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "x: 2-d float32");
  TORCH_CHECK(bits == 8 || bits == 4, "bits: 8 or 4");
  TORCH_CHECK(levels == 127 || levels == 16256, "levels: 127 or 16256");
  const bool wide = levels == 16256;
  TORCH_CHECK(scale.dtype() == torch::kFloat32 && scale.dim() == 3 && scale.size(2) == 16 &&
              offset.sizes() == scale.sizes() && offset.dtype() == torch::kFloat32,
              "scale/offset: float32 [N / 16, K / 32, 16]");
  const int64_t M = x.size(0), K = x.size(1), NB = scale.size(0), G = K / 32;
  TORCH_CHECK(K % 32 == 0 && scale.size(1) == G, "x: K a multiple of 32 matching the scales");
  TORCH_CHECK(packed.dtype() == torch::kUInt8 && packed.numel() == NB * G * 16 * 32 * bits / 8,
              "packed: uint8, 16 * 32 * bits / 8 bytes per block and group");
  x = x.contiguous(); packed = packed.contiguous();
  scale = scale.contiguous(); offset = offset.contiguous();
  torch::Tensor xq = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  torch::Tensor xlo = torch::zeros({M, K}, x.options().dtype(torch::kInt8));
  int8_t* lp = xlo.data_ptr<int8_t>();
  torch::Tensor dx = torch::empty({M, G}, x.options()), xs = torch::empty({M, G}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = xq.data_ptr<int8_t>();
  float* dp = dx.data_ptr<float>();
  float* sp = xs.data_ptr<float>();
  // Groups are independent; more than 8 rows' worth are rounded on every thread.
  at::parallel_for(0, M * G, 512, [&](int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* v = xp + r * 32;
    float amax = 0.f, sum = 0.f;
    for (int t = 0; t < 32; ++t) { amax = std::max(amax, std::fabs(v[t])); sum += v[t]; }
    const float inv = amax > 0.f ? float(levels) / amax : 0.f;
    for (int t = 0; t < 32; ++t) {
      const int32_t q = int32_t(std::nearbyint(v[t] * inv));
      if (wide) {
        const int32_t lo = ((q + 64) & 127) - 64;
        qp[r * 32 + t] = int8_t((q - lo) >> 7);
        lp[r * 32 + t] = int8_t(lo);
      } else {
        qp[r * 32 + t] = int8_t(q);
      }
    }
    dp[r] = amax / float(levels);
    sp[r] = sum;
  }
  });
  torch::Tensor y = torch::empty({M, NB * 16}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  const float* scp = scale.data_ptr<float>();
  const float* ofp = offset.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, NB, 4, [&](int64_t b0, int64_t b1) {
    const int64_t Np = NB * 16;
    for (int64_t t0 = b0; t0 < b1; t0 += TILE_BLOCKS) {
      const int64_t t1 = std::min(b1, t0 + TILE_BLOCKS);
      for (int64_t m0 = 0; m0 < M; m0 += 8) {
        const int64_t mc = std::min<int64_t>(8, M - m0);
        const int8_t* q = qp + m0 * K;
        const int8_t* l = lp + m0 * K;
        const float* d = dp + m0 * G;
        const float* s = sp + m0 * G;
        float* o = yp + m0 * Np;
        if (bits == 8 && wide) blocks<8, true>(wp, scp, ofp, q, l, d, s, o, mc, Np, K, t0, t1);
        else if (bits == 8) blocks<8, false>(wp, scp, ofp, q, l, d, s, o, mc, Np, K, t0, t1);
        else if (wide) blocks<4, true>(wp, scp, ofp, q, l, d, s, o, mc, Np, K, t0, t1);
        else blocks<4, false>(wp, scp, ofp, q, l, d, s, o, mc, Np, K, t0, t1);
      }
    }
  });
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("qmatmul_a8", &qmatmul_a8,
        py::call_guard<py::gil_scoped_release>()); }
"""

_KERNEL = CppKernel("pdserve_cpu_qmatmul_a8_v3", _SOURCE,
                    "w8a8/w4a8 weights run the slow torch path")


def available() -> bool:
    """Whether the compiled kernel is built (builds it on first call)."""
    return _KERNEL.available()


def pack(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
         bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``codes`` uint8 ``[N, K]`` (values below ``2 ** bits``), ``scale``/``offset``
    ``[N, K // 32]`` into the kernel's layout (module docstring); rows padded with zeros."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    n, k = codes.shape
    if k % GROUP:
        raise ValueError(f"input features must be a multiple of {GROUP}, got {k}")
    if bits == 4 and int(codes.max()) > 15:
        raise ValueError("4-bit codes must lie in 0..15")
    pad = -n % ROWS
    codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    scale = torch.nn.functional.pad(scale.float(), (0, 0, 0, pad))
    offset = torch.nn.functional.pad(offset.float(), (0, 0, 0, pad))
    nb, g = (n + pad) // ROWS, k // GROUP
    # [block, row j, group, i (8 quads), t] -> [block, group, i, row j, t]
    c = codes.view(nb, ROWS, g, 8, 4).permute(0, 2, 3, 1, 4)
    if bits == 4:  # quads i and i + 1 share a byte: low nibble i (even), high i + 1
        c = c[:, :, 0::2] | (c[:, :, 1::2] << 4)
    packed = c.contiguous().view(-1)

    def per_block(t: torch.Tensor) -> torch.Tensor:
        return t.view(nb, ROWS, g).transpose(1, 2).contiguous()
    return packed, per_block(scale), per_block(offset)


def unpack_rows(packed: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int,
                rows: torch.Tensor) -> torch.Tensor:
    """The float32 weight rows ``rows`` (long ``[R]``) of a packed weight: ``[R, K]``."""
    nb, g, _ = scale.shape
    quads = 8 if bits == 8 else 4
    c = packed.view(nb, g, quads, ROWS, 4)[rows // ROWS, :, :, rows % ROWS]  # [R, g, q, 4]
    if bits == 4:
        c = torch.stack([c & 15, c >> 4], dim=3)  # [R, g, 4, 2, 4]: quad 2i, 2i + 1
    c = c.reshape(len(rows), g, GROUP).float()
    s = scale[rows // ROWS, :, rows % ROWS]
    o = offset[rows // ROWS, :, rows % ROWS]
    return (c * s[..., None] + o[..., None]).view(len(rows), g * GROUP)


def _dequantize_blocks(packed, scale, offset, bits, b0: int, nb: int) -> torch.Tensor:
    """Float32 rows of blocks ``b0 .. b0 + nb``: ``[nb * 16, K]`` (strided copies only,
    unlike the gather of ``unpack_rows``: prefill expands every weight this way)."""
    g = scale.shape[1]
    quads = 8 if bits == 8 else 4
    c = packed.view(-1, g, quads, ROWS, 4)[b0:b0 + nb]
    if bits == 4:  # [nb, g, pair, nibble, row, t] -> rows first
        c = torch.stack([c & 15, c >> 4], dim=3).permute(0, 4, 1, 2, 3, 5)
    else:
        c = c.permute(0, 3, 1, 2, 4)
    w = c.reshape(nb * ROWS, g, GROUP).float()
    s = scale[b0:b0 + nb].transpose(1, 2).reshape(nb * ROWS, g, 1)
    o = offset[b0:b0 + nb].transpose(1, 2).reshape(nb * ROWS, g, 1)
    return w.mul_(s).add_(o).view(nb * ROWS, g * GROUP)


def _expanded(x, packed, scale, offset, bits: int) -> torch.Tensor:
    """More than 8 rows without a compiler: float GEMM on weight slices expanded in
    torch, ``SLICE_BLOCKS`` blocks at a time (never a whole float copy)."""
    nb = scale.shape[0]
    y = x.new_empty(x.shape[0], nb * ROWS)
    for b0 in range(0, nb, SLICE_BLOCKS):
        n = min(SLICE_BLOCKS, nb - b0)
        w = _dequantize_blocks(packed, scale, offset, bits, b0, n)
        y[:, b0 * ROWS:(b0 + n) * ROWS] = x @ w.t()
    return y


def quantize_activations(x: torch.Tensor, levels: int = NARROW
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(xq, dx, xsum)``: integer levels ``[M, K]`` (int8 for ``NARROW``, int16 for
    ``WIDE``), float32 ``[M, K // 32]`` twice (the kernel's rounding, ties to even)."""
    m, k = x.shape
    v = x.float().reshape(m, k // GROUP, GROUP)
    amax = v.abs().amax(-1)
    inv = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    dtype = torch.int8 if levels == NARROW else torch.int16
    xq = (v * inv[..., None]).round().to(dtype).view(m, k)
    return xq, amax / levels, v.sum(-1)


def qmatmul_reference(x, packed, scale, offset, bits: int,
                      levels: int = NARROW) -> torch.Tensor:
    """The kernel's definition in plain torch: ``[M, N_padded]`` float32."""
    m, k = x.shape
    nb, g, _ = scale.shape
    codes = _dequantize_blocks(packed, torch.ones_like(scale), torch.zeros_like(offset),
                               bits, 0, nb).view(nb * ROWS, g, GROUP)
    xq, dx, xs = quantize_activations(x, levels)
    dots = torch.einsum("ngk,mgk->mng", codes.double(), xq.view(m, g, GROUP).double())
    s = scale.transpose(1, 2).reshape(nb * ROWS, g).double()
    o = offset.transpose(1, 2).reshape(nb * ROWS, g).double()
    y = (dots * s * dx.double()[:, None, :]).sum(-1) + xs.double() @ o.t()
    return y.float()


def qmatmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
            offset: torch.Tensor, bits: int, levels: int = NARROW) -> torch.Tensor:
    """``x`` float32 ``[M, K]`` times the packed weight: ``[M, N_padded]`` float32."""
    mod = _KERNEL.module()
    if mod is not None:
        return mod.qmatmul_a8(x, packed, scale, offset, bits, levels)
    if x.shape[0] > GEMV_ROWS:
        # No compiler, prefill: the reference's float64 dot products would be far too
        # slow; the float GEMM on expanded slices, unrounded, is within the same bound.
        return _expanded(x, packed, scale, offset, bits)
    return qmatmul_reference(x, packed, scale, offset, bits, levels)

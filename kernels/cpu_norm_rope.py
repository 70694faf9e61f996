"""RMSNorm (with the residual add) and rotary embedding for the CPU, one call each.

A decode step on the CPU runs 2 norms per layer plus the final one and one rotary per
layer; in torch each is a handful of small ops (RMSNorm ~7, rotary ~20: table lookups,
a concatenated rotated copy, casts), and at batch 1 their dispatch costs more than the
arithmetic. These do the same arithmetic in one pass per row:

* ``rms_norm(x, weight, eps, residual)``: with ``residual``, ``residual += x`` in place
  and ``out = weight * (s * rsqrt(mean(s * s) + eps))`` over the sum ``s``; without it,
  the same over ``x``. A new ``out`` is returned.
* ``rotary_(positions, q, k, cos, sin)``: ``q`` ``[T, H, D]`` and ``k`` ``[T, KVH, D]``
  rotated in place to ``positions`` in the half-split layout Hugging Face weights use
  (``x * cos + cat(-x[D/2:], x[:D/2]) * sin``, the layout of
  ``services/engine/attention_ops.py``), q and k in the same call.

Float32 only, and rounded as the torch expressions are (products and sums rounded one
at a time: the source asks the compiler not to fuse them into FMAs); only the sum of
squares adds in another order, so a norm differs from torch's by float32 rounding.
``rms_norm_reference``/``rotary_reference`` are the definitions
(tests/test_kernels_cpu_ops.py). Built on first use by torch's extension loader
(kernels/cpu_build.py); without a compiler the callers keep their torch path.
"""

from __future__ import annotations

import torch

from kernels.cpu_build import CppKernel

_SOURCE = r"""
// Products and sums rounded one at a time, as torch's elementwise ops round them.
#pragma GCC optimize("fp-contract=off")
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>

static inline float sum_squares(const float* x, int64_t n) {
  float acc[16] = {0.f};  // 16 lanes: the compiler keeps them in one vector register
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
  float total = 0.f;
  for (int j = 0; j < 16; ++j) total += acc[j];
  for (; i < n; ++i) total += x[i] * x[i];
  return total;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                       c10::optional<torch::Tensor> residual) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x: 2-d float32, rows contiguous");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.dim() == 1 && weight.size(0) == N &&
              weight.is_contiguous(), "weight: contiguous float32 [N]");
  float* rp = nullptr;
  int64_t rs = 0;
  if (residual.has_value()) {
    const torch::Tensor& r = *residual;
    TORCH_CHECK(r.dtype() == torch::kFloat32 && r.dim() == 2 && r.size(0) == T &&
                r.size(1) == N && r.stride(1) == 1, "residual: float32 like x");
    rp = r.data_ptr<float>();
    rs = r.stride(0);
  }
  torch::Tensor out = torch::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  const float feps = (float)eps, fn = (float)N;
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* src = xp + t * xs;
      if (rp != nullptr) {
        float* r = rp + t * rs;
        for (int64_t i = 0; i < N; ++i) r[i] += src[i];
        src = r;
      }
      const float inv = 1.f / std::sqrt(sum_squares(src, N) / fn + feps);
      float* o = op + t * N;
      for (int64_t i = 0; i < N; ++i) o[i] = wp[i] * (src[i] * inv);
    }
  });
  return out;
}

static inline void rotate(float* x, const float* c, const float* s, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = a * c[i] - b * s[i];
    x[i + half] = b * c[i + half] + a * s[i + half];
  }
}

static void check_heads(const torch::Tensor& t, int64_t T, int64_t D, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 3 && t.size(0) == T &&
              t.size(2) == D && t.stride(2) == 1, name, ": float32 [T, heads, D], D contiguous");
}

void rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos,
            torch::Tensor sin) {
  TORCH_CHECK(positions.dtype() == torch::kInt64 && positions.dim() == 1 &&
              positions.is_contiguous(), "positions: contiguous int64 [T]");
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && cos.dim() == 2 && cos.is_contiguous() &&
              sin.sizes() == cos.sizes() && sin.dtype() == torch::kFloat32 &&
              sin.is_contiguous(), "cos/sin: contiguous float32 [positions, D]");
  const int64_t T = positions.size(0), P = cos.size(0), D = cos.size(1);
  TORCH_CHECK(D % 2 == 0, "head dim must be even");
  check_heads(q, T, D, "q");
  check_heads(k, T, D, "k");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // before anything is written: a bad position changes nothing
    TORCH_CHECK(pp[t] >= 0 && pp[t] < P, "position ", pp[t], " outside the rotary table (", P, ")");
  float* qp = q.data_ptr<float>();
  float* kp = k.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t H = q.size(1), KH = k.size(1);
  const int64_t q0 = q.stride(0), q1 = q.stride(1), k0 = k.stride(0), k1 = k.stride(1);
  at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pp[t] * D;
      const float* s = sp + pp[t] * D;
      for (int64_t h = 0; h < H; ++h) rotate(qp + t * q0 + h * q1, c, s, D / 2);
      for (int64_t h = 0; h < KH; ++h) rotate(kp + t * k0 + h * k1, c, s, D / 2);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm,
        py::call_guard<py::gil_scoped_release>());
  m.def("rotary", &rotary,
        py::call_guard<py::gil_scoped_release>());
}
"""

_KERNEL = CppKernel("pdserve_cpu_norm_rope_v1", _SOURCE,
                    "RMSNorm and rotary run as separate torch ops")

# The row counts measured (width 576, 9/3 heads of 64; 1 and 2 threads, busy 2-core
# machine): per call at 1 row add+norm 45 -> 3 us, rotary 62 -> 4 us; at 64 rows 29 -> 11
# and 113 -> 12 us; at 4,096 rows, 2 threads, 2.5 -> 1.7 ms and 25 -> 2.3 ms. Past the
# largest measured count the torch path stays.
MAX_ROWS = 4096


def available() -> bool:
    """Whether the compiled kernel is built (builds it on first call, waiting)."""
    return _KERNEL.available()


def ready() -> bool:
    """Whether it is built, without waiting (the first call starts the build in a
    thread; callers run their torch path meanwhile)."""
    return _KERNEL.ready()


def takes_norm(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether :func:`rms_norm` takes these: float32 CPU rows, built kernel."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2
            and x.shape[0] <= MAX_ROWS and weight.dtype == torch.float32
            and (residual is None or residual.dtype == torch.float32)
            and not x.requires_grad and _KERNEL.ready())


def takes_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 cos: torch.Tensor) -> bool:
    """Whether :func:`rotary_` takes these: float32 CPU heads, int64 positions, built
    kernel."""
    return (q.device.type == "cpu" and q.dtype == torch.float32 and k.dtype == torch.float32
            and cos.dtype == torch.float32 and positions.dtype == torch.int64
            and q.dim() == 3 and q.shape[0] <= MAX_ROWS
            and not q.requires_grad and _KERNEL.ready())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """The norm of ``x`` (or of ``residual += x``, in place), times ``weight``."""
    return _KERNEL.module().rms_norm(x, weight, eps, residual)


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate ``q`` and ``k`` in place to ``positions`` (half-split layout)."""
    _KERNEL.module().rotary(positions.contiguous(), q, k, cos, sin)


def rms_norm_reference(x, weight, eps, residual=None):
    """Torch's float32 expression, the definition :func:`rms_norm` equals."""
    if residual is not None:
        x = residual.add_(x)
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotary_reference(positions, q, k, cos, sin):
    """New rotated ``(q, k)``, the definition :func:`rotary_` equals."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    half = q.shape[-1] // 2

    def rot(x):
        return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s
    return rot(q), rot(k)

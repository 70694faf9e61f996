"""A decoder layer's work besides attention in two native calls, for small CPU steps.

At batch 1 a w8a16/w4a16 decode step is ~30 small torch ops and Python calls per layer
(module calls, four projections with their reshapes and slices, two norms, rotary, the
SwiGLU), each costing more in dispatch than in arithmetic (docs/benchmarks.md). Here a
layer holds its weights in one native object and runs:

* ``pre(x, residual, positions) -> (q, k, v)``: ``residual += x`` in place (without
  ``residual``: the norm of ``x`` itself), RMSNorm, the fused q/k/v projection (+ bias),
  rotary of q and k in place;
* ``post(attn, residual) -> x``: the o projection, ``residual += o`` in place, RMSNorm,
  the fused gate/up projection, ``silu(gate) * up``, the down projection;

with the model's attention call between the two, unchanged. The arithmetic is the
functions the per-op path calls, compiled into this module from their sources
(``qmatmul_a8`` of kernels/cpu_qmatmul_a8.py, ``rms_norm``/``rotary`` of
kernels/cpu_norm_rope.py) and ATen's own ``silu``/``mul_``, in the same order, so the
result equals the per-op path's bit for bit (tests/test_cpu_layer.py). Up to
``MAX_ROWS`` rows (the integer kernel's limit); larger steps keep the per-op path.
``PDSERVE_FUSED_LAYER=0`` turns it off (:func:`enabled`).
"""

from __future__ import annotations

import os

import torch

from kernels import cpu_norm_rope, cpu_qmatmul_a8
from kernels.cpu_build import CppKernel

MAX_ROWS = cpu_qmatmul_a8.GEMV_ROWS
ENV = "PDSERVE_FUSED_LAYER"


def _body(source: str) -> str:
    """A kernel's source without its module definition (this module defines its own)."""
    return source.split("PYBIND11_MODULE")[0]


_LAYER = r"""
namespace py = pybind11;

struct Proj {
  torch::Tensor packed, scale, offset;
  int64_t bits, out;
  c10::optional<torch::Tensor> bias;
  torch::Tensor operator()(const torch::Tensor& x, int64_t levels) const {
    torch::Tensor y = qmatmul_a8(x, packed, scale, offset, bits, levels);
    if (y.size(1) != out) y = y.narrow(1, 0, out);
    if (bias.has_value()) y.add_(*bias);
    return y;
  }
};

static Proj make_proj(py::tuple t) {
  TORCH_CHECK(t.size() == 6, "projection: (packed, scale, offset, bits, out, bias)");
  Proj p{t[0].cast<torch::Tensor>(), t[1].cast<torch::Tensor>(), t[2].cast<torch::Tensor>(),
         t[3].cast<int64_t>(), t[4].cast<int64_t>(), c10::nullopt};
  if (!t[5].is_none()) p.bias = t[5].cast<torch::Tensor>();
  return p;
}

struct Layer {
  torch::Tensor ln1, ln2, cos, sin;
  double eps1, eps2;
  Proj qkv, o, gate_up, down;
  int64_t heads, kv_heads, head_dim, inter, levels;

  Layer(torch::Tensor ln1_, double eps1_, py::tuple qkv_, py::tuple o_, torch::Tensor ln2_,
        double eps2_, py::tuple gate_up_, py::tuple down_, torch::Tensor cos_,
        torch::Tensor sin_, int64_t heads_, int64_t kv_heads_, int64_t head_dim_,
        int64_t inter_, int64_t levels_)
      : ln1(ln1_), ln2(ln2_), cos(cos_), sin(sin_), eps1(eps1_), eps2(eps2_),
        qkv(make_proj(qkv_)), o(make_proj(o_)), gate_up(make_proj(gate_up_)),
        down(make_proj(down_)), heads(heads_), kv_heads(kv_heads_), head_dim(head_dim_),
        inter(inter_), levels(levels_) {
    TORCH_CHECK(qkv.out == (heads + 2 * kv_heads) * head_dim, "qkv: (H + 2 KVH) * D outputs");
    TORCH_CHECK(gate_up.out == 2 * inter, "gate_up: 2 * intermediate outputs");
  }

  std::vector<torch::Tensor> pre(torch::Tensor x, c10::optional<torch::Tensor> residual,
                                 torch::Tensor positions) const {
    const torch::Tensor h = rms_norm(x, ln1, eps1, residual);
    const torch::Tensor y = qkv(h, levels);
    const int64_t T = y.size(0), qs = heads * head_dim, ks = kv_heads * head_dim;
    torch::Tensor q = y.narrow(1, 0, qs).view({T, heads, head_dim});
    torch::Tensor k = y.narrow(1, qs, ks).view({T, kv_heads, head_dim});
    torch::Tensor v = y.narrow(1, qs + ks, ks).view({T, kv_heads, head_dim});
    rotary(positions.contiguous(), q, k, cos, sin);
    return {q, k, v};
  }

  torch::Tensor post(torch::Tensor attn, torch::Tensor residual) const {
    const torch::Tensor a = o(attn.reshape({-1, heads * head_dim}), levels);
    const torch::Tensor h = rms_norm(a, ln2, eps2, residual);
    const torch::Tensor gu = gate_up(h, levels);
    const torch::Tensor act = at::silu(gu.narrow(1, 0, inter)).mul_(gu.narrow(1, inter, inter));
    return down(act, levels);
  }
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Layer>(m, "Layer")
      .def(py::init<torch::Tensor, double, py::tuple, py::tuple, torch::Tensor, double,
                    py::tuple, py::tuple, torch::Tensor, torch::Tensor, int64_t, int64_t,
                    int64_t, int64_t, int64_t>())
      .def("pre", &Layer::pre, py::call_guard<py::gil_scoped_release>())
      .def("post", &Layer::post, py::call_guard<py::gil_scoped_release>());
}
"""

# The matmul first: the norm source's pragma (no FMA contraction) then covers only the
# code after it, as it does in its own module.
_SOURCE = _body(cpu_qmatmul_a8._SOURCE) + _body(cpu_norm_rope._SOURCE) + _LAYER

_KERNEL = CppKernel("pdserve_cpu_layer_v1", _SOURCE,
                    "decode layers run op by op")


def enabled() -> bool:
    """Whether the fused path may be used: ``PDSERVE_FUSED_LAYER`` unset or not ``0``."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def available() -> bool:
    """Whether the compiled kernel is built (builds it on first call, waiting)."""
    return _KERNEL.available()


def ready() -> bool:
    """Whether it is built, without waiting (starts the build in a thread)."""
    return _KERNEL.ready()


Proj = tuple  # (packed, scale, offset, bits, out_features, bias or None)


def make_layer(ln1: torch.Tensor, eps1: float, qkv: Proj, o: Proj, ln2: torch.Tensor,
               eps2: float, gate_up: Proj, down: Proj, cos: torch.Tensor, sin: torch.Tensor,
               heads: int, kv_heads: int, head_dim: int, inter: int,
               levels: int = cpu_qmatmul_a8.WIDE):
    """One layer's native object (the kernel must be built: :func:`ready`)."""
    return _KERNEL.module().Layer(ln1, eps1, qkv, o, ln2, eps2, gate_up, down, cos, sin,
                                  heads, kv_heads, head_dim, inter, levels)

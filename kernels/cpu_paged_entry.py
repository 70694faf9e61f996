"""C++ source of the CPU paged decode kernel's entry points: the checks on every
argument (before any read or write), and the dispatch on the cache's element type
(float32, bfloat16, int8 rows). A fragment, spliced last into
kernels/cpu_paged_decode.py's source.
"""

PAGED_ENTRY = r"""
// Whether seq_dot / seq_i8 is built in and this CPU runs it (a built file may meet
// another CPU).
bool has_bf16_dot() {
#if defined(PDSERVE_BF16_DOT)
  static const bool yes = __builtin_cpu_supports("avx512bf16");
  return yes;
#else
  return false;
#endif
}

bool has_i8_dot() {
#if defined(PDSERVE_I8_DOT)
  static const bool yes = __builtin_cpu_supports("avx512vnni") &&
                          __builtin_cpu_supports("avx512bw");
  return yes;
#else
  return false;
#endif
}

static bool int8_cache(const torch::Tensor& c) { return c.dtype() == torch::kInt8; }

// out[i, h*R + r, :] = softmax(q_r . K^T * scale) V over sequence i's first lens[i]
// cached tokens, for every KV head h; K/V rows read from the cache through the table.
// An int8 cache's rows are D values then their float32 scale (kernels/kv_int8.py).
void paged_decode(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& tables,
                  const torch::Tensor& lens, const torch::Tensor& out, double scale, bool dot) {
  TORCH_CHECK(q.dtype() == torch::kFloat32 && out.dtype() == torch::kFloat32 &&
              k_cache.dtype() == v_cache.dtype() && (k_cache.dtype() == torch::kFloat32 ||
                                                     k_cache.dtype() == torch::kBFloat16 ||
                                                     int8_cache(k_cache)),
              "paged_decode: float32 queries over a float32 or bfloat16 cache (or int8 "
              "rows) only");
  TORCH_CHECK(tables.dtype() == torch::kInt64 && lens.dtype() == torch::kInt64,
              "paged_decode: block tables and lengths must be int64");
  TORCH_CHECK(!dot || (k_cache.dtype() == torch::kBFloat16 && has_bf16_dot()) ||
                  (int8_cache(k_cache) && has_i8_dot()),
              "paged_decode: bfloat16 dot products need a bfloat16 cache and AVX512_BF16, "
              "int8 ones an int8 cache and AVX512_VNNI");
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
  const int64_t RS = D + (int8_cache(k_cache) ? 4 : 0);
  TORCH_CHECK(k_cache.size(3) == RS && D % L == 0,
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
  const float s = static_cast<float>(scale);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  if (k_cache.dtype() == torch::kBFloat16)
    run(Args<bf16>{qp, q.stride(0), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(), tp, lp,
                   op, out.stride(0), H, D, BS, CAP, KV, H / KV, W, s, dot, RS}, n, cost);
  else if (int8_cache(k_cache))
    run(Args<int8_t>{qp, q.stride(0), k_cache.data_ptr<int8_t>(), v_cache.data_ptr<int8_t>(),
                     tp, lp, op, out.stride(0), H, D, BS, CAP, KV, H / KV, W, s, dot, RS},
        n, cost);
  else
    run(Args<float>{qp, q.stride(0), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp,
                    lp, op, out.stride(0), H, D, BS, CAP, KV, H / KV, W, s, false, RS}, n, cost);
}

// A decode-only step's layer in one call: k/v rows (views of the fused q/k/v projection)
// copied into the cache at slots[t] as index_copy_ would (rounded to bf16 or quantized to
// int8 rows as the torch path does), every slot checked first, then paged_decode into a
// new output: the two-call path's bytes, without its Python.
torch::Tensor write_decode(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                           const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& slots, const torch::Tensor& tables,
                           const torch::Tensor& lens, bool dot) {
  const bool i8 = int8_cache(k_cache);
  const int64_t T = slots.size(0), KV = k_cache.size(2), RS = k_cache.size(3);
  const int64_t D = RS - (i8 ? 4 : 0), row = KV * D;
  TORCH_CHECK(k.dtype() == torch::kFloat32 && v.dtype() == torch::kFloat32 &&
              k_cache.dtype() == v_cache.dtype() && (k_cache.dtype() == torch::kFloat32 ||
                                                     k_cache.dtype() == torch::kBFloat16 || i8) &&
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
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  auto write = [&](auto* kc, auto* vc) {  // to bf16 as k.to(bfloat16): nearest, ties even
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < row; ++j) {
        kc[sp[t] * row + j] = kp[t * k.stride(0) + j];
        vc[sp[t] * row + j] = vp[t * v.stride(0) + j];
      }
  };
  if (i8) {
    int8_t *kc = k_cache.data_ptr<int8_t>(), *vc = v_cache.data_ptr<int8_t>();
    for (int64_t t = 0; t < T; ++t)
      for (int64_t h = 0; h < KV; ++h) {
        quantize_row(kp + t * k.stride(0) + h * D, kc + (sp[t] * KV + h) * RS, D);
        quantize_row(vp + t * v.stride(0) + h * D, vc + (sp[t] * KV + h) * RS, D);
      }
  } else if (k_cache.dtype() == torch::kBFloat16) {
    write(k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>());
  } else {
    write(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  }
  torch::Tensor out = torch::empty(q.sizes(), q.options());  // scale: as Python's D ** -0.5
  paged_decode(q, k_cache, v_cache, tables, lens, out, std::pow(static_cast<double>(D), -0.5),
               dot);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, py::call_guard<py::gil_scoped_release>());
  m.def("write_decode", &write_decode, py::call_guard<py::gil_scoped_release>());
  m.def("has_bf16_dot", &has_bf16_dot, py::call_guard<py::gil_scoped_release>());
  m.def("has_i8_dot", &has_i8_dot, py::call_guard<py::gil_scoped_release>());
}
"""

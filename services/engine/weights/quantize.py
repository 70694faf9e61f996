"""Int8 weights for the CPU: a loaded model's projections swapped for weight-only int8.

``quantize_model(model, "int8")`` replaces every projection (q/k/v, o, gate/up, down
and the output head) by an :class:`Int8Linear`: weights int8 with one symmetric scale
per output channel, activations left in float32, the product run by torch's
``_weight_int8pack_mm``. A tied embedding becomes an :class:`Int8Embedding` over int8
rows. The norms, rotary tables and an untied embedding stay float.

It is a memory setting, not a speed one: weights take a quarter of their float32 bytes,
but on the CPUs measured (docs/benchmarks.md) torch's weight-only kernels run a batch-1
projection several times slower than float32, so float32 stays the default. fbgemm's
dynamic int8 (activations quantized too) is fast but moved this family's logits by
20+, so it is not used. Logits stay within the bound tests/test_quantize.py states;
greedy outputs can differ from the float model where two tokens are close.

``"int4"`` is the speed setting: 4-bit weights in groups of 32 along the input, each
group with its own scale and offset (the layout of GGUF's Q4_1, so a Q4_1 file's
weights come back on their own grid), run by ``_weight_int4pack_mm_for_cpu`` on
bfloat16 activations. That kernel is fast only with bfloat16 activations and scales
(with float32 ones it falls back to a path 10-100× slower, docs/benchmarks.md), so a
decode row is rounded to bfloat16 on its way in and the product comes back as float32.
"""


from __future__ import annotations

import warnings

import torch
from torch import nn

QUANTIZATIONS = ("none", "int8", "int4")
INT4_GROUP = 32
# Above this many rows per matmul the weight is expanded to float for the call.
DEQUANTIZE_ROWS = 16


def _quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """A qint8 tensor with one symmetric scale per row of ``weight`` ([out, in])."""
    w = weight.detach().float().contiguous()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12).double()
    zero = torch.zeros(w.shape[0], dtype=torch.long)
    with warnings.catch_warnings():
        # torch marks quantized tensor creation deprecated; it is only the rounding
        # here (int_repr and the scales are kept), and the tests catch its removal.
        warnings.simplefilter("ignore", UserWarning)
        return torch.quantize_per_channel(w, scale, zero, 0, torch.qint8)


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with W int8 per output channel, x and y float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        q = _quantize_rows(weight)
        self.register_buffer("weight", q.int_repr())
        self.register_buffer("scale", q.q_per_channel_scales().float())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if flat.shape[0] > DEQUANTIZE_ROWS:
            # A prefill chunk: expanding the weight costs one pass over it, which the
            # float GEMM amortizes over many rows; the int8 kernel does not.
            y = torch.mm(flat, (self.weight.float() * self.scale[:, None]).t())
        else:
            y = torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scale)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.weight.shape[0])


class Int8Embedding(nn.Module):
    """Rows of an int8 table times their scale: the tied embedding of an int8 head."""

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        q = _quantize_rows(table)
        self.register_buffer("rows", q.int_repr())
        self.register_buffer("scale", q.q_per_channel_scales().float())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows.index_select(0, ids).float() * self.scale.index_select(0, ids)[:, None]


class Int4Linear(nn.Module):
    """``y = x @ W.T + b`` with W 4-bit in groups of ``INT4_GROUP`` inputs (scale and
    offset per group), x rounded to bfloat16 for the kernel, y float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % INT4_GROUP:
            raise ValueError(f"int4 needs input features divisible by {INT4_GROUP}, "
                             f"got {in_features}")
        w = weight.detach().float().reshape(out_features, -1, INT4_GROUP)
        lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-12)
        q = ((w - lo) / scale).round_().clamp_(0, 15)
        # The kernel computes (q - 8) * scale + zero; Q4_1 stores scale * q + min.
        zero = lo + 8 * scale
        self.out_features = out_features
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q.reshape(out_features, in_features).to(torch.int32), 1))
        self.register_buffer("scales_zeros", torch.stack(
            [scale.squeeze(-1).t(), zero.squeeze(-1).t()], dim=-1).to(torch.bfloat16)
            .contiguous())
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the kernel multiplies by."""
        eye = torch.eye(self.packed_in, dtype=torch.bfloat16)
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, INT4_GROUP, self.scales_zeros).float().t()

    @property
    def packed_in(self) -> int:
        return self.scales_zeros.shape[0] * INT4_GROUP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat.to(torch.bfloat16), self.packed, INT4_GROUP, self.scales_zeros).float()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


_LINEAR = {"int8": Int8Linear, "int4": Int4Linear}


def _weight(module: nn.Module) -> torch.Tensor:
    """[out, in] whatever the module's layout (``WideLinear`` holds [in, out])."""
    return module.weight_t.t() if hasattr(module, "weight_t") else module.weight


def quantize_model(model: nn.Module, method: str) -> None:
    """Swap ``model``'s projections in place; ``"none"`` leaves it as it is."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method == "none":
        return

    def swap(parent: nn.Module, name: str) -> None:
        old = getattr(parent, name)
        setattr(parent, name, _LINEAR[method](_weight(old), getattr(old, "bias", None)))

    with torch.no_grad():
        for layer in model.layers:
            swap(layer.self_attn, "qkv_proj")
            swap(layer.self_attn, "o_proj")
            swap(layer.mlp, "gate_up_proj")
            swap(layer.mlp, "down_proj")
        if model.embed_tokens is None:
            model.embed_tokens = Int8Embedding(_weight(model.lm_head))
        swap(model, "lm_head")

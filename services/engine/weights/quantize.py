"""Quantized weights for the CPU: a loaded model's projections swapped for weight-only ones.

``quantize_model(model, "int8")`` replaces every projection (q/k/v, o, gate/up, down
and the output head) by an :class:`Int8Linear`: 8-bit codes in groups of 32 inputs,
each group with a float32 scale and offset (``_group_codes``), activations left in
float32, the product run by kernels/cpu_qmatmul.py. A tied embedding reads the head's
own codes (:class:`Int8HeadEmbedding`, no second table). The norms, rotary tables and
an untied embedding stay float.

Groups of 32 are GGUF's block size: a Q4_1 block (``min + d * k``, k = 0..15, both ends
used) lands on every 17th code, so the default model's weights come back as the file
stores them, and the float32 activations are never rounded: logits then differ from the
float32 model's only by summation order. A Q8_0 block (``d * q``) is kept on its own
grid too; other weights come back within half a step (a 255th of their group's range).
Weights take 1.25 bytes each instead of 4. Batches and prefill chunks of more than 8
rows go through the float GEMM on slices of the weight expanded in cache (the kernel
decides; the expansion is never a whole float copy).

``"int4"``: 4-bit weights in groups of 32 along the input, each
group with its own scale and offset (the layout of GGUF's Q4_1, so a Q4_1 file's
weights come back on their own grid), run by ``_weight_int4pack_mm_for_cpu`` on
bfloat16 activations. That kernel is fast only with bfloat16 activations and scales
(with float32 ones it falls back to a path 10-100× slower, docs/benchmarks.md), so a
decode row is rounded to bfloat16 on its way in and the product comes back as float32.

``"w8a16"`` / ``"w4a16"``: the int8 codes above, or 4-bit codes in groups of 32 (the grid
of ``_group_codes4``: a Q4_1 or Q4_0 block comes back as the file stores it; the output
head stays 8-bit), with each row's activations rounded per group of 32 to
integers of +-16256 levels (about 15 bits), so that a group's product is integer dot
products (kernels/cpu_qmatmul_a8.py, :class:`A8Linear`): decode rows, prefill chunks
and large batches alike (a prefill row gets the same output as it would alone). The
rounding moves an output by at most ``sum |w| * max|x| / 32512`` per group: on the
default model the chat answers stay the float model's (tests/test_default_model.py).

``"w8a8"`` / ``"w4a8"``: the same codes, with each activation group rounded to one int8
(+-127 levels, the scheme of llama.cpp's Q8 activations): one integer dot product per
group instead of two, so matmuls with many rows (prefill chunks, large batches) run
~1.6-2x faster (same kernel, same reference). The rounding moves an output by at most
``sum |w| * max|x| / 254`` per group, 128x the a16 bound; the output head stays w8a16.
"""


from __future__ import annotations

import warnings

import torch
from torch import nn

from kernels import cpu_qmatmul, cpu_qmatmul_a8

QUANTIZATIONS = ("none", "int8", "int4", "w8a16", "w4a16", "w8a8", "w4a8")
# The integer-activation modes: (weight bits, activation levels).
A8_MODES = {"w8a16": (8, cpu_qmatmul_a8.WIDE), "w4a16": (4, cpu_qmatmul_a8.WIDE),
            "w8a8": (8, cpu_qmatmul_a8.NARROW), "w4a8": (4, cpu_qmatmul_a8.NARROW)}
INT4_GROUP = 32
INT8_GROUP = cpu_qmatmul.GROUP


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


def _group_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """uint8 codes, scales and offsets for groups ``w`` ``[out, groups, 32]``.

    Two grids per group, the one that reproduces it better kept: 255 steps from its
    minimum to its maximum (exact for a Q4_1 block, whose 16 levels span that range), and
    steps of ``max|w| / 127`` from zero (exact for a Q8_0 block, ``d * q`` with the
    largest ``|q|`` 127), so either GGUF type comes back as the file stores it.
    """
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    # A group of one value (hi == lo) gets scale 0 and offset lo: exact.
    span = (hi - lo) / 255
    span_codes = ((w - lo) / span.clamp(min=1e-30)).round_().clamp_(0, 255)
    span_err = (span_codes * span + lo - w).abs().amax(-1, keepdim=True)
    step = w.abs().amax(-1, keepdim=True) / 127
    levels = (w / step.clamp(min=1e-30)).round_().clamp_(-127, 127)
    base = levels.amin(-1, keepdim=True)
    sym_offset = base * step
    sym_codes = levels - base  # 0..254
    sym_err = ((sym_codes * step + sym_offset) - w).abs().amax(-1, keepdim=True)
    use_sym = sym_err < span_err
    codes = torch.where(use_sym, sym_codes, span_codes).to(torch.uint8)
    scale = torch.where(use_sym, step, span).squeeze(-1).contiguous()
    offset = torch.where(use_sym, sym_offset, lo).squeeze(-1).contiguous()
    return codes, scale, offset


def _group_codes4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4-bit codes, scales and offsets for groups ``w`` ``[out, groups, 32]``: 15 steps
    from the minimum to the maximum (Q4_1's grid) or steps of ``|extreme| / 8`` around zero
    (Q4_0's, ``d * (q - 8)``), whichever reproduces the group better."""
    lo, hi = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    span = (hi - lo) / 15
    span_codes = ((w - lo) / span.clamp(min=1e-30)).round_().clamp_(0, 15)
    span_err = (span_codes * span + lo - w).abs().amax(-1, keepdim=True)
    # Q4_0 maps its largest-magnitude value to -8: the step's sign follows that value.
    extreme = torch.where(hi.abs() > lo.abs(), hi, lo)
    step = -extreme / 8
    sym_codes = (w / torch.where(step == 0, torch.ones_like(step), step)).round_()
    sym_codes = sym_codes.add_(8).clamp_(0, 15)
    sym_err = (sym_codes * step - 8 * step - w).abs().amax(-1, keepdim=True)
    use_sym = sym_err < span_err
    codes = torch.where(use_sym, sym_codes, span_codes).to(torch.uint8)
    scale = torch.where(use_sym, step, span).squeeze(-1).contiguous()
    offset = torch.where(use_sym, -8 * step, lo).squeeze(-1).contiguous()
    return codes, scale, offset


class A8Linear(nn.Module):
    """``y = x @ W.T + b`` with W as 8- or 4-bit codes in groups of 32 (scale and offset
    each) and activations rounded per group (module docstring)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int,
                 levels: int = cpu_qmatmul_a8.WIDE) -> None:
        super().__init__()
        if levels not in (cpu_qmatmul_a8.WIDE, cpu_qmatmul_a8.NARROW):
            raise ValueError(f"levels must be {cpu_qmatmul_a8.WIDE} or "
                             f"{cpu_qmatmul_a8.NARROW}, got {levels}")
        out_features, in_features = weight.shape
        if in_features % INT8_GROUP:
            raise ValueError(f"w{bits} needs input features divisible by {INT8_GROUP}, "
                             f"got {in_features}")
        grouped = weight.detach().float().reshape(out_features, -1, INT8_GROUP)
        codes, scale, offset = (_group_codes if bits == 8 else _group_codes4)(grouped)
        packed, scale, offset = cpu_qmatmul_a8.pack(
            codes.reshape(out_features, in_features), scale, offset, bits)
        self.bits, self.levels, self.out_features = bits, levels, out_features
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Float32 weight rows ``ids`` (the tied embedding's lookup)."""
        return cpu_qmatmul_a8.unpack_rows(self.packed, self.scale, self.offset, self.bits, ids)

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the kernel multiplies by."""
        return self.rows(torch.arange(self.out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = cpu_qmatmul_a8.qmatmul(flat, self.packed, self.scale, self.offset, self.bits,
                                   self.levels)
        if y.shape[1] != self.out_features:
            y = y[:, :self.out_features]
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.out_features)


class A8HeadEmbedding(nn.Module):
    """The tied embedding of an :class:`A8Linear` head: its rows, dequantized."""

    def __init__(self, head: A8Linear) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule, so its buffers are not counted twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head[0].rows(ids)


class Int8Linear(nn.Module):
    """``y = x @ W.T + b`` with W as 8-bit codes in groups of ``INT8_GROUP`` inputs, each
    group with a float32 scale and offset (``W = codes * scale + offset``, the grid
    ``_group_codes`` picks), x and y float32 (kernels/cpu_qmatmul.py)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        out_features, in_features = weight.shape
        if in_features % INT8_GROUP:
            raise ValueError(f"int8 needs input features divisible by {INT8_GROUP}, "
                             f"got {in_features}")
        codes, scale, offset = _group_codes(
            weight.detach().float().reshape(out_features, -1, INT8_GROUP))
        self.register_buffer("codes", codes.reshape(out_features, in_features))
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone())

    def dequantized(self) -> torch.Tensor:
        """The float32 ``[out, in]`` weight the kernel multiplies by."""
        return cpu_qmatmul.dequantize(self.codes, self.scale, self.offset)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = cpu_qmatmul.qmatmul(flat, self.codes, self.scale, self.offset)
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], self.codes.shape[0])


class Int8HeadEmbedding(nn.Module):
    """The tied embedding of an 8-bit head: a token's row is its head column's codes,
    dequantized (no second table)."""

    def __init__(self, head: Int8Linear) -> None:
        super().__init__()
        self.head = [head]  # a list: not a submodule, so its buffers are not counted twice

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        head = self.head[0]
        n = ids.shape[0]
        codes = head.codes.index_select(0, ids).view(n, -1, INT8_GROUP).float()
        rows = codes * head.scale.index_select(0, ids)[..., None]
        return rows.add_(head.offset.index_select(0, ids)[..., None]).view(n, -1)


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


def _a8(method: str):
    bits, levels = A8_MODES[method]
    return lambda w, b: A8Linear(w, b, bits, levels)


_LINEAR = {"int8": Int8Linear, "int4": Int4Linear} | {m: _a8(m) for m in A8_MODES}


def _weight(module: nn.Module) -> torch.Tensor:
    """[out, in] whatever the module's layout (``WideLinear`` holds [in, out])."""
    return module.weight_t.t() if hasattr(module, "weight_t") else module.weight


def quantize_model(model: nn.Module, method: str) -> None:
    """Swap ``model``'s projections in place; ``"none"`` leaves it as it is."""
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
    if method == "none":
        return
    if method in A8_MODES:
        cpu_qmatmul_a8.available()  # as below
    if method == "int8":
        # Build (or load the cached build of) the kernel now, at load, not inside the
        # first request's step: a cold build takes a minute or more.
        cpu_qmatmul.available()

    def swap(parent: nn.Module, name: str, kind: str = method) -> None:
        old = getattr(parent, name)
        setattr(parent, name, _LINEAR[kind](_weight(old), getattr(old, "bias", None)))

    with torch.no_grad():
        for layer in model.layers:
            swap(layer.self_attn, "qkv_proj")
            swap(layer.self_attn, "o_proj")
            swap(layer.mlp, "gate_up_proj")
            swap(layer.mlp, "down_proj")
        tied = model.embed_tokens is None
        if tied and method == "int4":
            model.embed_tokens = Int8Embedding(_weight(model.lm_head))
        # w4a16 keeps the head (and the embedding it doubles as) at 8 bits, as 4-bit GGUF
        # files keep theirs at Q8_0/Q6_K: the logits are where 4 bits hurt most; w8a8 and
        # w4a8 keep its activations wide too (only sampled positions reach the head).
        swap(model, "lm_head", "w8a16" if method in A8_MODES else method)
        if tied and method == "int8":
            model.embed_tokens = Int8HeadEmbedding(model.lm_head)
        elif tied and method in A8_MODES:
            model.embed_tokens = A8HeadEmbedding(model.lm_head)

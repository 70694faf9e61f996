"""Int8 weights: logits near the float model's, memory down, settings checked."""

from __future__ import annotations

import pytest
import torch

from common.sampling_params import SamplingParams
from kernels import cpu_qmatmul_a8
from services.engine.config import EngineConfig
from services.engine.weights.quantize import (
    INT4_GROUP,
    A8Linear,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    quantize_model,
)
from services.worker.settings import WorkerSettings
from tests.tiny_models import make_tiny_model

PROMPT = [5, 17, 99, 3, 42, 7, 64, 11, 250, 8, 1, 77]


def test_int8_linear_is_close_and_keeps_bias():
    torch.manual_seed(0)
    ref = torch.nn.Linear(64, 48)
    q = Int8Linear(ref.weight, ref.bias)
    assert q.codes.dtype == torch.uint8 and q.scale.shape == (48, 2)
    # Each weight is off by at most half a step of its group's scale.
    step = q.scale.repeat_interleave(32, dim=1)
    assert ((q.dequantized() - ref.weight).abs() <= step / 2 + 1e-7).all()
    for rows in (1, 40):  # the 8-bit loop (5 rows), expanded slices (200 rows)
        x = torch.randn(rows, 5, 64)
        with torch.no_grad():
            want = ref(x)
            exact = x @ q.dequantized().t() + ref.bias
        got = q(x)
        assert got.shape == want.shape
        torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
        bound = x.abs() @ (step / 2).t() + 1e-5
        assert ((got - want).abs() <= bound).all()


def test_int8_recovers_a_q4_1_grid():
    # A GGUF Q4_1 block is min + d * k, k in 0..15 with 0 and 15 used: on 255 steps
    # those are codes 17 k, so the file's weights come back (to float32 rounding).
    g = torch.Generator().manual_seed(1)
    k = torch.randint(0, 16, (8, 4, 32), generator=g)
    k[..., 0], k[..., 1] = 0, 15
    d, m = torch.rand(8, 4, 1, generator=g) / 10, torch.randn(8, 4, 1, generator=g)
    w = (m + d * k).reshape(8, 128)
    q = Int8Linear(w, None)
    assert (q.codes.view(8, 4, 32).long() == 17 * k).all()
    torch.testing.assert_close(q.dequantized(), w, rtol=0, atol=2e-6)


def test_int8_recovers_a_q8_0_grid():
    # A Q8_0 block is d * q, q in -127..127 with the largest |q| 127: kept on its grid.
    g = torch.Generator().manual_seed(2)
    q = torch.randint(-100, 100, (8, 4, 32), generator=g)
    q[..., 3] = 127
    d = torch.rand(8, 4, 1, generator=g) / 100
    w = (d * q).reshape(8, 128)
    lin = Int8Linear(w, None)
    torch.testing.assert_close(lin.dequantized(), w, rtol=0, atol=1e-6)  # float rounding
    assert (lin.codes.view(8, 4, 32).long() == q - q.amin(-1, keepdim=True)).all()


def test_int8_tied_embedding_reads_the_head_codes(tmp_path, make_engine):
    path = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    engine = make_engine(path, dtype="float32", quantization="int8")
    model = engine.model
    ids = torch.tensor([0, 7, 3, 7])
    assert not list(model.embed_tokens.buffers())  # no second table
    torch.testing.assert_close(model.embed_tokens(ids),
                               model.lm_head.dequantized()[ids], rtol=0, atol=0)


def test_int8_embedding_rows():
    table = torch.randn(30, 8)
    emb = Int8Embedding(table)
    ids = torch.tensor([0, 29, 4])
    torch.testing.assert_close(emb(ids), table[ids], atol=float(emb.scale.max()) / 2 + 1e-6,
                               rtol=0)


def test_int4_recovers_a_q4_1_grid_and_keeps_bias():
    """Weights on Q4_1's grid (scale * q + min per 32 inputs, q spanning 0..15) come back
    on that grid, off only by the bfloat16 rounding of each group's scale and offset."""
    torch.manual_seed(0)
    out_f, in_f = 48, 96
    d = torch.rand(out_f, in_f // INT4_GROUP, 1) * 0.01 + 1e-3
    m = -torch.rand(out_f, in_f // INT4_GROUP, 1) * 0.05
    q = torch.randint(0, 16, (out_f, in_f // INT4_GROUP, INT4_GROUP)).float()
    q[..., 0], q[..., 1] = 0, 15
    weight = (d * q + m).reshape(out_f, in_f)
    bias = torch.randn(out_f)
    lin = Int4Linear(weight, bias)
    assert lin.packed.dtype == torch.uint8 and lin.scales_zeros.dtype == torch.bfloat16
    deq = lin.dequantized()
    # bfloat16 keeps 8 bits: the offset |m + 8d| is off by < 2^-9 of itself, the scale
    # by < 2^-9 of itself times |q - 8| <= 8, and the kernel rounds its output (here
    # the weight) to bfloat16; together still well under half a step (d / 2).
    w = weight.reshape_as(q)
    bound = ((m.abs() + 8 * d) + 8 * d + w.abs()) * 2 ** -8
    assert ((deq.reshape_as(q) - w).abs() <= bound).all()
    assert (bound < d / 2).all()
    for rows in (1, 40):  # a decode row and a prefill chunk take the same kernel
        x = torch.randn(rows, 3, in_f)
        got = lin(x)
        assert got.shape == (rows, 3, out_f) and got.dtype == torch.float32
        want = x.bfloat16().float() @ deq.t() + bias
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_int4_refuses_a_width_off_the_group():
    with pytest.raises(ValueError, match="divisible"):
        Int4Linear(torch.randn(8, 40), None)


@pytest.mark.parametrize("method", ["int8", "int4", "w8a16", "w4a16", "w8a8", "w4a8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_logits_stay_close(arch, method, tiny_dirs, make_engine):
    logits = {}
    for q in ("none", method):
        engine = make_engine(tiny_dirs[arch], dtype="float32", quantization=q)
        engine.add_request("r", PROMPT, SamplingParams(temperature=0, max_tokens=1,
                                                       logprobs=5))
        logits[q] = engine.step()[0].new_logprobs[0]
        if q != "none":
            kind = {"int8": Int8Linear, "int4": Int4Linear}.get(q, A8Linear)
            assert isinstance(engine.model.layers[0].mlp.down_proj, kind)
    ref, got = logits["none"], logits[method]
    # Stated tolerance: top-5 log-probabilities within 0.1 (int8: 256 levels per 32
    # weights) or 0.6 (int4: 16 levels per 32 random normal weights, the worst case) of
    # the float model's on the tiny models; docs/benchmarks.md has SmolLM2-135M's figures.
    # w8a16/w4a16 add the rounding of each activation group (half a step of
    # max|x| / 16256) on top of their weights' grid: negligible beside it; w8a8/w4a8 a
    # step of max|x| / 127, still well inside the weights' own.
    tol = {"int8": 0.1, "int4": 0.6, "w8a16": 0.1, "w4a16": 0.6, "w8a8": 0.1,
           "w4a8": 0.6}[method]
    want = dict(ref.top)
    shared = [(lp, want[token]) for token, lp in got.top if token in want]
    assert len(shared) >= 3
    for lp, ref_lp in shared:
        assert lp == pytest.approx(ref_lp, abs=tol)
    if method in ("int8", "w8a16", "w8a8"):
        assert got.token_id == ref.token_id
    else:  # a random tiny model's top tokens lie within 0.2 of each other
        assert got.token_id in want


def test_int8_has_its_own_fingerprint(tiny_dirs, make_engine):
    a = make_engine(tiny_dirs["llama"], dtype="float32")
    b = make_engine(tiny_dirs["llama"], dtype="float32", quantization="int8")
    assert a.fingerprint != b.fingerprint


def test_quantized_weights_take_less_memory(tiny_dirs, make_engine):
    def nbytes(engine):
        tensors = [*engine.model.parameters(), *engine.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
    full = make_engine(tiny_dirs["llama"], dtype="float32")
    small = make_engine(tiny_dirs["llama"], dtype="float32", quantization="int8")
    smaller = make_engine(tiny_dirs["llama"], dtype="float32", quantization="int4")
    assert nbytes(small) < 0.5 * nbytes(full)
    # The int8 embedding of the tied head is in both; the projections halve.
    assert nbytes(smaller) < 0.8 * nbytes(small)


@pytest.mark.parametrize("kwargs", [{"quantization": "int3"},
                                    {"quantization": "int4", "dtype": "bfloat16"},
                                    {"quantization": "int8", "dtype": "float64"}])
def test_bad_quantization_settings(kwargs):
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(**kwargs)


def test_worker_setting():
    assert WorkerSettings(quantization="int8").quantization == "int8"
    assert WorkerSettings(quantization="int4").quantization == "int4"
    assert WorkerSettings(quantization="w4a16").quantization == "w4a16"
    assert EngineConfig(quantization="w8a16").quantization == "w8a16"
    assert WorkerSettings(quantization="w4a8").quantization == "w4a8"
    assert EngineConfig(quantization="w8a8").quantization == "w8a8"
    with pytest.raises(ValueError, match="quantization"):
        WorkerSettings(quantization="fp4")


def test_none_leaves_the_model_alone():
    model = torch.nn.Module()
    quantize_model(model, "none")
    with pytest.raises(ValueError):
        quantize_model(model, "int3")


def _rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What rounding each activation by at most half its group's step (max|x| / 16256)
    can move ``x @ w.T``, plus float32 slack."""
    from kernels.cpu_qmatmul_a8 import WIDE, quantize_activations
    flat = x.reshape(-1, x.shape[-1])
    _, dx, _ = quantize_activations(flat, WIDE)
    half = (dx / 2).repeat_interleave(32, dim=1)
    return (half @ w.abs().t() + 1e-4).view(*x.shape[:-1], w.shape[0])


def _q4_blocks(seed: int, symmetric: bool):
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(0, 16, (16, 4, 32), generator=g)
    d = torch.rand(16, 4, 1, generator=g) / 10 + 1e-3
    if symmetric:  # Q4_0: d * (q - 8), the largest magnitude at q = 0
        k[..., 0] = 0
        return k, (d * (k - 8)).reshape(16, 128)
    k[..., 0], k[..., 1] = 0, 15  # Q4_1: min + d * q, both ends used
    return k, (torch.randn(16, 4, 1, generator=g) + d * k).reshape(16, 128)


@pytest.mark.parametrize("symmetric", [False, True])
def test_w4a16_recovers_q4_grids(symmetric):
    k, w = _q4_blocks(5, symmetric)
    bias = torch.randn(16)
    lin = A8Linear(w, bias, 4)
    assert lin.packed.numel() == 16 * 128 // 2  # two weights a byte
    torch.testing.assert_close(lin.dequantized(), w, rtol=0, atol=2e-6)
    x = torch.randn(40, 128)
    exact = x @ w.t() + bias
    # 40 rows (a prefill chunk) or one (a decode step): rounded activations, within the
    # bound, and a row's output the same in either.
    got = lin(x)
    assert ((got - exact).abs() <= _rounding_bound(x, w)).all()
    one = lin(x[:1])
    assert one.shape == (1, 16)
    assert ((one - exact[:1]).abs() <= _rounding_bound(x[:1], w)).all()
    if cpu_qmatmul_a8.available():
        assert torch.equal(one, got[:1])


def test_w8a16_keeps_the_int8_grid_and_pads_rows():
    torch.manual_seed(3)
    w = torch.randn(20, 64)  # 20 rows: padded to 32 inside, sliced on the way out
    a8, i8 = A8Linear(w, None, 8), Int8Linear(w, None)
    torch.testing.assert_close(a8.dequantized(), i8.dequantized(), rtol=0, atol=0)
    x = torch.randn(3, 2, 64)
    got = a8(x)
    assert got.shape == (3, 2, 20)
    assert (got - i8(x)).abs().max() > 0  # the activations were rounded
    assert ((got - i8(x)).abs() <= _rounding_bound(x, a8.dequantized())).all()


@pytest.mark.parametrize("method", ["w8a16", "w4a16"])
def test_a16_tied_embedding_reads_the_head(tmp_path, make_engine, method):
    path = make_tiny_model(tmp_path / "tied", "llama", tie_word_embeddings=True)
    model = make_engine(path, dtype="float32", quantization=method).model
    assert model.lm_head.bits == 8  # w4a16 too: the head keeps 8 bits
    assert model.layers[0].mlp.down_proj.bits == int(method[1])
    ids = torch.tensor([0, 7, 3, 7])
    assert not list(model.embed_tokens.buffers())  # no second table
    torch.testing.assert_close(model.embed_tokens(ids),
                               model.lm_head.dequantized()[ids], rtol=0, atol=0)


@pytest.mark.parametrize("method,bits,levels", [("w4a16", 4, cpu_qmatmul_a8.WIDE),
                                                ("w4a8", 4, cpu_qmatmul_a8.NARROW),
                                                ("w8a8", 8, cpu_qmatmul_a8.NARROW)])
def test_a8_modes_round_activations_as_named(method, bits, levels, tiny_dirs, make_engine):
    """Every projection of an a8 mode rounds to one int8 per activation, an a16 one to
    two; the head stays w8a16 in every mode (logits are where rounding hurts most)."""
    engine = make_engine(tiny_dirs["llama"], dtype="float32", quantization=method)
    layer = engine.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert (proj.bits, proj.levels) == (bits, levels)
    assert (engine.model.lm_head.bits, engine.model.lm_head.levels) == (8, cpu_qmatmul_a8.WIDE)
    # The projection's output is the kernel's at its levels, not at the other's.
    p = layer.mlp.down_proj
    x = torch.randn(12, layer.mlp.inter)
    want = cpu_qmatmul_a8.qmatmul(x, p.packed, p.scale, p.offset, bits, levels)
    other = cpu_qmatmul_a8.qmatmul(x, p.packed, p.scale, p.offset, bits,
                                   cpu_qmatmul_a8.WIDE + cpu_qmatmul_a8.NARROW - levels)
    got = p(x)
    assert torch.equal(got, want[:, :p.out_features])
    assert not torch.equal(got, other[:, :p.out_features])


def test_a8_linear_refuses_other_levels():
    with pytest.raises(ValueError, match="levels"):
        A8Linear(torch.randn(16, 32), None, 4, levels=255)

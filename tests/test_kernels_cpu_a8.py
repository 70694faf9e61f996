"""The CPU integer-dot kernel (kernels/cpu_qmatmul_a8.py) against its torch reference."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_qmatmul, cpu_qmatmul_a8, cpu_qmatmul_a8_rows

HAVE_CXX = shutil.which(os.environ.get("CXX", "c++")) is not None


def _weights(n: int, k: int, bits: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2 ** bits, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) / 100
    offset = torch.randn(n, k // 32, generator=g) / 10
    return codes, scale, offset


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (96, 576)])
def test_pack_keeps_every_weight(bits, n, k):
    codes, scale, offset = _weights(n, k, bits, seed=n + bits)
    packed, s, o = cpu_qmatmul_a8.pack(codes, scale, offset, bits)
    assert packed.numel() == -(-n // 16) * 16 * k * bits // 8
    assert s.shape == o.shape == (-(-n // 16), k // 32, 16)
    rows = torch.tensor([n - 1, 0, 3, n - 1])
    torch.testing.assert_close(cpu_qmatmul_a8.unpack_rows(packed, s, o, bits, rows),
                               cpu_qmatmul.dequantize(codes, scale, offset)[rows],
                               rtol=0, atol=0)


def test_activation_rounding():
    x = torch.tensor([[0.5, -1.0, 0.25, 0.0] + [0.0] * 28, [0.0] * 32])
    wide, dw, _ = cpu_qmatmul_a8.quantize_activations(x, cpu_qmatmul_a8.WIDE)
    assert wide.dtype == torch.int16 and wide[0, :4].tolist() == [8128, -16256, 4064, 0]
    assert dw[0, 0] == pytest.approx(1 / 16256)
    xq, dx, xs = cpu_qmatmul_a8.quantize_activations(x)
    assert xq[0, :4].tolist() == [64, -127, 32, 0]  # 63.5 rounds to even
    assert dx.tolist() == [[pytest.approx(1 / 127)], [0.0]]
    assert xs.tolist() == [[-0.25], [0.0]]
    assert not xq[1].any()  # an all-zero group stays zero (no division by zero)


@pytest.mark.parametrize("levels", [cpu_qmatmul_a8.NARROW, cpu_qmatmul_a8.WIDE])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [1, 3, 8, 9])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (96, 1536)])
def test_kernel_equals_reference(bits, m, n, k, levels):
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: these weights take the reference path")
    assert cpu_qmatmul_a8.available()  # with a compiler at hand, the kernel must build
    codes, scale, offset = _weights(n, k, bits, seed=m * 100 + n + bits)
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    want = cpu_qmatmul_a8.qmatmul_reference(x, *packed, bits, levels)
    got = cpu_qmatmul_a8.qmatmul(x, *packed, bits, levels)
    assert got.dtype == torch.float32 and got.shape == (m, -(-n // 16) * 16)
    # float32 sums of up to 48 group terms against a float64 reference
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4 + 3e-5 * float(want.abs().max()))
    # The rounding's cost, stated: each activation moves by at most half its group's
    # step (up to 8 rows; more rows are not rounded at all).
    w = cpu_qmatmul.dequantize(codes, scale, offset)
    _, dx, _ = cpu_qmatmul_a8.quantize_activations(x, levels)
    half = (dx / 2).repeat_interleave(32, dim=1) if m <= 8 else torch.zeros_like(x)
    err = (got[:, :n] - x @ w.t()).abs()
    assert (err <= half @ w.abs().t() + 1e-3).all()


def test_kernel_reads_non_contiguous_activations():
    codes, scale, offset = _weights(16, 64, 8, seed=3)
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, 8)
    x = torch.randn(64, 6)[:, ::2].t()  # [3, 64] with strides (2, 6)
    torch.testing.assert_close(cpu_qmatmul_a8.qmatmul(x, *packed, 8),
                               cpu_qmatmul_a8.qmatmul_reference(x.contiguous(), *packed, 8))


def test_bad_shapes_and_codes():
    codes, scale, offset = _weights(16, 64, 8, seed=4)
    with pytest.raises(ValueError, match="0..15"):
        cpu_qmatmul_a8.pack(codes | 16, scale, offset, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_qmatmul_a8.pack(codes[:, :40], scale, offset, 8)
    with pytest.raises(ValueError, match="bits"):
        cpu_qmatmul_a8.pack(codes, scale, offset, 2)
    if not HAVE_CXX:
        return
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, 8)
    with pytest.raises(RuntimeError, match="x:"):
        cpu_qmatmul_a8.qmatmul(torch.randn(2, 32), *packed, 8)
    with pytest.raises(RuntimeError, match="packed:"):
        cpu_qmatmul_a8.qmatmul(torch.randn(2, 64), *packed, 4)
    with pytest.raises(RuntimeError, match="levels:"):
        cpu_qmatmul_a8.qmatmul(torch.randn(2, 64), *packed, 8, 255)


def test_no_compiler_falls_back_to_the_reference(monkeypatch):
    codes, scale, offset = _weights(32, 64, 4, seed=5)
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, 4)
    monkeypatch.setattr(cpu_qmatmul_a8._KERNEL, "module", lambda: None)
    x = torch.randn(2, 64)
    wide = cpu_qmatmul_a8.WIDE
    assert torch.equal(cpu_qmatmul_a8.qmatmul(x, *packed, 4, wide),
                       cpu_qmatmul_a8.qmatmul_reference(x, *packed, 4, wide))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("m", [9, 13, 25, 40])
@pytest.mark.parametrize("n,k", [(16, 32), (40, 64), (96, 1536)])
def test_many_rows_kernel_equals_the_expansion(bits, m, n, k):
    """More than 8 rows: tiles of up to 12 rows, an odd last block (n = 40), the float
    product of the expanded weight up to summation order."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: these rows take the torch expansion")
    assert cpu_qmatmul_a8_rows.available()
    codes, scale, offset = _weights(n, k, bits, seed=m * 7 + n + bits)
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    got = cpu_qmatmul_a8.qmatmul(x, *packed, bits, cpu_qmatmul_a8.WIDE)
    want = cpu_qmatmul_a8._expanded(x, *packed, bits)
    assert got.shape == (m, -(-n // 16) * 16)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    w = cpu_qmatmul.dequantize(codes, scale, offset)
    exact = (x.double() @ w.double().t()).float()
    torch.testing.assert_close(got[:, :n], exact, rtol=1e-5,
                               atol=1e-5 * float(exact.abs().max()))
    # padded rows of the last block carry zero codes, scale and offset
    assert not got[:, n:].any()


def test_many_rows_reads_non_contiguous_activations():
    codes, scale, offset = _weights(48, 64, 4, seed=6)
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, 4)
    x = torch.randn(64, 40)[:, ::2].t()  # [20, 64] with strides (2, 40)
    torch.testing.assert_close(cpu_qmatmul_a8.qmatmul(x, *packed, 4),
                               cpu_qmatmul_a8._expanded(x.contiguous(), *packed, 4),
                               rtol=1e-5, atol=1e-5)


def test_many_rows_without_a_compiler_expand_in_torch(monkeypatch):
    codes, scale, offset = _weights(32, 64, 4, seed=7)
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, 4)
    monkeypatch.setattr(cpu_qmatmul_a8_rows._KERNEL, "module", lambda: None)
    x = torch.randn(12, 64)
    assert cpu_qmatmul_a8_rows.qmatmul_rows(x, *packed, 4) is None
    assert torch.equal(cpu_qmatmul_a8.qmatmul(x, *packed, 4),
                       cpu_qmatmul_a8._expanded(x, *packed, 4))

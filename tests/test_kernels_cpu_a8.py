"""The CPU integer-dot kernel (kernels/cpu_qmatmul_a8.py) against its torch reference."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_qmatmul, cpu_qmatmul_a8

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
@pytest.mark.parametrize("m", [1, 3, 8, 9, 20])
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
    # step, however many rows the step has.
    w = cpu_qmatmul.dequantize(codes, scale, offset)
    _, dx, _ = cpu_qmatmul_a8.quantize_activations(x, levels)
    half = (dx / 2).repeat_interleave(32, dim=1)
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
@pytest.mark.parametrize("m", [9, 13, 25])
@pytest.mark.parametrize("n,k", [(40, 64), (160, 96)])
def test_a_row_does_not_depend_on_its_batch(bits, m, n, k):
    """More than 8 rows run 8 at a time over tiles of 8 blocks (n = 160: two tiles): each
    row's output is bit for bit what it gets alone, as a decode step computes it."""
    if not HAVE_CXX:
        pytest.skip("no C++ compiler: these rows take the torch expansion")
    codes, scale, offset = _weights(n, k, bits, seed=m * 7 + n + bits)
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, bits)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * 3
    got = cpu_qmatmul_a8.qmatmul(x, *packed, bits, cpu_qmatmul_a8.WIDE)
    alone = torch.cat([cpu_qmatmul_a8.qmatmul(x[i:i + 1], *packed, bits, cpu_qmatmul_a8.WIDE)
                       for i in range(m)])
    assert torch.equal(got, alone)
    assert got[:, :n].abs().sum() > 0 and not got[:, n:].any()  # padded rows: zero weights


def test_many_rows_without_a_compiler_expand_in_torch(monkeypatch):
    codes, scale, offset = _weights(32, 64, 4, seed=7)
    packed = cpu_qmatmul_a8.pack(codes, scale, offset, 4)
    monkeypatch.setattr(cpu_qmatmul_a8._KERNEL, "module", lambda: None)
    x = torch.randn(12, 64)
    got = cpu_qmatmul_a8.qmatmul(x, *packed, 4, cpu_qmatmul_a8.WIDE)
    assert torch.equal(got, cpu_qmatmul_a8._expanded(x, *packed, 4))
    torch.testing.assert_close(got[:, :32], x @ cpu_qmatmul.dequantize(codes, scale, offset).t(),
                               rtol=1e-5, atol=1e-5)

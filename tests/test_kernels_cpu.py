"""The CPU 8-bit matmul kernel (kernels/cpu_qmatmul.py) against its torch reference."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from kernels import cpu_qmatmul


def _weights(n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) / 100
    offset = torch.randn(n, k // 32, generator=g)
    return codes, scale, offset


# Row tiles of 4 and their remainders, then the GEMM over slices (past 8 rows).
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 9, 40])
@pytest.mark.parametrize("n,k", [(1, 32), (17, 64), (96, 576), (300, 64)])
def test_kernel_equals_reference(m, n, k):
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler: int8 weights take the reference path")
    assert cpu_qmatmul.available()  # with a compiler at hand, the kernel must build
    codes, scale, offset = _weights(n, k, seed=m * 1000 + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    want = cpu_qmatmul.qmatmul_reference(x.double(), codes, scale.double(), offset.double())
    got = cpu_qmatmul.qmatmul(x, codes, scale, offset)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


def test_kernel_reads_non_contiguous_activations():
    codes, scale, offset = _weights(8, 64, seed=3)
    x = torch.randn(64, 6)[:, ::2].t()  # [3, 64] with strides (2, 6)
    torch.testing.assert_close(cpu_qmatmul.qmatmul(x, codes, scale, offset),
                               cpu_qmatmul.qmatmul_reference(x, codes, scale, offset))


@pytest.mark.parametrize("bad", ["dtype", "width", "scale"])
def test_kernel_refuses_bad_shapes(bad):
    codes, scale, offset = _weights(8, 64, seed=4)
    x = torch.randn(2, 64)
    if bad == "dtype":
        x = x.double()
    elif bad == "width":
        x = torch.randn(2, 32)
    else:
        scale = scale[:, :1]
    with pytest.raises(RuntimeError, match="x:|codes:|scale"):
        cpu_qmatmul.qmatmul(x, codes, scale, offset)


def test_a_kernel_that_cannot_build_is_tried_once_and_leaves_the_torch_path(monkeypatch):
    from kernels.cpu_build import CppKernel

    calls = []

    def no_compiler(self):
        calls.append(self.name)
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(CppKernel, "_compile", no_compiler)
    kernel = CppKernel("pdserve_test_missing", "int f();", "the torch path")
    assert kernel.ready() is False  # the first call starts the build in a thread
    kernel._background.join(timeout=10)
    assert kernel.module() is None and kernel.available() is False
    assert kernel.ready() is False
    assert calls == ["pdserve_test_missing"]  # tried once, not on every call


def test_ready_answers_at_once_while_a_build_runs(monkeypatch):
    """A worker asks ``ready()`` on its event loop: it must not wait out a compile."""
    import threading
    import time

    from kernels.cpu_build import CppKernel

    release = threading.Event()

    def slow_compiler(self):
        release.wait(30)
        raise RuntimeError("no C++ compiler")
    monkeypatch.setattr(CppKernel, "_compile", slow_compiler)
    kernel = CppKernel("pdserve_test_slow", "int f();", "the torch path")
    assert kernel.ready() is False  # starts the build, which now holds its lock
    started = time.monotonic()
    answers = [kernel.ready() for _ in range(3)]
    waited = time.monotonic() - started
    release.set()
    kernel._background.join(timeout=10)
    assert answers == [False, False, False] and waited < 5.0
    assert kernel.available() is False


def test_a_lock_left_by_a_dead_build_is_cleared(tmp_path, monkeypatch):
    import os
    import time

    from kernels import cpu_build

    monkeypatch.setattr("torch.utils.cpp_extension._get_build_directory",
                        lambda name, verbose: str(tmp_path / name))
    (tmp_path / "fresh").mkdir()
    (tmp_path / "old").mkdir()
    (tmp_path / "fresh" / "lock").write_text("")
    (tmp_path / "old" / "lock").write_text("")
    past = time.time() - cpu_build.STALE_LOCK_S - 60
    os.utime(tmp_path / "old" / "lock", (past, past))
    cpu_build._clear_stale_lock("fresh")  # a build in progress keeps its lock
    cpu_build._clear_stale_lock("old")
    cpu_build._clear_stale_lock("none")  # no lock at all: nothing to do
    assert (tmp_path / "fresh" / "lock").exists()
    assert not (tmp_path / "old" / "lock").exists()

"""Small C++ kernels for the CPU, compiled once per machine with the host's compiler.

torch's extension loader builds each source (``-O3 -march=native``) into
``~/.cache/torch_extensions`` the first time a process asks for it, and loads the cached
build after that. A machine without a compiler (or headers) gets ``None`` and one
warning: every caller keeps a torch path that needs no build.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
import time

log = logging.getLogger(__name__)


class CppKernel:
    """One extension module, built at most once per process, by the first caller."""

    def __init__(self, name: str, source: str, fallback: str) -> None:
        self.name, self.source, self.fallback = name, source, fallback
        self._lock = threading.Lock()  # held for the whole build
        self._start = threading.Lock()  # held only to start the background build
        self._built: list = []  # [module or None] once tried
        self._background: threading.Thread | None = None

    def module(self):
        """The built module, or None where it cannot be built (builds it, waiting)."""
        if self._built:
            return self._built[0]
        with self._lock:
            if not self._built:
                try:
                    from torch.utils.cpp_extension import load_inline
                    _clear_stale_lock(self.name)
                    mod = load_inline(name=self.name, cpp_sources=self.source,
                                      extra_cflags=["-O3", "-march=native"])
                except Exception as exc:  # no compiler, no headers: the torch path works
                    log.warning("%s unavailable (%s); %s", self.name, exc, self.fallback)
                    mod = None
                self._built.append(mod)
        return self._built[0]

    def available(self) -> bool:
        """Whether the module is built (builds it on first call, waiting for it)."""
        return self.module() is not None

    def ready(self) -> bool:
        """Whether the module is built, without waiting: the first call starts the build
        in a thread (tens of seconds with a cold extension cache), so a caller runs its
        torch path meanwhile instead of stalling on a compiler."""
        if self._built:
            return self._built[0] is not None
        # Never the build's own lock: a caller on an event loop must not wait out a compile.
        with self._start:
            if self._background is None:
                self._background = threading.Thread(target=self.module, daemon=True,
                                                    name=f"{self.name}-build")
                self._background.start()
                _BUILDS.append(self._background)
        return False


# A process that exits while a build thread is inside the loader's C++ (importing the
# built module) aborts ("terminate called without an active exception", exit -6) when
# finalization stops that thread: so exiting waits for the builds in progress, which
# also leaves the cache built for the next process.
_BUILDS: list[threading.Thread] = []
EXIT_WAIT_S = 300.0


@atexit.register
def _finish_builds() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in _BUILDS:
        if thread.is_alive():
            log.info("waiting for the %s to finish before exiting", thread.name)
            thread.join(max(0.0, deadline - time.monotonic()))


STALE_LOCK_S = 600.0  # one source file compiles in well under this


def _clear_stale_lock(name: str) -> None:
    """torch's loader waits, without end, for the lock file of a build in progress; a
    build killed half way leaves that file behind and would hang every later one."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
    try:
        age = time.time() - os.stat(lock).st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        log.warning("%s: removing a build lock left %.0f s ago by a build that died", name, age)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock)


def build_all(kernels: list[CppKernel]) -> dict[str, bool]:
    """Build ``kernels`` side by side (each is one compile, so one core apiece) and say
    which were built: what ``make test`` and ``make run-local`` run before they start."""
    for kernel in kernels:
        kernel.ready()
    return {kernel.name: kernel.available() for kernel in kernels}

"""Small C++ kernels for the CPU, compiled once per machine with the host's compiler.

torch's extension loader builds each source (``-O3 -march=native``) into
``~/.cache/torch_extensions`` the first time a process asks for it, and loads the cached
build after that. A machine without a compiler (or headers) gets ``None`` and one
warning: every caller keeps a torch path that needs no build.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class CppKernel:
    """One extension module, built at most once per process, by the first caller."""

    def __init__(self, name: str, source: str, fallback: str) -> None:
        self.name, self.source, self.fallback = name, source, fallback
        self._lock = threading.Lock()
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
        with self._lock:
            if self._background is None:
                self._background = threading.Thread(target=self.module, daemon=True,
                                                    name=f"{self.name}-build")
                self._background.start()
        return False

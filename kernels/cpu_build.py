"""Small C++ kernels for the CPU, compiled once per machine with the host's compiler.

torch's extension loader builds each source (``-O3 -march=native``) into
``~/.cache/torch_extensions``. Here the compile runs in a child process, and a finished
build is recorded beside it (``pdserve-built.json``: a digest of the source, flags and
toolchain, and the file it produced), so a process whose kernel is built imports the
file directly: no compiler, no build lock (which a process killed mid-check leaves
behind, and which torch's loader would wait on without end). A machine without a
compiler (or headers) gets ``None`` and one warning: every caller keeps a torch path
that needs no build.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

FLAGS = ["-O3", "-march=native"]
STAMP = "pdserve-built.json"
COMPILE_TIMEOUT_S = 900.0

# Run as ``python -c``: reads {name, source, flags} on stdin, builds with torch's loader
# and prints the built file's path last.
_CHILD = ("import json, sys\n"
          "from torch.utils.cpp_extension import load_inline\n"
          "a = json.load(sys.stdin)\n"
          "m = load_inline(name=a['name'], cpp_sources=a['source'], extra_cflags=a['flags'])\n"
          "print(m.__file__)\n")


class CppKernel:
    """One extension module, loaded at most once per process, by the first caller."""

    def __init__(self, name: str, source: str, fallback: str) -> None:
        self.name, self.source, self.fallback = name, source, fallback
        self._lock = threading.Lock()  # held for the whole load (and build)
        self._start = threading.Lock()  # held only to start the background load
        self._built: list = []  # [module or None] once tried
        self._background: threading.Thread | None = None
        self._compiling = False  # waiting for a child's compile (nothing of ours in C++)

    def module(self):
        """The built module, or None where it cannot be built (builds it, waiting)."""
        if self._built:
            return self._built[0]
        with self._lock:
            if not self._built:
                try:
                    mod = self._load()
                except Exception as exc:  # no compiler, no headers: the torch path works
                    log.warning("%s unavailable (%s); %s", self.name, exc, self.fallback)
                    mod = None
                self._built.append(mod)
        return self._built[0]

    def _load(self):
        import torch  # noqa: F401  (the built file links against it)

        digest = self.digest()
        path = built_file(self.name, digest)
        if path is None:
            self._compiling = True
            try:
                path = self._compile()
            finally:
                self._compiling = False
            record_built(self.name, digest, path)
        return import_file(path)

    def digest(self) -> str:
        import torch

        key = json.dumps([self.source, FLAGS, torch.__version__, sys.version])
        return hashlib.sha256(key.encode()).hexdigest()[:32]

    def _compile(self) -> str:
        """Build in a child process; the path of the built file. A child outlives this
        process if it exits first, so the build still finishes and frees its lock."""
        _clear_stale_lock(self.name)
        done = subprocess.run(
            [sys.executable, "-c", _CHILD], capture_output=True, text=True,
            input=json.dumps({"name": self.name, "source": self.source, "flags": FLAGS}),
            timeout=COMPILE_TIMEOUT_S)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise RuntimeError("build failed: " + " | ".join(tail))
        return done.stdout.strip().splitlines()[-1]

    def available(self) -> bool:
        """Whether the module is built (builds it on first call, waiting for it)."""
        return self.module() is not None

    def ready(self) -> bool:
        """Whether the module is loaded, without waiting: the first call starts the load
        in a thread (tens of seconds where it must compile), so a caller runs its torch
        path meanwhile instead of stalling on a compiler."""
        if self._built:
            return self._built[0] is not None
        # Never the build's own lock: a caller on an event loop must not wait out a compile.
        with self._start:
            if self._background is None:
                self._background = threading.Thread(target=self.module, daemon=True,
                                                    name=f"{self.name}-build")
                _LOADS.append(self)
                self._background.start()
        return False


def built_file(name: str, digest: str) -> str | None:
    """The file a finished build of this digest produced, or None."""
    from torch.utils.cpp_extension import _get_build_directory

    stamp = Path(_get_build_directory(name, verbose=False)) / STAMP
    try:
        path = json.loads(stamp.read_text()).get(digest)
    except (OSError, ValueError, AttributeError):
        return None
    return path if isinstance(path, str) and os.path.isfile(path) else None


def record_built(name: str, digest: str, path: str) -> None:
    """Record ``path`` as the build of ``digest`` (atomically: readers see all or none)."""
    from torch.utils.cpp_extension import _get_build_directory

    stamp = Path(_get_build_directory(name, verbose=False)) / STAMP
    try:
        known = json.loads(stamp.read_text())
        known = known if isinstance(known, dict) else {}
    except (OSError, ValueError):
        known = {}
    known[digest] = path
    tmp = stamp.with_name(f"{STAMP}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known))
    os.replace(tmp, stamp)


def import_file(path: str):
    """Import an extension module from its built file (named as its init symbol)."""
    spec = importlib.util.spec_from_file_location(Path(path).name.split(".")[0], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# A process that exits while a load thread is inside C++ (a built file's initialisation,
# or torch's own code on the way to it) aborts ("terminate called without an active
# exception", exit -6) when finalization stops that thread; so exiting waits for a
# load in progress (a fraction of a second once built). A compile is not waited for:
# the thread only waits for its child, which finishes the build on its own.
_LOADS: list[CppKernel] = []
EXIT_WAIT_S = 10.0


@atexit.register
def _finish_loads() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for kernel in _LOADS:
        thread = kernel._background
        while (thread is not None and thread.is_alive() and not kernel._compiling
               and time.monotonic() < deadline):
            time.sleep(0.01)


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
